"""KV snapshot codec: per-layer K/V tensors <-> one self-describing, checksummed byte stream.

Pure: works on binary file objects, knows no paths (files live in ``snapshot_store``). The exact
byte layout is specified in ``docs/snapshot-format.md``; this module is its reference.

Both directions stream one ``[seq, head_dim]`` head slab at a time, so memory use is bounded by a
few slab-sized scratch buffers, never the whole cache. Readers never guess: a file that is
truncated, corrupt, of an unknown version, from another model or for other token ids is rejected
with a ``SnapshotError`` subclass whose message says why. Caller bugs (wrong tensor shapes,
dtypes, devices) are ``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
import operator
import struct
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import BinaryIO

import numpy as np
import torch
import zstandard

from chatd.errors import (
    SnapshotCorrupt,
    SnapshotIdsMismatch,
    SnapshotModelMismatch,
    SnapshotTruncated,
    SnapshotVersionError,
)

FORMAT_VERSION = 1
MAGIC = b"CHATDKV\x00"

# Stable across all versions: magic, version u16, payload length u32, crc32 of those 14 bytes.
_PREFIX = struct.Struct("<8sHI")
_PREFIX_CRC = struct.Struct("<I")
PREFIX_BYTES = _PREFIX.size + _PREFIX_CRC.size  # 18
# v1 payload after the two strings: live dtype, stored dtype, layers, kv heads, head dim, level, tokens.
_FIXED = struct.Struct("<BBIIIiI")
# After the last frame: crc32 of all frame bytes. zstd's own checks miss a few bits (e.g. the frame
# header's "unused" bit, which decoders must ignore); this makes any flipped body byte detectable.
_BODY_CRC = struct.Struct("<I")
MAX_HEADER_PAYLOAD = 1 << 26  # 64 MiB: ~16M token ids; anything larger is not a file we wrote
MAX_TEXT_BYTES = 0xFFFF

# On-disk dtype codes; values are part of the format and never reused.
_DTYPE_CODES: dict[str, int] = {"float32": 1, "bfloat16": 2, "float16": 3}
_CODE_DTYPES = {code: name for name, code in _DTYPE_CODES.items()}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (live dtype, stored dtype) pairs allowed besides the lossless "stored == live".
_LOSSY_MODES = {("float32", "bfloat16")}

_ZSTD_FRAME_HEADER_MAX = 18  # ZSTD_FRAMEHEADERSIZE_MAX: enough bytes to read any frame's parameters
_READ_CHUNK = 1 << 18
_LITTLE_ENDIAN_HOST = sys.byteorder == "little"

Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ModelFingerprint:
    """What a snapshot's tensors belong to. Two fingerprints are compatible only if all fields are equal."""

    model_id: str  # e.g. "SmolLM2-135M-Instruct"
    weights_hash: str  # hex digest identifying the weights
    dtype: str  # torch dtype name of the live cache: "float32" | "bfloat16" | "float16"
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def digest(self) -> str:
        """sha256 hex of the fields as a compact JSON list, in declaration order; stable across releases."""
        values = [getattr(self, f.name) for f in fields(self)]
        return hashlib.sha256(json.dumps(values, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class SnapshotInfo:
    """Everything a snapshot header says. Every tensor is [num_kv_heads, num_tokens, head_dim]."""

    version: int
    fingerprint: ModelFingerprint
    token_ids: tuple[int, ...]
    stored_dtype: str  # dtype of the tensor bytes in the body ("float32", "bfloat16", ...)
    zstd_level: int
    raw_bytes: int  # bytes of K/V in the live dtype (what the restored cache occupies)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def lossless(self) -> bool:
        """True when the body holds the live dtype's exact bits."""
        return self.stored_dtype == self.fingerprint.dtype


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a supported dtype name; ValueError for any other name."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}; supported: {sorted(_TORCH_DTYPES)}") from None


def snapshot_targets_shape(fingerprint: ModelFingerprint, num_tokens: int) -> tuple[int, int, int]:
    """Shape every K and V target must have: (num_kv_heads, num_tokens, head_dim)."""
    return (fingerprint.num_kv_heads, num_tokens, fingerprint.head_dim)


def allocate_targets(
    fingerprint: ModelFingerprint, num_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fresh CPU targets for ``read_snapshot``: per layer (K, V), each [kv_heads, num_tokens, head_dim]."""
    shape = snapshot_targets_shape(fingerprint, num_tokens)
    dtype = torch_dtype(fingerprint.dtype)
    return [
        (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
        for _ in range(fingerprint.num_layers)
    ]


# ---------------------------------------------------------------- byte planes


def _byte_rows(slab: torch.Tensor) -> np.ndarray:
    """[n, E] uint8 view of a contiguous slab's bytes, in the host's native byte order."""
    return slab.view(-1).view(torch.uint8).numpy().reshape(-1, slab.element_size())


def _plane_columns(element_size: int) -> range:
    """Column of ``_byte_rows`` holding plane p (plane 0 = most significant byte), for p in order."""
    return range(element_size - 1, -1, -1) if _LITTLE_ENDIAN_HOST else range(element_size)


def _shuffle(slab: torch.Tensor, planes: np.ndarray) -> None:
    """planes[p] <- byte p (most significant first) of every element of the contiguous slab."""
    rows = _byte_rows(slab)  # [n, E]
    # One strided column copy per plane: ~3x faster in numpy than a single transposed copy.
    for plane, column in enumerate(_plane_columns(rows.shape[1])):
        planes[plane] = rows[:, column]


def _unshuffle(planes: np.ndarray, slab: torch.Tensor) -> None:
    """Inverse of ``_shuffle``: writes every byte of the contiguous slab from planes [E, n]."""
    rows = _byte_rows(slab)  # [n, E]
    for plane, column in enumerate(_plane_columns(rows.shape[1])):
        rows[:, column] = planes[plane]


# ---------------------------------------------------------------- writing


def _check_fingerprint(fp: ModelFingerprint) -> None:
    torch_dtype(fp.dtype)
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        value = getattr(fp, name)
        if not isinstance(value, int) or not 1 <= value < 1 << 32:
            raise ValueError(f"fingerprint.{name} must be an int in [1, 2**32), got {value!r}")


def _check_tensors(tensors: Layers, fp: ModelFingerprint, num_tokens: int | None, what: str) -> None:
    """ValueError unless tensors is num_layers (K, V) pairs of CPU [kv_heads, seq, head_dim] in fp.dtype."""
    if len(tensors) != fp.num_layers:
        raise ValueError(f"{what}: expected {fp.num_layers} layers, got {len(tensors)}")
    dtype = torch_dtype(fp.dtype)
    for index, pair in enumerate(tensors):
        if len(pair) != 2:
            raise ValueError(f"{what}[{index}]: expected a (keys, values) pair")
        for kind, tensor in zip("KV", pair, strict=True):
            shape = tuple(tensor.shape)
            ok_shape = len(shape) == 3 and shape[0] == fp.num_kv_heads and shape[2] == fp.head_dim
            if not ok_shape or (num_tokens is not None and shape[1] != num_tokens):
                seq = "seq" if num_tokens is None else num_tokens
                want = (fp.num_kv_heads, seq, fp.head_dim)
                raise ValueError(f"{what}[{index}] {kind}: shape {shape}, expected {want}")
            if tensor.dtype != dtype:
                raise ValueError(f"{what}[{index}] {kind}: dtype {tensor.dtype}, expected {dtype}")
            if tensor.device.type != "cpu":
                raise ValueError(f"{what}[{index}] {kind}: on {tensor.device}, expected a CPU tensor")


def _pack_text(value: str) -> bytes:
    raw = value.encode()
    if len(raw) > MAX_TEXT_BYTES:
        raise ValueError(f"fingerprint text {value[:40]!r}... is longer than {MAX_TEXT_BYTES} UTF-8 bytes")
    return struct.pack("<H", len(raw)) + raw


def _encode_header(fp: ModelFingerprint, token_ids: Sequence[int], stored_dtype: str, level: int) -> bytes:
    ids = [operator.index(token_id) for token_id in token_ids]
    if any(not 0 <= token_id < 1 << 32 for token_id in ids):
        raise ValueError("token ids must be ints in [0, 2**32)")
    codes = (_DTYPE_CODES[fp.dtype], _DTYPE_CODES[stored_dtype])
    fixed = _FIXED.pack(*codes, fp.num_layers, fp.num_kv_heads, fp.head_dim, level, len(ids))
    payload = (
        _pack_text(fp.model_id) + _pack_text(fp.weights_hash) + fixed + struct.pack(f"<{len(ids)}I", *ids)
    )
    if len(payload) > MAX_HEADER_PAYLOAD:
        raise ValueError(f"header of {len(payload)} bytes exceeds {MAX_HEADER_PAYLOAD}: too many token ids")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(payload))
    head = prefix + _PREFIX_CRC.pack(zlib.crc32(prefix)) + payload
    return head + struct.pack("<I", zlib.crc32(head))


def write_snapshot(
    out: BinaryIO,
    fingerprint: ModelFingerprint,
    token_ids: Sequence[int],
    layers: Layers,
    *,
    level: int = 1,
    stored_dtype: str | None = None,
) -> int:
    """Write one snapshot to ``out``; return the number of bytes written.

    ``layers[i]`` is layer i's (keys, values), each a CPU tensor [kv_heads, seq, head_dim] with
    dtype ``fingerprint.dtype`` and seq == len(token_ids). Views into larger buffers are fine; the
    tensors are only read. ``stored_dtype`` None (or equal to the live dtype) stores exact bits;
    ``"bfloat16"`` with a float32 cache stores round-to-nearest-even bf16 (half the size, lossy).
    Memory stays bounded: one head slab is shuffled and compressed at a time. Raises ValueError for
    bad arguments before writing anything; errors from ``out.write`` propagate (the caller owns
    cleanup of a partial stream).
    """
    _check_fingerprint(fingerprint)
    stored = fingerprint.dtype if stored_dtype is None else stored_dtype
    torch_dtype(stored)
    if stored != fingerprint.dtype and (fingerprint.dtype, stored) not in _LOSSY_MODES:
        raise ValueError(f"cannot store a {fingerprint.dtype} cache as {stored}")
    if not -(1 << 17) <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ValueError(f"zstd level {level} out of range")
    num_tokens = len(token_ids)
    _check_tensors(layers, fingerprint, num_tokens, "layers")

    header = _encode_header(fingerprint, token_ids, stored, level)
    out.write(header)
    written = len(header)

    store_dtype = torch_dtype(stored)
    slab_shape = (num_tokens, fingerprint.head_dim)
    staging = torch.empty(slab_shape, dtype=store_dtype)  # [seq, head_dim] stored dtype
    scratch = np.empty((staging.element_size(), staging.numel()), dtype=np.uint8)  # [E, n] byte planes
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    body_crc = 0
    for keys, values in layers:
        for tensor in (keys, values):  # [kv_heads, seq, head_dim] live dtype
            for head in range(fingerprint.num_kv_heads):
                slab = tensor[head].detach()  # [seq, head_dim]
                if slab.dtype != store_dtype or not slab.is_contiguous():
                    staging.copy_(slab)  # rounds to nearest even when narrowing fp32 -> bf16
                    slab = staging
                _shuffle(slab, scratch)
                frame = compressor.compress(scratch.data)
                out.write(frame)
                written += len(frame)
                body_crc = zlib.crc32(frame, body_crc)
    out.write(_BODY_CRC.pack(body_crc))
    return written + _BODY_CRC.size


# ---------------------------------------------------------------- reading


def _read_upto(inp: BinaryIO, size: int) -> bytes:
    """Up to ``size`` bytes; fewer only at end of file (raw streams may return short reads)."""
    data = inp.read(size)
    while len(data) < size and (more := inp.read(size - len(data))):
        data += more
    return data


def _read_exact(inp: BinaryIO, size: int, what: str) -> bytes:
    data = _read_upto(inp, size)
    if len(data) < size:
        raise SnapshotTruncated(f"file ends inside the {what}: got {len(data)} of {size} bytes")
    return data


def _decode_text(payload: bytes, offset: int, what: str) -> tuple[str, int]:
    if offset + 2 > len(payload):
        raise SnapshotCorrupt(f"header too short for {what}")
    (length,) = struct.unpack_from("<H", payload, offset)
    offset += 2
    if offset + length > len(payload):
        raise SnapshotCorrupt(f"header too short for {what}")
    try:
        return payload[offset : offset + length].decode(), offset + length
    except UnicodeDecodeError:
        raise SnapshotCorrupt(f"{what} is not valid UTF-8") from None


def read_info(inp: BinaryIO) -> SnapshotInfo:
    """Read and validate the header only; ``inp`` is left positioned at the first body byte.

    Checks, in order: magic, prefix checksum, version, header checksum, header consistency.
    Raises SnapshotTruncated / SnapshotCorrupt / SnapshotVersionError; never reads the body.
    """
    prefix = _read_upto(inp, PREFIX_BYTES)
    if not MAGIC.startswith(prefix[: len(MAGIC)]):  # judged on what exists, so short junk is not "truncated"
        raise SnapshotCorrupt(f"bad magic {prefix[: len(MAGIC)]!r}: not a chatd KV snapshot")
    if len(prefix) < PREFIX_BYTES:
        raise SnapshotTruncated(
            f"file ends inside the header prefix: got {len(prefix)} of {PREFIX_BYTES} bytes"
        )
    _, version, payload_len = _PREFIX.unpack_from(prefix)
    (prefix_crc,) = _PREFIX_CRC.unpack_from(prefix, _PREFIX.size)
    if zlib.crc32(prefix[: _PREFIX.size]) != prefix_crc:
        raise SnapshotCorrupt("header prefix checksum mismatch")
    if version != FORMAT_VERSION:
        raise SnapshotVersionError(f"format version {version}; this reader knows only {FORMAT_VERSION}")
    if payload_len > MAX_HEADER_PAYLOAD:
        raise SnapshotCorrupt(f"header length {payload_len} exceeds {MAX_HEADER_PAYLOAD}")
    payload = _read_exact(inp, payload_len, "header")
    (header_crc,) = struct.unpack("<I", _read_exact(inp, 4, "header checksum"))
    if zlib.crc32(prefix + payload) != header_crc:
        raise SnapshotCorrupt("header checksum mismatch")

    model_id, offset = _decode_text(payload, 0, "model id")
    weights_hash, offset = _decode_text(payload, offset, "weights hash")
    if offset + _FIXED.size > len(payload):
        raise SnapshotCorrupt("header too short for the shape fields")
    live_code, stored_code, num_layers, num_kv_heads, head_dim, level, num_tokens = _FIXED.unpack_from(
        payload, offset
    )
    offset += _FIXED.size
    if offset + 4 * num_tokens != len(payload):
        raise SnapshotCorrupt(
            f"header length {len(payload)} does not match {num_tokens} token ids after {offset} bytes"
        )
    live, stored = _CODE_DTYPES.get(live_code), _CODE_DTYPES.get(stored_code)
    if live is None or stored is None:
        raise SnapshotCorrupt(f"unknown dtype code: live {live_code}, stored {stored_code}")
    if stored != live and (live, stored) not in _LOSSY_MODES:
        raise SnapshotCorrupt(f"impossible dtype pair: {live} cache stored as {stored}")
    if min(num_layers, num_kv_heads, head_dim) < 1:
        raise SnapshotCorrupt(f"zero-sized shape: {num_layers} layers, {num_kv_heads} heads, dim {head_dim}")
    token_ids = struct.unpack_from(f"<{num_tokens}I", payload, offset)
    fp = ModelFingerprint(model_id, weights_hash, live, num_layers, num_kv_heads, head_dim)
    raw_bytes = 2 * num_layers * num_kv_heads * num_tokens * head_dim * torch_dtype(live).itemsize
    return SnapshotInfo(FORMAT_VERSION, fp, token_ids, stored, level, raw_bytes)


def _check_model(info: SnapshotInfo, expected: ModelFingerprint) -> None:
    for f in fields(ModelFingerprint):
        got, want = getattr(info.fingerprint, f.name), getattr(expected, f.name)
        if got != want:
            raise SnapshotModelMismatch(f"{f.name} is {got!r} in the snapshot, expected {want!r}")


def _check_ids(stored: tuple[int, ...], expected: Sequence[int]) -> None:
    if stored == tuple(expected):
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(stored, expected, strict=False)) if a != b),
        min(len(stored), len(expected)),
    )
    raise SnapshotIdsMismatch(
        f"snapshot has {len(stored)} token ids, expected {len(expected)}; first difference at index {first}"
    )


class _FrameReader:
    """Splits the body into consecutive zstd frames and decodes each into a byte buffer.

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
        if head != zstandard.FRAME_HEADER[: len(head)]:
            raise SnapshotCorrupt(f"body frame {index} does not start with the zstd magic")
        try:
            params = zstandard.get_frame_parameters(self._pending[:_ZSTD_FRAME_HEADER_MAX])
        except zstandard.ZstdError as exc:
            if self._eof and len(self._pending) < _ZSTD_FRAME_HEADER_MAX:
                raise SnapshotTruncated(f"file ends inside body frame {index}'s header") from None
            raise SnapshotCorrupt(f"body frame {index}: bad zstd frame header ({exc})") from None
        if params.content_size != expected or not params.has_checksum:
            raise SnapshotCorrupt(
                f"body frame {index} declares {params.content_size} bytes"
                f"{'' if params.has_checksum else ' without a content checksum'}, expected {expected}"
            )
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
        self._fill(_BODY_CRC.size + 1)
        if len(self._pending) < _BODY_CRC.size:
            raise SnapshotTruncated("file ends inside the body checksum")
        (stored,) = _BODY_CRC.unpack_from(self._pending)
        if stored != self._crc:
            raise SnapshotCorrupt("body checksum mismatch")
        if len(self._pending) > _BODY_CRC.size:
            raise SnapshotCorrupt("trailing bytes after the body checksum")


def read_snapshot(
    inp: BinaryIO,
    *,
    expected: ModelFingerprint,
    expected_ids: Sequence[int] | None,
    targets: Layers,
) -> SnapshotInfo:
    """Validate a snapshot and decode its body straight into the preallocated ``targets``.

    ``targets`` follows ``write_snapshot``'s layers convention: ``expected.num_layers`` (K, V) pairs
    of CPU tensors [kv_heads, seq, head_dim] in ``expected.dtype``, with seq == the snapshot's token
    count; views into larger buffers are fine and memory outside them is never written. Raises
    ValueError for targets of the wrong count/shape/dtype/device (before writing any of them).
    The header, model (SnapshotModelMismatch names the field) and ids (SnapshotIdsMismatch) are all
    checked before any body byte is decoded; then SnapshotTruncated / SnapshotCorrupt for a bad body
    or trailing bytes. On any error the targets' contents are unspecified. Lossless snapshots
    restore bit-exactly; a bf16-stored float32 snapshot restores the bf16 values widened exactly.
    """
    _check_tensors(targets, expected, None, "targets")
    info = read_info(inp)
    _check_model(info, expected)
    if expected_ids is not None:
        _check_ids(info.token_ids, expected_ids)
    _check_tensors(targets, expected, info.num_tokens, "targets")

    store_dtype = torch_dtype(info.stored_dtype)
    staging = torch.empty((info.num_tokens, expected.head_dim), dtype=store_dtype)  # [seq, head_dim]
    scratch = np.empty((staging.element_size(), staging.numel()), dtype=np.uint8)  # [E, n] byte planes
    flat = scratch.reshape(-1)
    reader = _FrameReader(inp)
    index = 0
    for keys, values in targets:
        for tensor in (keys, values):  # [kv_heads, seq, head_dim] live dtype
            for head in range(expected.num_kv_heads):
                reader.read_frame(flat, index)
                index += 1
                slab = tensor[head].detach()  # [seq, head_dim]
                if slab.dtype == store_dtype and slab.is_contiguous():  # shuffle in place, no staging copy
                    _unshuffle(scratch, slab)
                else:
                    _unshuffle(scratch, staging)
                    slab.copy_(staging)  # exact: a strided copy, or bf16 -> fp32 widening
    reader.check_end()
    return info
