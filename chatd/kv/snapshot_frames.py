"""The snapshot body: one zstd frame per byte-plane shuffled ``[seq, head_dim]`` head slab.

Part of the codec in ``chatd.kv.snapshot`` (which owns the header and the public API); the layout is
specified in ``docs/snapshot-format.md``. Pure: works on binary file objects.

Version 2 puts a 16-byte record before each frame (its length, a 64-bit word sum of its bytes, and a
crc32 of both bound to the frame's index), so a reader knows where every frame ends before decoding
any of it. That lets :class:`BodyDecoder` decode on several threads: each in turn reads the next frame
(the stream is still read front to back), then checks, decompresses and unshuffles it while the others
read and decode theirs (numpy, zstd and torch release the GIL for the heavy work). Version 1 frames
follow each other bare, with one crc32 over all of them at the end; :func:`decode_body_v1` reads them
one at a time on the calling thread. Where the engine built its native kernels, slabs are split into byte
planes and joined back by them (:class:`PlaneKernels`): one pass where numpy takes several.

Memory stays bounded on both sides: the writer holds one slab's planes and one compressed frame; the
v2 reader holds one compressed frame and one slab of planes per thread.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, Protocol

import numpy as np
import torch
import zstandard

from chatd.errors import SnapshotCorrupt, SnapshotTruncated

Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]

# v2: before each frame, its length, its word sum (frame_sum) and crc32 of (index, length, word sum).
RECORD = struct.Struct("<IQI")
_RECORD_CHECKED = struct.Struct("<IIQ")  # what the record check covers: index, length, word sum
_WORD = 8
_WORD_MASK = (1 << 64) - 1
# v1: after the last frame, crc32 of all frame bytes.
BODY_CRC = struct.Struct("<I")

_ZSTD_FRAME_HEADER_MAX = 18  # ZSTD_FRAMEHEADERSIZE_MAX: enough bytes to read any frame's parameters
_ZSTD_BLOCK_MAX = 1 << 17  # ZSTD_BLOCKSIZE_MAX
_READ_CHUNK = 1 << 18
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"
# Below this many body bytes (in the stored dtype) a v2 body is decoded on the calling thread alone:
# starting threads would cost more than they save.
PARALLEL_MIN_BYTES = 4 << 20
_NATIVE_SIZES = (2, 4)  # element sizes PlaneKernels take


def default_threads() -> int:
    """Decode threads when the caller does not say: the CPUs this process may run on, at most 8."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    return max(1, min(available, 8))


def max_frame_bytes(content_bytes: int) -> int:
    """Largest zstd frame a writer can produce for ``content_bytes`` of content: ZSTD_compressBound
    plus room for the frame header, block headers and the content checksum."""
    small = (_ZSTD_BLOCK_MAX - content_bytes) >> 11 if content_bytes < _ZSTD_BLOCK_MAX else 0
    blocks = content_bytes // _ZSTD_BLOCK_MAX + 1
    return content_bytes + (content_bytes >> 8) + small + _ZSTD_FRAME_HEADER_MAX + 3 * blocks + 4


def frame_sum(frame: bytes | bytearray | memoryview) -> int:
    """The sum modulo 2**64 of ``frame`` read as little-endian u64 words, the last one zero-padded.

    A change confined to one 8-byte word (any flipped bit or byte) always changes it; zstd's content
    checksum covers what it cannot see (changes that cancel out), so the pair guards every frame byte
    at several times the speed of zlib's crc32."""
    whole = len(frame) // _WORD * _WORD
    total = int(np.frombuffer(frame, dtype="<u8", count=whole // _WORD).sum(dtype=np.uint64)) if whole else 0
    tail = bytes(frame[whole:]).ljust(_WORD, b"\0")
    return (total + int.from_bytes(tail, "little")) & _WORD_MASK


# ---------------------------------------------------------------- byte planes


def _byte_rows(slab: torch.Tensor) -> np.ndarray:
    """[n, E] uint8 view of a contiguous slab's bytes, in the host's native byte order."""
    return slab.view(-1).view(torch.uint8).numpy().reshape(-1, slab.element_size())


def _plane_columns(element_size: int) -> range:
    """Column of ``_byte_rows`` holding plane p (plane 0 = most significant byte), for p in order."""
    return range(element_size - 1, -1, -1) if _LITTLE_ENDIAN_HOST else range(element_size)


class PlaneKernels(Protocol):
    """Native byte-plane joins and splits (``chatd.engine.kernels.loader.EngineKernels`` is one): one pass over memory
    where numpy takes several. Both take uint8 planes ``[E, n]`` (plane 0 the most significant byte) and the
    elements' bytes ``[n, E]``, contiguous, for E of 2 or 4."""

    def join_planes(self, planes: np.ndarray, elements: np.ndarray) -> None:
        """elements <- planes."""
        ...

    def split_planes(self, elements: np.ndarray, planes: np.ndarray) -> None:
        """planes <- elements."""
        ...


def shuffle(slab: torch.Tensor, planes: np.ndarray, kernels: PlaneKernels | None = None) -> None:
    """planes[p] <- byte p (most significant first) of every element of the contiguous slab."""
    if kernels is not None and slab.element_size() in _NATIVE_SIZES:
        kernels.split_planes(_byte_rows(slab), planes)
        return
    if slab.element_size() == 2:  # bf16 / fp16: the planes are the high and low byte of each 16-bit word
        words = _words16(slab)
        np.right_shift(words, 8, out=planes[0], casting="unsafe")
        np.copyto(planes[1], words, casting="unsafe")  # keeps the low byte
        return
    rows = _byte_rows(slab)  # [n, E]
    # One strided column copy per plane: faster in numpy than a single transposed copy.
    for plane, column in enumerate(_plane_columns(rows.shape[1])):
        planes[plane] = rows[:, column]


def unshuffle(planes: np.ndarray, slab: torch.Tensor, kernels: PlaneKernels | None = None) -> None:
    """Inverse of ``shuffle``: writes every byte of the contiguous slab from planes [E, n]."""
    if kernels is not None and slab.element_size() in _NATIVE_SIZES:
        kernels.join_planes(planes, _byte_rows(slab))
        return
    if slab.element_size() == 2:
        # Whole words, (high << 8) | low, in two vectorised passes: faster than two strided byte columns, and
        # independent of the host's byte order.
        words = _words16(slab)
        np.left_shift(planes[0], 8, out=words, dtype=np.uint16)
        np.bitwise_or(words, planes[1], out=words)
        return
    rows = _byte_rows(slab)  # [n, E]
    for plane, column in enumerate(_plane_columns(rows.shape[1])):
        rows[:, column] = planes[plane]


def _words16(slab: torch.Tensor) -> np.ndarray:
    """[n] uint16 view of a contiguous 16-bit slab's elements."""
    return slab.view(-1).view(torch.int16).numpy().view(np.uint16)


def slabs(tensors: Layers, num_kv_heads: int) -> Iterator[torch.Tensor]:
    """Every ``[seq, head_dim]`` head slab in body order: layer, then keys before values, then head."""
    for keys, values in tensors:
        for tensor in (keys, values):  # [kv_heads, seq, head_dim]
            for head in range(num_kv_heads):
                yield tensor[head].detach()


# ---------------------------------------------------------------- writing


def encode_body(out: BinaryIO, layers: Layers, num_kv_heads: int, store_dtype: torch.dtype, level: int,
                version: int, kernels: PlaneKernels | None = None) -> int:
    """Write the body (after the header) of a version 1 or 2 snapshot; return the bytes written.

    One head slab at a time is converted to the stored dtype if needed, shuffled into byte planes and
    compressed to one frame, so scratch memory is one slab's planes and one frame."""
    num_tokens, head_dim = layers[0][0].shape[1], layers[0][0].shape[2]
    staging = torch.empty((num_tokens, head_dim), dtype=store_dtype)  # [seq, head_dim] stored dtype
    scratch = np.empty((staging.element_size(), staging.numel()), dtype=np.uint8)  # [E, n] byte planes
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    written = 0
    body_crc = 0
    for index, slab in enumerate(slabs(layers, num_kv_heads)):
        if slab.dtype != store_dtype or not slab.is_contiguous():
            staging.copy_(slab)  # rounds to nearest even when narrowing fp32 -> bf16
            slab = staging
        shuffle(slab, scratch, kernels)
        frame = compressor.compress(scratch.data)
        if version >= 2:
            word_sum = frame_sum(frame)
            check = zlib.crc32(_RECORD_CHECKED.pack(index, len(frame), word_sum))
            out.write(RECORD.pack(len(frame), word_sum, check))
            written += RECORD.size
        else:
            body_crc = zlib.crc32(frame, body_crc)
        out.write(frame)
        written += len(frame)
    if version < 2:
        out.write(BODY_CRC.pack(body_crc))
        written += BODY_CRC.size
    return written


# ---------------------------------------------------------------- reading: shared checks


def _check_frame_params(head: bytes | memoryview, expected: int, index: int) -> None:
    """The frame starts with the zstd magic and declares ``expected`` content bytes and a checksum."""
    magic = bytes(head[: len(zstandard.FRAME_HEADER)])
    if magic != zstandard.FRAME_HEADER[: len(magic)]:
        raise SnapshotCorrupt(f"body frame {index} does not start with the zstd magic")
    try:
        params = zstandard.get_frame_parameters(head[:_ZSTD_FRAME_HEADER_MAX])
    except zstandard.ZstdError as exc:
        raise SnapshotCorrupt(f"body frame {index}: bad zstd frame header ({exc})") from None
    if params.content_size != expected or not params.has_checksum:
        raise SnapshotCorrupt(
            f"body frame {index} declares {params.content_size} bytes"
            f"{'' if params.has_checksum else ' without a content checksum'}, expected {expected}"
        )


def _frame_length(frame: memoryview, index: int) -> int:
    """Length of the zstd frame at the start of ``frame``, from its header and block headers (RFC
    8878 3.1.1), without decoding it. SnapshotCorrupt when the blocks run past the buffer."""
    try:
        position = zstandard.frame_header_size(frame[:_ZSTD_FRAME_HEADER_MAX])
    except zstandard.ZstdError as exc:
        raise SnapshotCorrupt(f"body frame {index}: bad zstd frame header ({exc})") from None
    has_checksum = frame[4] & 0x04
    while True:
        if position + 3 > len(frame):
            raise SnapshotCorrupt(f"body frame {index}: its blocks run past the recorded frame length")
        block = frame[position] | frame[position + 1] << 8 | frame[position + 2] << 16
        last, kind, size = block & 1, (block >> 1) & 3, block >> 3
        if kind == 3:
            raise SnapshotCorrupt(f"body frame {index}: reserved zstd block type")
        position += 3 + (1 if kind == 1 else size)  # an RLE block stores its one byte
        if last:
            return position + (4 if has_checksum else 0)


# ---------------------------------------------------------------- reading: version 2


class _Worker(threading.local):
    """Per-thread scratch of one decode: a zstd context (not thread-safe), a compressed-frame buffer
    and slab-sized planes and staging."""

    def __init__(self, max_frame: int, planes_shape: tuple[int, int], staging_shape: tuple[int, int],
                 store_dtype: torch.dtype) -> None:
        self.dctx = zstandard.ZstdDecompressor()
        self.frame = bytearray(max_frame)
        self.planes = np.empty(planes_shape, dtype=np.uint8)  # [E, n] byte planes
        self.staging = torch.empty(staging_shape, dtype=store_dtype)  # [seq, head_dim] stored dtype


class BodyDecoder:
    """Decodes a version 2 body into per-slab targets on ``threads`` threads: the calling thread and
    ``threads - 1`` helpers.

    Each thread in turn takes the next frame, reads its record and bytes from the stream (one reader
    at a time, so the stream is read sequentially), then checks, decompresses and unshuffles it into
    its slab while the others read and decode theirs. Errors are those of the lowest-numbered bad
    frame, as a sequential reader would report them; no helper touches the targets after
    :meth:`decode` returns or raises."""

    def __init__(self, inp: BinaryIO, targets: Layers, num_kv_heads: int, num_tokens: int, head_dim: int,
                 store_dtype: torch.dtype, threads: int, thread_setup: Callable[[], None] | None = None,
                 kernels: PlaneKernels | None = None) -> None:
        self._inp = inp
        self._kernels = kernels
        self._slabs = list(slabs(targets, num_kv_heads))
        self._store_dtype = store_dtype
        element_size = torch.empty((), dtype=store_dtype).element_size()
        self._content_bytes = element_size * num_tokens * head_dim
        self._max_frame = max_frame_bytes(self._content_bytes)
        self._worker = _Worker(self._max_frame, (element_size, num_tokens * head_dim), (num_tokens, head_dim),
                               store_dtype)
        self._threads = threads
        self._thread_setup = thread_setup  # run first on each helper thread
        self._lock = threading.Lock()  # guards the stream and the fields below
        self._next = 0  # the next frame to read
        self._errors: dict[int, BaseException] = {}  # frame index -> what went wrong there

    def decode(self) -> None:
        """Read and decode every frame, then check that the file ends right after the last one."""
        if self._threads <= 1:
            self._work()
        else:
            with ThreadPoolExecutor(self._threads - 1, thread_name_prefix="chatd-snapshot-decode",
                                    initializer=self._thread_setup) as pool:
                helpers = [pool.submit(self._work) for _ in range(self._threads - 1)]
                try:
                    self._work()
                finally:
                    with self._lock:
                        self._next = len(self._slabs)  # an interrupted caller stops the helpers early
                    for helper in helpers:
                        helper.result()
            # Leaving the pool's block joined the helpers: none outlives this call.
        if self._errors:
            raise self._errors[min(self._errors)]
        self._check_end()

    def _work(self) -> None:
        """Take frames in order until none is left or one failed; a failure stops every thread."""
        worker = self._worker
        while True:
            with self._lock:
                index = self._next
                if index >= len(self._slabs) or self._errors:
                    return
                self._next += 1
                try:
                    length, word_sum = self._read_frame(index, worker.frame)
                except Exception as error:
                    self._errors[index] = error
                    return
            try:
                self._decode_frame(index, memoryview(worker.frame)[:length], word_sum)
            except Exception as error:
                with self._lock:
                    self._errors[index] = error
                return

    def _read_exact_into(self, view: memoryview, what: str) -> None:
        filled = 0
        readinto: Callable[[memoryview], int | None] | None = getattr(self._inp, "readinto", None)
        while filled < len(view):
            if readinto is not None:
                got = readinto(view[filled:]) or 0
            else:
                data = self._inp.read(len(view) - filled)
                got = len(data)
                view[filled : filled + got] = data
            if got == 0:
                raise SnapshotTruncated(f"file ends inside {what}: got {filled} of {len(view)} bytes")
            filled += got

    def _read_frame(self, index: int, buffer: bytearray) -> tuple[int, int]:
        """Read frame ``index``'s record, then its bytes into ``buffer``; return (frame length, word
        sum). The record's own check makes its length trustworthy before any frame byte is read."""
        record = bytearray(RECORD.size)
        head = self._inp.read(RECORD.size)
        if not head:
            raise SnapshotTruncated(f"file ends before body frame {index}")
        record[: len(head)] = head
        if len(head) < RECORD.size:
            self._read_exact_into(memoryview(record)[len(head) :], f"body frame {index}'s record")
        length, word_sum, check = RECORD.unpack(record)
        if zlib.crc32(_RECORD_CHECKED.pack(index, length, word_sum)) != check:
            raise SnapshotCorrupt(f"body frame {index}'s record checksum mismatch")
        if length > self._max_frame:
            raise SnapshotCorrupt(f"body frame {index} is {length} bytes, more than any frame of "
                                  f"{self._content_bytes} content bytes")
        self._read_exact_into(memoryview(buffer)[:length], f"body frame {index}")
        return length, word_sum

    def _decode_frame(self, index: int, frame: memoryview, word_sum: int) -> None:
        """Check the frame's sum and structure, decompress it into this thread's planes, unshuffle
        those into the slab."""
        if frame_sum(frame) != word_sum:
            raise SnapshotCorrupt(f"body frame {index} word sum mismatch")
        _check_frame_params(frame, self._content_bytes, index)
        if _frame_length(frame, index) != len(frame):
            raise SnapshotCorrupt(f"body frame {index} does not end where its record says")
        worker = self._worker
        flat = worker.planes.reshape(-1)
        try:
            reader = worker.dctx.stream_reader(frame)
            filled = 0
            while filled < flat.size and (got := reader.readinto(flat[filled:])):
                filled += got
            if filled != flat.size or reader.readinto(bytearray(1)):
                raise SnapshotCorrupt(f"body frame {index} decoded to {filled} bytes, expected {flat.size}")
        except zstandard.ZstdError as exc:
            raise SnapshotCorrupt(f"body frame {index}: {exc}") from None
        slab = self._slabs[index]
        if slab.dtype == self._store_dtype and slab.is_contiguous():  # unshuffle in place
            unshuffle(worker.planes, slab, self._kernels)
        else:
            unshuffle(worker.planes, worker.staging, self._kernels)
            slab.copy_(worker.staging)  # exact: a strided copy, or bf16 -> fp32 widening

    def _check_end(self) -> None:
        if self._inp.read(1):
            raise SnapshotCorrupt("trailing bytes after the last body frame")


# ---------------------------------------------------------------- reading: version 1


class _FrameReaderV1:
    """Splits a version 1 body into consecutive zstd frames and decodes each into a byte buffer.

    Reads ``inp`` in bounded chunks; bytes past a frame's end are kept for the next frame.
    """

    def __init__(self, inp: BinaryIO) -> None:
        self._inp = inp
        self._pending = b""
        self._eof = False
        self._dctx = zstandard.ZstdDecompressor()
        self._crc = 0  # crc32 of the frame bytes consumed so far

    def _fill(self, size: int) -> None:
        while len(self._pending) < size and not self._eof:
            chunk = self._inp.read(_READ_CHUNK)
            if chunk:
                self._pending += chunk
            else:
                self._eof = True

    def read_frame(self, dest: np.ndarray, index: int) -> None:
        """Decode frame ``index`` into ``dest`` (1-D uint8), which it must fill exactly."""
        expected = dest.size
        self._fill(_ZSTD_FRAME_HEADER_MAX)
        if not self._pending:
            raise SnapshotTruncated(f"file ends before body frame {index}")
        head = self._pending[: len(zstandard.FRAME_HEADER)]
        if self._eof and len(self._pending) < _ZSTD_FRAME_HEADER_MAX and head == zstandard.FRAME_HEADER[: len(head)]:
            try:
                zstandard.get_frame_parameters(self._pending)
            except zstandard.ZstdError:
                raise SnapshotTruncated(f"file ends inside body frame {index}'s header") from None
        _check_frame_params(self._pending, expected, index)
        dobj = self._dctx.decompressobj()
        filled = 0
        while True:
            if not self._pending:
                self._fill(1)
                if not self._pending:
                    raise SnapshotTruncated(f"file ends inside body frame {index}")
            try:
                out = dobj.decompress(self._pending)
            except zstandard.ZstdError as exc:
                raise SnapshotCorrupt(f"body frame {index}: {exc}") from None
            if filled + len(out) > expected:
                raise SnapshotCorrupt(f"body frame {index} decodes to more than {expected} bytes")
            dest[filled : filled + len(out)] = np.frombuffer(out, dtype=np.uint8)
            filled += len(out)
            if dobj.eof:
                unused = dobj.unused_data
                self._crc = zlib.crc32(self._pending[: len(self._pending) - len(unused)], self._crc)
                self._pending = unused
                break
            self._crc = zlib.crc32(self._pending, self._crc)
            self._pending = b""
        if filled != expected:
            raise SnapshotCorrupt(f"body frame {index} decoded to {filled} bytes, expected {expected}")

    def check_end(self) -> None:
        """Verify the body checksum that follows the last frame, then end of file."""
        self._fill(BODY_CRC.size + 1)
        if len(self._pending) < BODY_CRC.size:
            raise SnapshotTruncated("file ends inside the body checksum")
        (stored,) = BODY_CRC.unpack_from(self._pending)
        if stored != self._crc:
            raise SnapshotCorrupt("body checksum mismatch")
        if len(self._pending) > BODY_CRC.size:
            raise SnapshotCorrupt("trailing bytes after the body checksum")


def decode_body_v1(inp: BinaryIO, targets: Layers, num_kv_heads: int, num_tokens: int, head_dim: int,
                   store_dtype: torch.dtype, kernels: PlaneKernels | None = None) -> None:
    """Decode a version 1 body into the targets, one frame at a time on the calling thread."""
    staging = torch.empty((num_tokens, head_dim), dtype=store_dtype)  # [seq, head_dim]
    planes = np.empty((staging.element_size(), staging.numel()), dtype=np.uint8)  # [E, n] byte planes
    flat = planes.reshape(-1)
    reader = _FrameReaderV1(inp)
    for index, slab in enumerate(slabs(targets, num_kv_heads)):
        reader.read_frame(flat, index)
        if slab.dtype == store_dtype and slab.is_contiguous():  # unshuffle in place, no staging copy
            unshuffle(planes, slab, kernels)
        else:
            unshuffle(planes, staging, kernels)
            slab.copy_(staging)  # exact: a strided copy, or bf16 -> fp32 widening
    reader.check_end()
