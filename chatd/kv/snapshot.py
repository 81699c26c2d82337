"""KV snapshot codec: per-layer K/V tensors <-> one self-describing, checksummed byte stream.

Pure: works on binary file objects, knows no paths (files live in ``snapshot_store``). The exact
byte layout is specified in ``docs/snapshot-format.md``; this module is its reference.

Both directions stream one ``[seq, head_dim]`` head slab at a time, so memory use is bounded by a
few slab-sized scratch buffers, never the whole cache; the body's frames are in
``chatd.kv.snapshot_frames``, which decodes version 2 bodies on several threads. Readers never guess: a file that is
truncated, corrupt, of an unknown version, from another model or for other token ids is rejected
with a ``SnapshotError`` subclass whose message says why. Caller bugs (wrong tensor shapes,
dtypes, devices) are ``ValueError``.
"""

from __future__ import annotations

import hashlib
import json
import operator
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import BinaryIO

import torch
import zstandard

from chatd.errors import (
    SnapshotCorrupt,
    SnapshotIdsMismatch,
    SnapshotModelMismatch,
    SnapshotTruncated,
    SnapshotVersionError,
)
from chatd.kv.snapshot_frames import (
    PARALLEL_MIN_BYTES,
    BodyDecoder,
    PlaneKernels,
    decode_body_v1,
    default_threads,
    encode_body,
)

FORMAT_VERSION = 2  # what write_snapshot writes by default
READABLE_VERSIONS = (1, 2)
MAGIC = b"CHATDKV\x00"

# Stable across all versions: magic, version u16, payload length u32, crc32 of those 14 bytes.
_PREFIX = struct.Struct("<8sHI")
_PREFIX_CRC = struct.Struct("<I")
PREFIX_BYTES = _PREFIX.size + _PREFIX_CRC.size  # 18
# Payload after the two strings (versions 1 and 2): live dtype, stored dtype, layers, kv heads, head dim, level, tokens.
_FIXED = struct.Struct("<BBIIIiI")
MAX_HEADER_PAYLOAD = 1 << 26  # 64 MiB: ~16M token ids; anything larger is not a file we wrote
MAX_TEXT_BYTES = 0xFFFF
# zstd's fast (negative) level the int8 bodies are written at by default (default_level)
FAST_LEVEL = -3

# On-disk dtype codes; values are part of the format and never reused.
# int8: a quantised cache's rows, each head_dim values and their fp32 scale's 4 bytes (chatd.engine.pool.paged); its
# fingerprint's head_dim is that row width.
_DTYPE_CODES: dict[str, int] = {"float32": 1, "bfloat16": 2, "float16": 3, "int8": 4}
_CODE_DTYPES = {code: name for name, code in _DTYPE_CODES.items()}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}
# (live dtype, stored dtype) pairs allowed besides the lossless "stored == live".
_LOSSY_MODES = {("float32", "bfloat16")}

Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ModelFingerprint:
    """What a snapshot's tensors belong to. Two fingerprints are compatible only if all fields are equal."""

    model_id: str  # e.g. "SmolLM2-135M-Instruct"
    weights_hash: str  # hex digest identifying the weights
    dtype: str  # torch dtype name of the live cache: "float32" | "bfloat16" | "float16" | "int8"
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


def _encode_header(fp: ModelFingerprint, token_ids: Sequence[int], stored_dtype: str, level: int,
                   version: int) -> bytes:
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
    prefix = _PREFIX.pack(MAGIC, version, len(payload))
    head = prefix + _PREFIX_CRC.pack(zlib.crc32(prefix)) + payload
    return head + struct.pack("<I", zlib.crc32(head))


def default_level(stored_dtype: str) -> int:
    """The zstd level a body of ``stored_dtype`` is written with unless the caller says otherwise: 1 for
    float caches (their byte-shuffled sign and exponent planes compress; 3 and 9 gain nothing more), and -3
    for int8 rows, whose values barely compress: zstd's negative levels store literal bytes as they are, so a
    frame decodes at the speed of a copy, much faster than level 1's, for few more bytes (the snapshot codec
    figure, docs/performance.md)."""
    return FAST_LEVEL if stored_dtype == "int8" else 1


def write_snapshot(
    out: BinaryIO,
    fingerprint: ModelFingerprint,
    token_ids: Sequence[int],
    layers: Layers,
    *,
    level: int | None = None,
    stored_dtype: str | None = None,
    version: int = FORMAT_VERSION,
    kernels: PlaneKernels | None = None,
) -> int:
    """Write one snapshot to ``out``; return the number of bytes written.

    ``layers[i]`` is layer i's (keys, values), each a CPU tensor [kv_heads, seq, head_dim] with
    dtype ``fingerprint.dtype`` and seq == len(token_ids). Views into larger buffers are fine; the
    tensors are only read. ``level``: zstd's, None for :func:`default_level` of the stored dtype.
    ``stored_dtype`` None (or equal to the live dtype) stores exact bits;
    ``"bfloat16"`` with a float32 cache stores round-to-nearest-even bf16 (half the size, lossy).
    Memory stays bounded: one head slab is shuffled and compressed at a time. ``version`` 1 writes
    the previous format (for compatibility tests and downgrades). ``kernels`` split the slabs into byte
    planes natively (the same bytes as without them, faster). Raises ValueError for
    bad arguments before writing anything; errors from ``out.write`` propagate (the caller owns
    cleanup of a partial stream).
    """
    _check_fingerprint(fingerprint)
    stored = fingerprint.dtype if stored_dtype is None else stored_dtype
    torch_dtype(stored)
    if stored != fingerprint.dtype and (fingerprint.dtype, stored) not in _LOSSY_MODES:
        raise ValueError(f"cannot store a {fingerprint.dtype} cache as {stored}")
    if level is None:
        level = default_level(stored)
    if not -(1 << 17) <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ValueError(f"zstd level {level} out of range")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"cannot write format version {version}; known: {READABLE_VERSIONS}")
    num_tokens = len(token_ids)
    _check_tensors(layers, fingerprint, num_tokens, "layers")

    header = _encode_header(fingerprint, token_ids, stored, level, version)
    out.write(header)
    return len(header) + encode_body(out, layers, fingerprint.num_kv_heads, torch_dtype(stored), level, version,
                                     kernels)


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
    if version not in READABLE_VERSIONS:
        raise SnapshotVersionError(f"format version {version}; this reader knows {READABLE_VERSIONS}")
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
    return SnapshotInfo(version, fp, token_ids, stored, level, raw_bytes)


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


def read_snapshot(
    inp: BinaryIO,
    *,
    expected: ModelFingerprint,
    expected_ids: Sequence[int] | None,
    targets: Layers,
    threads: int | None = None,
    thread_setup: Callable[[], None] | None = None,
    kernels: PlaneKernels | None = None,
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

    A version 2 body is read sequentially from ``inp`` on the calling thread and decoded on
    ``threads`` worker threads (1: on the calling thread; None: the CPUs available, at most 8, or
    the calling thread alone for bodies under 4 MiB and for bodies written at a negative level, whose
    frames decode at the speed of a copy: a second thread only contends for the file and the
    interpreter), each of which runs ``thread_setup`` first; no worker outlives the call. Errors are
    reported as a sequential reader meets them: the lowest-numbered bad frame's. Version 1 bodies
    always decode on the calling thread. ``kernels`` join the byte planes natively (the same values as
    without them, faster).
    """
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    _check_tensors(targets, expected, None, "targets")
    info = read_info(inp)
    _check_model(info, expected)
    if expected_ids is not None:
        _check_ids(info.token_ids, expected_ids)
    _check_tensors(targets, expected, info.num_tokens, "targets")

    store_dtype = torch_dtype(info.stored_dtype)
    shape = (expected.num_kv_heads, info.num_tokens, expected.head_dim)
    if info.version == 1:
        decode_body_v1(inp, targets, *shape, store_dtype, kernels)
        return info
    body_bytes = 2 * expected.num_layers * expected.num_kv_heads * info.num_tokens * expected.head_dim
    body_bytes *= store_dtype.itemsize
    if threads is None:
        workers = default_threads() if body_bytes >= PARALLEL_MIN_BYTES and info.zstd_level >= 0 else 1
    else:
        workers = threads
    BodyDecoder(inp, targets, *shape, store_dtype, workers, thread_setup, kernels).decode()
    return info
