"""Snapshot codec: bit-exact round trips, streaming into views, and every kind of bad file rejected."""

from __future__ import annotations

import dataclasses
import functools
import io
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from chatd.engine.kernels.loader import EngineKernels, load_kernels
from chatd.engine.pool.paged import INT8_SCALE_BYTES, dequantize_rows, quantize_rows
from chatd.errors import (
    SnapshotCorrupt,
    SnapshotError,
    SnapshotIdsMismatch,
    SnapshotModelMismatch,
    SnapshotTruncated,
    SnapshotVersionError,
)
from chatd.kv.snapshot import (
    FORMAT_VERSION,
    MAGIC,
    PREFIX_BYTES,
    ModelFingerprint,
    SnapshotInfo,
    allocate_targets,
    default_level,
    read_info,
    read_snapshot,
    snapshot_targets_shape,
    write_snapshot,
)
from chatd.kv.snapshot_frames import RECORD, default_threads, frame_sum

KVPairs = list[tuple[torch.Tensor, torch.Tensor]]
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def fingerprint(dtype: str = "float32", num_layers: int = 30, num_kv_heads: int = 3, head_dim: int = 64):
    return ModelFingerprint("SmolLM2-135M-Instruct", "ab12" * 16, dtype, num_layers, num_kv_heads, head_dim)


def kv_like(fp: ModelFingerprint, num_tokens: int, seed: int = 0) -> KVPairs:
    """Random K/V shaped like a real cache: per-channel scales, so byte planes differ like real KV."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, fp.dtype)
    shape = (fp.num_kv_heads, num_tokens, fp.head_dim)
    layers = []
    for _ in range(fp.num_layers):
        scale = torch.rand((fp.num_kv_heads, 1, fp.head_dim), generator=gen) * 4
        keys = torch.randn(shape, generator=gen) * scale
        values = torch.randn(shape, generator=gen) * 0.5
        layers.append((keys.to(dtype), values.to(dtype)))
    return layers


def with_special_values(layers: KVPairs) -> KVPairs:
    """Plant -0.0, +-inf, NaNs with distinct payloads and subnormals into the first layer's K and V."""
    keys, values = layers[0]
    ints = INT_VIEW[keys.dtype]
    bits = keys.view(ints).reshape(-1)
    if keys.dtype == torch.float32:
        # -0.0, +inf, -inf, quiet NaN with payload, signalling NaN, negative NaN, subnormals.
        specials = [0x80000000, 0x7F800000, 0xFF800000, 0x7FC00001, 0x7F800123, 0xFFC0BEEF, 0x1, 0x807FFFFF]
    else:  # 16-bit: bf16 and fp16 both put the sign in the top bit
        exp_all = 0x7F80 if keys.dtype == torch.bfloat16 else 0x7C00
        specials = [0x8000, exp_all, exp_all | 0x8000, exp_all | 0x41, exp_all | 0x3, 0x0001, 0x8002]
    for offset, raw in enumerate(specials):
        # Reinterpret the unsigned pattern as the signed int dtype of the view.
        width = 32 if keys.dtype == torch.float32 else 16
        bits[offset] = raw - (1 << width) if raw >= 1 << (width - 1) else raw
    values.view(ints).reshape(-1)[-len(specials) :] = bits[: len(specials)].clone()
    return layers


def encode(fp: ModelFingerprint, ids: list[int], layers: KVPairs, **kwargs: object) -> bytes:
    out = io.BytesIO()
    written = write_snapshot(out, fp, ids, layers, **kwargs)  # type: ignore[arg-type]
    assert written == len(out.getvalue())
    return out.getvalue()


def decode(data: bytes, fp: ModelFingerprint, ids: list[int] | None, num_tokens: int) -> KVPairs:
    targets = allocate_targets(fp, num_tokens)
    read_snapshot(io.BytesIO(data), expected=fp, expected_ids=ids, targets=targets)
    return targets


def assert_bit_equal(got: KVPairs, want: KVPairs) -> None:
    assert len(got) == len(want)
    for (gk, gv), (wk, wv) in zip(got, want, strict=True):
        for g, w in ((gk, wk), (gv, wv)):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g.view(INT_VIEW[g.dtype]), w.view(INT_VIEW[w.dtype]))


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("num_tokens", [1, 7, 301])
def test_round_trip_is_bit_exact(dtype: str, num_tokens: int, version: int) -> None:
    # 301 tokens of 30 layers is over 4 MiB in every dtype: a v2 body then decodes on worker threads.
    fp = fingerprint(dtype)
    layers = with_special_values(kv_like(fp, num_tokens))
    ids = [(i * 7919) % 49152 for i in range(num_tokens)]
    data = encode(fp, ids, layers, version=version)
    assert read_info(io.BytesIO(data)).version == version
    got = decode(data, fp, ids, num_tokens)
    assert_bit_equal(got, layers)
    # The specials really are there (so the test could catch a float-normalising codec).
    first_k = got[0][0].float().reshape(-1)
    assert torch.isnan(first_k[:8]).any() and torch.isinf(first_k[:8]).any()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("num_tokens", [1, 301])
def test_an_int8_cache_round_trips_its_rows_and_scales_exactly(num_tokens: int, version: int) -> None:
    # An int8 cache's positions are rows of head_dim values and their fp32 scale's bytes (chatd.engine.pool.paged):
    # the fingerprint's head_dim is that width, and every byte (NaN scale bits too) comes back as it was.
    wide = fingerprint("float32", num_layers=6)
    fp = dataclasses.replace(wide, dtype="int8", head_dim=wide.head_dim + INT8_SCALE_BYTES)
    layers = [(quantize_rows(k), quantize_rows(v)) for k, v in kv_like(wide, num_tokens)]
    layers[0][0][0, 0, -INT8_SCALE_BYTES:] = torch.tensor([float("nan")]).view(torch.int8)
    ids = list(range(num_tokens))
    data = encode(fp, ids, layers, version=version)
    info = read_info(io.BytesIO(data))
    assert info.fingerprint.dtype == "int8" and info.lossless
    assert info.raw_bytes == 2 * 6 * 3 * num_tokens * (64 + INT8_SCALE_BYTES)
    got = decode(data, fp, ids, num_tokens)
    for (gk, gv), (wk, wv) in zip(got, layers, strict=True):
        assert gk.dtype == torch.int8 and torch.equal(gk, wk) and torch.equal(gv, wv)
    assert torch.equal(dequantize_rows(got[1][1]), dequantize_rows(layers[1][1]))
    with pytest.raises(SnapshotModelMismatch):  # a bf16 cache of the same model does not take it
        decode(data, dataclasses.replace(wide, dtype="bfloat16"), ids, num_tokens)


def test_info_describes_the_snapshot() -> None:
    fp = fingerprint("bfloat16", num_layers=4, num_kv_heads=2, head_dim=8)
    ids = [5, 1, 2**32 - 1, 0]
    data = encode(fp, ids, kv_like(fp, 4), level=3)
    info = read_info(io.BytesIO(data))
    assert info == SnapshotInfo(
        FORMAT_VERSION, fp, tuple(ids), "bfloat16", 3, raw_bytes=4 * 2 * 2 * 4 * 8 * 2
    )
    assert info.num_tokens == 4 and info.lossless
    assert data.startswith(MAGIC)
    assert snapshot_targets_shape(fp, 4) == (2, 4, 8)


def test_zero_tokens_round_trip() -> None:
    fp = fingerprint(num_layers=2)
    data = encode(fp, [], kv_like(fp, 0))
    assert decode(data, fp, [], 0)[1][1].shape == (3, 0, 64)


@pytest.fixture(scope="module")
def kernels(real_dir: Path) -> EngineKernels:
    loaded = load_kernels(real_dir / "native")  # where the model's runner keeps them
    assert loaded is not None, "the test machine has a C compiler (make test installs one: scripts/setup.sh)"
    return loaded


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_native_byte_planes_write_the_same_file_and_read_it_back_exactly(kernels: EngineKernels, dtype: str,
                                                                         version: int) -> None:
    # The engine's kernels split and join the byte planes in C: same file bytes, same restored bits, on the
    # calling thread and on decode workers.
    calls = {"split_planes": 0, "join_planes": 0}

    class Counting:
        def split_planes(self, elements: np.ndarray, planes: np.ndarray) -> None:
            calls["split_planes"] += 1
            kernels.split_planes(elements, planes)

        def join_planes(self, planes: np.ndarray, elements: np.ndarray) -> None:
            calls["join_planes"] += 1
            kernels.join_planes(planes, elements)

    fp = fingerprint(dtype)
    layers = with_special_values(kv_like(fp, 301, seed=3))
    ids = list(range(301))
    data = encode(fp, ids, layers, version=version)
    slabs = 2 * fp.num_layers * fp.num_kv_heads
    assert encode(fp, ids, layers, version=version, kernels=Counting()) == data
    assert calls["split_planes"] == slabs
    for threads in (1, 3):
        targets = allocate_targets(fp, 301)
        read_snapshot(io.BytesIO(data), expected=fp, expected_ids=ids, targets=targets, threads=threads,
                      kernels=Counting())
        assert_bit_equal(targets, layers)
    assert calls["join_planes"] == 2 * slabs


@pytest.mark.parametrize("threads", [1, 3])
def test_views_into_larger_buffers_in_and_out(threads: int) -> None:
    fp = fingerprint("bfloat16", num_layers=3)
    capacity, num_tokens = 512, 129
    layers = kv_like(fp, num_tokens, seed=3)
    # Source: views into [1, kv_heads, capacity, head_dim] buffers, like a growable cache.
    src_bufs = [torch.randn(2, 1, 3, capacity, 64).to(torch.bfloat16) for _ in layers]
    src_views: KVPairs = []
    for buf, (k, v) in zip(src_bufs, layers, strict=True):
        buf[0, 0, :, :num_tokens].copy_(k)
        buf[1, 0, :, :num_tokens].copy_(v)
        src_views.append((buf[0, 0, :, :num_tokens], buf[1, 0, :, :num_tokens]))
    assert not src_views[0][0].is_contiguous() and src_views[0][0][1].is_contiguous()
    ids = list(range(num_tokens))
    data = encode(fp, ids, src_views)
    # Targets: views too; the memory beyond the view must stay exactly as it was.
    dst_bufs = [torch.full((2, 1, 3, capacity, 64), -7.0, dtype=torch.bfloat16) for _ in layers]
    before = [buf.clone() for buf in dst_bufs]
    targets = [(buf[0, 0, :, :num_tokens], buf[1, 0, :, :num_tokens]) for buf in dst_bufs]
    read_snapshot(io.BytesIO(data), expected=fp, expected_ids=ids, targets=targets, threads=threads)
    assert_bit_equal(targets, layers)
    for buf, old in zip(dst_bufs, before, strict=True):
        assert torch.equal(
            buf[:, :, :, num_tokens:].view(torch.int16), old[:, :, :, num_tokens:].view(torch.int16)
        )


@pytest.mark.parametrize("threads", [1, 3])
def test_non_contiguous_slabs_still_round_trip(threads: int) -> None:
    # Not the documented fast path (per-head slabs are contiguous), but must not be silently wrong.
    fp = fingerprint(num_layers=2, num_kv_heads=2, head_dim=16)
    layers = kv_like(fp, 10)
    transposed = [(k.transpose(1, 2).contiguous().transpose(1, 2), v) for k, v in layers]
    assert not transposed[0][0][0].is_contiguous()
    data = encode(fp, list(range(10)), transposed)
    targets = [(torch.empty(2, 16, 10).transpose(1, 2), torch.empty(2, 10, 16)) for _ in range(2)]
    read_snapshot(io.BytesIO(data), expected=fp, expected_ids=None, targets=targets, threads=threads)
    assert_bit_equal(targets, layers)


class ShortReads(io.RawIOBase):
    """A raw stream that hands out at most 7 bytes per call, like a pipe or a socket."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        chunk = self._data.read(min(7, len(buffer)))
        buffer[: len(chunk)] = chunk
        return len(chunk)


@pytest.mark.parametrize("version", [1, 2])
def test_short_reads_from_the_stream_are_fine(version: int) -> None:
    fp = fingerprint(num_layers=2, num_kv_heads=2, head_dim=16)
    layers = kv_like(fp, 9)
    data = encode(fp, list(range(9)), layers, version=version)
    for threads in (1, 2):
        targets = allocate_targets(fp, 9)
        read_snapshot(ShortReads(data), expected=fp, expected_ids=None, targets=targets, threads=threads)  # type: ignore[arg-type]
        assert_bit_equal(targets, layers)
        with pytest.raises(SnapshotTruncated):
            read_snapshot(ShortReads(data[:-3]), expected=fp, expected_ids=None, targets=targets,  # type: ignore[arg-type]
                          threads=threads)


def test_lossy_mode_decodes_on_workers_too() -> None:
    fp = fingerprint(num_layers=4)
    layers = kv_like(fp, 100, seed=9)
    data = encode(fp, list(range(100)), layers, stored_dtype="bfloat16")
    one = decode(data, fp, None, 100)
    targets = allocate_targets(fp, 100)
    read_snapshot(io.BytesIO(data), expected=fp, expected_ids=None, targets=targets, threads=3)
    assert_bit_equal(targets, one)


# The worked examples of docs/snapshot-format.md section 8, byte for byte.
DOC_EXAMPLE_FP = ModelFingerprint("m", "ab", "float32", 1, 1, 2)
DOC_EXAMPLES = {
    1: "43484154444b5600010021000000ad6741e301006d020061620101010000000100000002000000010000000100000007000000"
       "2aebba5228b52ffd24084100003fc080000000000034bce0f328b52ffd24084100003f40004000000000c130b665cf3d5faf",
    2: "43484154444b56000200210000000315d56501006d020061620101010000000100000002000000010000000100000007000000"
       "2aebba52150000002828ac5e1909410040229e8c28b52ffd24084100003fc080000000000034bce0f31500000028b5a0b3ca084100"
       "781b4c3e28b52ffd24084100003f40004000000000c130b665",
}


@pytest.mark.parametrize("version", [1, 2])
def test_the_documented_examples(version: int) -> None:
    keys, values = torch.tensor([[[1.0, -2.0]]]), torch.tensor([[[0.5, 3.0]]])  # [1 head, 1 token, dim 2]
    data = bytes.fromhex(DOC_EXAMPLES[version])
    assert encode(DOC_EXAMPLE_FP, [7], [(keys, values)], version=version) == data
    assert_bit_equal(decode(data, DOC_EXAMPLE_FP, [7], 1), [(keys, values)])


def test_shuffled_body_compresses_better_than_plain_zstd() -> None:
    import zstandard

    fp = fingerprint("bfloat16", num_layers=4)
    layers = kv_like(fp, 256)
    data = encode(fp, list(range(256)), layers)
    plain = sum(
        len(zstandard.ZstdCompressor(level=1).compress(t.view(torch.uint8).numpy()))
        for p in layers
        for t in p
    )
    raw = sum(t.numel() * 2 for p in layers for t in p)
    assert len(data) < plain < raw


def test_lossy_bf16_mode_error_and_size() -> None:
    fp = fingerprint("float32", num_layers=6)
    num_tokens = 200
    layers = kv_like(fp, num_tokens, seed=5)
    layers[0][0].view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    ids = list(range(num_tokens))
    lossless = encode(fp, ids, layers)
    lossy = encode(fp, ids, layers, stored_dtype="bfloat16")
    info = read_info(io.BytesIO(lossy))
    assert (
        info.stored_dtype == "bfloat16" and not info.lossless and info.raw_bytes == 6 * 2 * 3 * 200 * 64 * 4
    )
    assert len(lossy) < 0.6 * len(lossless)
    got = decode(lossy, fp, ids, num_tokens)
    max_abs, max_rel = 0.0, 0.0
    for (gk, gv), (wk, wv) in zip(got, layers, strict=True):
        for g, w in ((gk, wk), (gv, wv)):
            assert g.dtype == torch.float32
            # Exactly torch's round-to-nearest-even bf16, widened back (NaN bits included).
            rounded = w.to(torch.bfloat16).to(torch.float32)
            assert torch.equal(g.view(torch.int32), rounded.view(torch.int32))
            finite = torch.isfinite(w) & (w != 0)
            err = (g - w)[finite].abs()
            max_abs = max(max_abs, err.max().item())
            max_rel = max(max_rel, (err / w[finite].abs()).max().item())
    assert torch.isinf(got[0][0].view(-1)[:2]).all() and torch.isnan(got[0][0].view(-1)[2])
    print(f"bf16 lossy: max abs error {max_abs:.3g}, max rel error {max_rel:.3g} (bound {2**-8:.3g})")
    assert 0 < max_rel <= 2**-8
    assert max_abs < 0.1


# ---------------------------------------------------------------- bad files

SMALL = fingerprint("float32", num_layers=3, num_kv_heads=2, head_dim=16)
SMALL_IDS = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module", params=[1, 2], ids=["v1", "v2"])
def good(request: pytest.FixtureRequest) -> bytes:
    """A small valid snapshot in each readable format version (v1: bare frames + body crc; v2: records)."""
    return encode(SMALL, SMALL_IDS, with_special_values(kv_like(SMALL, 5)), version=request.param)


def version_of(data: bytes) -> int:
    (version,) = struct.unpack_from("<H", data, 8)
    return int(version)


def header_len(data: bytes) -> int:
    (payload_len,) = struct.unpack_from("<I", data, 10)
    return PREFIX_BYTES + payload_len + 4


def frame_spans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of every zstd frame of a valid v2 snapshot, from the records."""
    spans, offset = [], header_len(data)
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset)
        spans.append((offset + RECORD.size, offset + RECORD.size + length))
        offset += RECORD.size + length
    return spans


def reject(
    data: bytes, expected: ModelFingerprint = SMALL, ids: list[int] | None = SMALL_IDS
) -> SnapshotError:
    """The error reading ``data`` raises: the same one whether v2 bodies decode on the calling thread or on
    workers (v1 ignores ``threads``)."""
    errors: list[SnapshotError] = []
    for threads in (1, 3):
        targets = allocate_targets(expected, 5)
        with pytest.raises(SnapshotError) as excinfo:
            read_snapshot(io.BytesIO(data), expected=expected, expected_ids=ids, targets=targets, threads=threads)
        errors.append(excinfo.value)
    assert all(type(e) is type(errors[0]) and str(e) == str(errors[0]) for e in errors), errors
    return errors[0]


def test_good_fixture_reads(good: bytes) -> None:
    assert_bit_equal(decode(good, SMALL, SMALL_IDS, 5), with_special_values(kv_like(SMALL, 5)))


def test_truncation_anywhere_is_truncated(good: bytes) -> None:
    head = header_len(good)
    cuts = [0, 1, 8, PREFIX_BYTES - 1, PREFIX_BYTES, head - 5, head - 1, head, head + 3, len(good) // 2]
    cuts += [len(good) - 5, len(good) - 4, len(good) - 1]
    if version_of(good) >= 2:
        spans = frame_spans(good)
        cuts += [spans[1][0] - RECORD.size, spans[1][0] - 1, spans[1][0], spans[1][0] + 2, spans[-1][0] + 5]
    for cut in cuts:
        err = reject(good[:cut])
        assert isinstance(err, SnapshotTruncated), (cut, err)
    with pytest.raises(SnapshotTruncated):
        read_info(io.BytesIO(good[: head - 1]))


def test_every_flipped_header_byte_is_corrupt(good: bytes) -> None:
    for offset in range(header_len(good)):
        bad = bytearray(good)
        bad[offset] ^= 0x10
        err = reject(bytes(bad))
        assert isinstance(err, SnapshotCorrupt), (offset, err)


def test_every_flipped_body_byte_is_corrupt(good: bytes) -> None:
    head = header_len(good)
    for offset in range(head, len(good)):
        bad = bytearray(good)
        bad[offset] ^= 1 << (offset % 8)  # every bit position occurs across the body
        err = reject(bytes(bad))
        assert isinstance(err, SnapshotCorrupt), (offset, err)


def test_flip_that_zstd_itself_ignores_is_caught(good: bytes) -> None:
    # Bit 4 of a zstd frame header descriptor is "unused": decoders must ignore it, so only the
    # snapshot's own checksums can see this flip.
    import zstandard

    bad = bytearray(good)
    first_frame = header_len(good) if version_of(good) == 1 else frame_spans(good)[0][0]
    assert bytes(bad[first_frame : first_frame + 4]) == zstandard.FRAME_HEADER
    bad[first_frame + 4] ^= 0x10
    err = reject(bytes(bad))
    want = "body checksum mismatch" if version_of(good) == 1 else "body frame 0 word sum mismatch"
    assert isinstance(err, SnapshotCorrupt) and want in str(err)


def test_flipped_frame_payload_byte_is_corrupt(good: bytes) -> None:
    if version_of(good) == 1:
        bad = bytearray(good)
        bad[header_len(good) + 40] ^= 0x80  # inside the first frame's compressed data
        assert isinstance(reject(bytes(bad)), SnapshotCorrupt)
        bad = bytearray(good)
        bad[-6] ^= 0x80  # inside the last frame's content checksum (the body checksum follows it)
        assert "doesn't match checksum" in str(reject(bytes(bad)))
        bad = bytearray(good)
        bad[-1] ^= 0x80  # inside the body checksum itself
        assert "body checksum mismatch" in str(reject(bytes(bad)))
        return
    spans = frame_spans(good)
    last = len(spans) - 1
    bad = bytearray(good)
    bad[spans[0][0] + 40] ^= 0x80  # inside the first frame's compressed data
    assert "body frame 0 word sum mismatch" in str(reject(bytes(bad)))
    bad = bytearray(good)
    bad[-1] ^= 0x80  # inside the last frame's content checksum
    assert f"body frame {last} word sum mismatch" in str(reject(bytes(bad)))
    for field in (0, 4, 11, 12):  # the last record's length, word sum (low and high byte) and record check
        bad = bytearray(good)
        bad[spans[-1][0] - RECORD.size + field] ^= 0x01
        assert f"body frame {last}'s record checksum mismatch" in str(reject(bytes(bad)))


def test_v2_reports_the_first_bad_frame_on_any_number_of_threads() -> None:
    good = encode(SMALL, SMALL_IDS, kv_like(SMALL, 5), version=2)
    spans = frame_spans(good)
    bad = bytearray(good)
    for index in (9, 3, 7):
        bad[spans[index][0] + 20] ^= 0x04
    assert "body frame 3 word sum mismatch" in str(reject(bytes(bad)))
    # A bad frame before the point where the file is cut is what a sequential reader meets first.
    assert "body frame 3 word sum mismatch" in str(reject(bytes(bad[: spans[10][0] + 1])))
    # Two frames swapped, each intact: the record checks bind every frame to its place.
    a, b = spans[1], spans[2]
    swapped = (
        good[: a[0] - RECORD.size] + good[b[0] - RECORD.size : b[1]] + good[a[0] - RECORD.size : a[1]] + good[b[1] :]
    )
    assert len(swapped) == len(good)
    assert "body frame 1's record checksum mismatch" in str(reject(swapped))


def test_frame_sum_is_the_documented_word_sum() -> None:
    assert frame_sum(b"") == 0 and frame_sum(b"\x01") == 1 and frame_sum(b"\x00" * 8 + b"\x02") == 2
    assert frame_sum(b"\xff" * 16) == (2 * (2**64 - 1)) % 2**64
    data = bytes(range(256)) * 5 + b"xyz"
    words = [int.from_bytes(data[i : i + 8].ljust(8, b"\0"), "little") for i in range(0, len(data), 8)]
    assert frame_sum(data) == frame_sum(bytearray(data)) == frame_sum(memoryview(data)) == sum(words) % 2**64


def test_v2_frame_that_ends_before_its_record_says_is_corrupt() -> None:
    import zstandard

    fp = dataclasses.replace(SMALL, num_layers=1, num_kv_heads=1)
    layers = kv_like(fp, 5)
    data = encode(fp, SMALL_IDS, layers)
    (start, end) = frame_spans(data)[0]
    # Re-frame slab 0 with an empty zstd frame after it, under a record that covers both: every check
    # passes but the frame's own length.
    padded = data[start:end] + zstandard.ZstdCompressor(write_checksum=True).compress(b"")
    second = data[frame_spans(data)[1][0] - RECORD.size :]

    def record(index: int, frame: bytes) -> bytes:
        word_sum = frame_sum(frame)
        check = zlib.crc32(struct.pack("<IIQ", index, len(frame), word_sum))
        return struct.pack("<IQI", len(frame), word_sum, check)

    bad = data[: header_len(data)] + record(0, padded) + padded + second
    assert "does not end where its record says" in str(reject(bad, fp))


def rewrite_header(data: bytes, edit: Callable[[bytearray, bytearray], None]) -> bytes:
    """Apply ``edit(prefix, payload)`` and recompute both checksums, as a future writer would."""
    head = header_len(data)
    prefix, payload = bytearray(data[:14]), bytearray(data[PREFIX_BYTES : head - 4])
    edit(prefix, payload)
    struct.pack_into("<I", prefix, 10, len(payload))
    start = bytes(prefix) + struct.pack("<I", zlib.crc32(bytes(prefix))) + bytes(payload)
    return start + struct.pack("<I", zlib.crc32(start)) + data[head:]


def test_unknown_version_is_rejected(good: bytes) -> None:
    for version in (0, 3, 0xFFFF):
        bad = rewrite_header(good, lambda prefix, _, v=version: struct.pack_into("<H", prefix, 8, v))
        err = reject(bad)
        assert isinstance(err, SnapshotVersionError) and str(version) in str(err)
        with pytest.raises(SnapshotVersionError):
            read_info(io.BytesIO(bad))


def test_checksummed_but_inconsistent_header_is_corrupt(good: bytes) -> None:
    def unknown_dtype(_: bytearray, payload: bytearray) -> None:
        payload[2 + len(SMALL.model_id) + 2 + len(SMALL.weights_hash)] = 99

    def extra_payload(_: bytearray, payload: bytearray) -> None:
        payload.extend(b"\x00\x00")

    for edit in (unknown_dtype, extra_payload):
        assert isinstance(reject(rewrite_header(good, edit)), SnapshotCorrupt)


def test_bad_magic_is_corrupt(good: bytes) -> None:
    assert isinstance(reject(b"PK\x03\x04" + good[4:]), SnapshotCorrupt)
    assert isinstance(reject(b"hello"), SnapshotCorrupt)  # short junk is not "truncated"


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_id", "other-model"),
        ("weights_hash", "cd34" * 16),
        ("dtype", "bfloat16"),
        ("num_layers", 4),
        ("num_kv_heads", 3),
        ("head_dim", 32),
    ],
)
def test_other_model_is_rejected_naming_the_field(good: bytes, field: str, value: object) -> None:
    other = dataclasses.replace(SMALL, **{field: value})
    assert other.digest() != SMALL.digest()
    targets = allocate_targets(other, 5)
    with pytest.raises(SnapshotModelMismatch, match=field):
        read_snapshot(io.BytesIO(good), expected=other, expected_ids=SMALL_IDS, targets=targets)


def test_model_and_ids_are_checked_before_the_body(good: bytes) -> None:
    # A broken body must not matter: the mismatch is reported from the header alone.
    broken = good[: header_len(good)] + b"\xff" * 10
    other = dataclasses.replace(SMALL, weights_hash="00")
    with pytest.raises(SnapshotModelMismatch):
        read_snapshot(
            io.BytesIO(broken), expected=other, expected_ids=None, targets=allocate_targets(other, 5)
        )
    targets = allocate_targets(SMALL, 5)
    sentinel = [t.clone() for pair in targets for t in pair]
    with pytest.raises(SnapshotIdsMismatch):
        read_snapshot(io.BytesIO(broken), expected=SMALL, expected_ids=[11, 22, 0, 44, 55], targets=targets)
    after = [t for pair in targets for t in pair]
    assert all(
        torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(sentinel, after, strict=True)
    )


@pytest.mark.parametrize("ids", [[11, 22, 33, 44, 56], [11, 22, 33, 44], [11, 22, 33, 44, 55, 66], []])
def test_ids_mismatch(good: bytes, ids: list[int]) -> None:
    err = reject(good, ids=ids)
    assert isinstance(err, SnapshotIdsMismatch)


def test_ids_none_skips_the_id_check(good: bytes) -> None:
    targets = allocate_targets(SMALL, 5)
    info = read_snapshot(io.BytesIO(good), expected=SMALL, expected_ids=None, targets=targets)
    assert info.token_ids == tuple(SMALL_IDS)


def test_digest_is_stable() -> None:
    fp = ModelFingerprint("m", "h", "float32", 1, 2, 3)
    assert fp.digest() == ModelFingerprint("m", "h", "float32", 1, 2, 3).digest()
    assert len(fp.digest()) == 64 and int(fp.digest(), 16) >= 0
    assert fp.digest() != dataclasses.replace(fp, head_dim=4).digest()


# ---------------------------------------------------------------- caller bugs


def test_wrong_targets_are_value_errors(good: bytes) -> None:
    cases: list[KVPairs] = [
        allocate_targets(SMALL, 5)[:2],  # too few layers
        allocate_targets(SMALL, 4),  # seq differs from the snapshot's token count
        allocate_targets(dataclasses.replace(SMALL, head_dim=8), 5),
        allocate_targets(dataclasses.replace(SMALL, dtype="bfloat16"), 5),
        [(k.unsqueeze(0), v) for k, v in allocate_targets(SMALL, 5)],
    ]
    for targets in cases:
        with pytest.raises(ValueError):
            read_snapshot(io.BytesIO(good), expected=SMALL, expected_ids=None, targets=targets)
    with pytest.raises(ValueError):
        read_snapshot(io.BytesIO(good), expected=SMALL, expected_ids=None, targets=allocate_targets(SMALL, 5),
                      threads=0)


def test_bad_writer_arguments_are_value_errors_before_any_write() -> None:
    fp = fingerprint(num_layers=2, num_kv_heads=2, head_dim=8)
    layers = kv_like(fp, 3)
    bad_calls: list[Callable[[io.BytesIO], object]] = [
        lambda out: write_snapshot(out, fp, [1, 2], layers),  # ids vs seq
        lambda out: write_snapshot(out, fp, [1, 2, 3], layers[:1]),
        lambda out: write_snapshot(out, fp, [1, 2, -3], layers),
        lambda out: write_snapshot(out, fp, [1, 2, 3], [(k.to(torch.float16), v) for k, v in layers]),
        lambda out: write_snapshot(out, fp, [1, 2, 3], layers, stored_dtype="float16"),
        lambda out: write_snapshot(out, fingerprint("bfloat16", 2, 2, 8), [1, 2, 3], layers),
        lambda out: write_snapshot(out, fp, [1, 2, 3], layers, level=99),
        lambda out: write_snapshot(out, dataclasses.replace(fp, dtype="int8"), [1, 2, 3], layers),
        lambda out: write_snapshot(out, fp, [1, 2, 3], layers, version=3),
    ]
    for call in bad_calls:
        out = io.BytesIO()
        with pytest.raises(ValueError):
            call(out)
        assert out.getvalue() == b""


def test_each_decode_helper_runs_the_callers_thread_setup_first() -> None:
    # The service passes chatd.engine.threads.confine_to_one_thread: helpers must not start OpenMP teams.
    fp = fingerprint(num_layers=4)
    layers = kv_like(fp, 100, seed=11)
    data = encode(fp, list(range(100)), layers)
    targets = allocate_targets(fp, 100)
    seen: list[str] = []
    read_snapshot(io.BytesIO(data), expected=fp, expected_ids=None, targets=targets, threads=3,
                  thread_setup=lambda: seen.append(threading.current_thread().name))
    assert_bit_equal(targets, layers)
    assert len(seen) == 2 and all(name.startswith("chatd-snapshot-decode") for name in seen)


def test_int8_bodies_are_written_fast_and_decoded_on_the_calling_thread() -> None:
    # int8 rows barely compress: by default they are written at zstd's fast level -3 (literals stored as they
    # are), and such a body decodes on the calling thread even when it is large (no helper runs thread_setup);
    # a float body of the same size is spread over helpers.
    wide = fingerprint("float32", num_layers=8)
    fp = dataclasses.replace(wide, dtype="int8", head_dim=wide.head_dim + INT8_SCALE_BYTES)
    layers = [(quantize_rows(k), quantize_rows(v)) for k, v in kv_like(wide, 2048)]
    ids = list(range(2048))
    assert default_level("int8") == -3 and default_level("bfloat16") == default_level("float32") == 1
    fast, small = encode(fp, ids, layers), encode(fp, ids, layers, level=1)
    assert read_info(io.BytesIO(fast)).zstd_level == -3 and read_info(io.BytesIO(small)).zstd_level == 1
    assert len(fast) > len(small)  # what the speed costs
    for data, helpers in ((fast, 0), (small, 1)):
        seen: list[str] = []
        targets = allocate_targets(fp, 2048)
        read_snapshot(io.BytesIO(data), expected=fp, expected_ids=ids, targets=targets,
                      thread_setup=functools.partial(seen.append, "helper"))
        assert all(torch.equal(g, w) for got, want in zip(targets, layers, strict=True)
                   for g, w in zip(got, want, strict=True))
        assert (len(seen) > 0) == bool(helpers) or default_threads() == 1
