"""The engine's native CPU kernels: RoPE with the K/V write into the paged pool, decode attention over it, the
element-wise steps between a layer's projections, the Q4_1 and Q8_0 tile matmuls, and a whole forward step of the q4
model made of those in one call; and, for the KV snapshot codec, the split of a head slab into byte planes and their
join back (``chatd/kv/planes.c``).

The kernels are one C library laid out as ggml lays out its CPU backend (``chatd_kernels.h`` lists the files): one
header with every exported function; per op family (attention, elementwise, matmul) an ISA-independent file, a
portable scalar reference, and one file per instruction set with only the vector loops, each compiled with that
set's ``-m`` flags (:data:`SOURCES`). So the library built on any x86-64 machine holds every variant, and the variant
runs is chosen at load: :class:`EngineKernels` fills a dispatch table (a struct of function pointers, its own) from
the CPU features :func:`chatd.engine.kernels.cpu.cpu_features` grants, after ``CHATD_CPU_ISA``'s cap, or from a
smaller class a caller names (``arch``: the tests run every variant this CPU can). Elsewhere than x86-64 only the
portable files are built. The ctypes signatures are :data:`SIGNATURES`, which tests/test_kernel_header.py checks
against the header's prototypes.

Everything is compiled on first use with the machine's C compiler (``cc``, or ``$CC``), tuned for this CPU
(``-mtune=native``), cached under ``<data_dir>/native`` by a hash of the sources, the flags, the compiler and the
CPU, and loaded with ctypes; a restart loads the cached library. Where no compiler is found or the build fails,
:func:`load_kernels` says why in the log and returns None, and the engine keeps its torch path (one SDPA call per
session). The byte planes are a library of their own, compiled for this very CPU (``-march``), whose loops the
compiler vectorises.

The library is linked against ``libgomp.so.1``, which torch has already loaded by then: the dynamic
loader reuses it, so the kernel's threads are torch's own thread pool and honour
``torch.set_num_threads``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from chatd.engine.kernels.cpu import ISA_ENV, cpu_features
from chatd.engine.pool.paged import INT8_SCALE_BYTES

log = logging.getLogger(__name__)

KERNELS_DIR = Path(__file__).parent
HEADER = KERNELS_DIR / "chatd_kernels.h"
HEADERS = (HEADER, *(KERNELS_DIR / name for name in ("kernels_impl.h", "simd_avx2.h", "simd_avx512.h")))
PLANES_SOURCE = KERNELS_DIR.parent.parent / "kv" / "planes.c"
PLANES_HEADER = PLANES_SOURCE.with_suffix(".h")

# The instruction sets the library's files are compiled for: each file's -m flags.
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl")
_VNNI = (*_AVX512, "-mavx512vnni")
ISA_FLAGS: dict[str, tuple[str, ...]] = {"portable": (), "avx2": _AVX2, "avx512": _AVX512, "avx512-vnni": _VNNI,
                                         "amx": (*_VNNI, "-mavx512bf16", "-mamx-tile", "-mamx-int8", "-mamx-bf16")}


class Source(NamedTuple):
    """A file of the library and the instruction set it is compiled for (a key of :data:`ISA_FLAGS`)."""

    path: Path
    isa: str


X86 = platform.machine() in ("x86_64", "AMD64")
# Every file of the library: the ISA-independent ones and the portable references (any CPU), then, on x86-64, the
# vector variants. dispatch.c is told which (CHATD_X86_VARIANTS) and chooses among them at load.
SOURCES: tuple[Source, ...] = (
    *(Source(KERNELS_DIR / name, "portable") for name in (
        "dispatch.c", "attention.c", "elementwise.c", "matmul.c", "step.c",
        "attention_scalar.c", "elementwise_scalar.c", "matmul_scalar.c")),
    *(Source(KERNELS_DIR / name, isa) for name, isa in (
        ("attention_avx2.c", "avx2"), ("elementwise_avx2.c", "avx2"), ("matmul_avx2.c", "avx2"),
        ("attention_avx512.c", "avx512"), ("elementwise_avx512.c", "avx512"), ("matmul_avx512.c", "avx512-vnni"),
        ("matmul_amx.c", "amx")) if X86),
)
_DEFINES = ("-DCHATD_X86_VARIANTS",) if X86 else ()
# -ffast-math lets the dot products and the exp loop vectorise (reassociation, glibc's vector expf). It is
# given to the compile step only: linked with it, gcc adds start-up code that switches the whole process
# to flush-to-zero for denormals, which changes torch's own arithmetic.
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC", "-c")
# Each file is scheduled for this very CPU, as a -march=native build schedules it (the instructions a file may use
# are its instruction set's alone): gcc's tuning decides, for one, whether a product and a sum carried from one
# iteration to the next are fused, so it is part of what the tests pin (greedy outputs, snapshot bytes).
TUNE_FLAGS = ("-mtune=native",) if X86 else ()
LINK_FLAGS = ("-shared", "-fopenmp")
# The byte planes' library: for this very CPU, as the engine sees it (CHATD_CPU_ISA=avx2 builds for x86-64-v3).
PLANES_FLAGS = ("-O3", "-fPIC", "-c")
BUILD_TIMEOUT_S = 120

NATIVE_ARCH = "native"

# The CPU features the variants use: the dispatch table's bits (chatd_kernels.h's CHATD_CPU_*), by /proc/cpuinfo's
# names, each with the features it needs besides (a file of AVX-512 is also compiled with AVX2's flags).
_FEATURES: tuple[tuple[int, str, frozenset[str], int], ...] = (
    (1, "AVX2", frozenset({"avx2", "fma", "f16c"}), 0),
    (2, "AVX-512", frozenset({"avx512f", "avx512bw", "avx512vl"}), 1),
    (4, "AVX512-VNNI", frozenset({"avx512_vnni"}), 1 | 2),
    (8, "AVX512-BF16", frozenset({"avx512_bf16"}), 1 | 2),
    (16, "AMX", frozenset({"amx_tile", "amx_int8", "amx_bf16"}), 1 | 2 | 4 | 8),
)
# The CPU classes a caller may run the kernels as (load_kernels' arch, besides NATIVE_ARCH: the CPU's own best):
# the feature bit the class needs, and the bits it may use. "scalar" is a CPU without AVX2: the portable
# references, and no tile matmul (the engine keeps torch's int4 matmul there).
VARIANTS: dict[str, tuple[int, int]] = {"amx": (16, 31), "avx512": (2, 15), "avx2": (1, 1), "scalar": (0, 0)}
# chatd_kernels_isa()'s answers, and chatd_q4_matmul_kind()'s
_ISAS = {0: "scalar", 1: "avx2", 2: "avx512"}
_TILE_KINDS: dict[int, str | None] = {0: None, 1: "avx512-vnni", 2: "amx", 3: "avx2", 4: "scalar"}
# The pool dtypes the attention and the K/V write take, and their kv_type codes (CHATD_KV_*); an int8 pool's
# positions are rows of head_dim values and their fp32 scale (chatd.engine.pool.paged.quantize_rows).
_KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}

# The exported functions' ctypes signatures, (restype, argtypes), as chatd_kernels.h and chatd/kv/planes.h declare
# them (tests/test_kernel_header.py compares the two).
_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "chatd_kernels_size": (_i64, []),
    "chatd_kernels_init": (None, [_p, _i32]),
    "chatd_kernels_isa": (_i32, [_p]),
    "chatd_q4_matmul_kind": (_i32, [_p]),
    "chatd_q4_matmul_select": (_i32, [_p, _i32]),
    "chatd_q4_matmul_amx_rows": (_i32, [_p, _i32]),
    "chatd_q4_matmul": (_i32, [_p, _p, _i32, _i32, _p, _i32, _i32, _p, _i32]),
    "chatd_decode_attention_limits": (_i32, [_i32, _i32, _i32]),
    "chatd_decode_attention_parts": (_i32, [_i32, _i32, _i32]),
    "chatd_decode_attention": (None, [_p, _p, _i64, _p, _p, _p, _p, _i64, _p, _i64, _p, _i32, _i32, _i32, _i32, _i32,
                                      _f32, _i32, _i32]),
    "chatd_rope_write": (None, [_p, _p, _i64, _p, _p, _p, _p, _p, _i64, _p, _i32, _i32, _i32, _i32, _i32, _i32]),
    "chatd_add_rms_norm": (None, [_p, _p, _p, _i64, _p, _f32, _p, _i32, _i32, _i32]),
    "chatd_silu_mul": (None, [_p, _p, _p, _i32, _i32, _i32]),
    "chatd_forward_step": (_i32, [_p, _p, _p, _p, _p, _p, _i32, _p, _p, _p, _p, _p, _i64, _p, _p, _i32, _p, _i32]),
}
PLANES_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "chatd_join_planes": (_i32, [_p, _p, _i64, _i32]),
    "chatd_split_planes": (_i32, [_p, _p, _i64, _i32]),
}


def _head_dim(kv: torch.Tensor) -> int:
    """The head dimension of pool ``kv`` (its last axis: head_dim, or an int8 row's head_dim + 4)."""
    return kv.shape[-1] - (INT8_SCALE_BYTES if kv.dtype == torch.int8 else 0)


def _feature_bits(flags: frozenset[str]) -> int:
    """The dispatch table's CHATD_CPU_* bits for a CPU with ``flags``: each feature it has, with the ones it needs."""
    bits = 0
    for bit, _, needs, before in _FEATURES:
        if needs <= flags and bits & before == before:
            bits |= bit
    return bits


def variant_missing(arch: str) -> str | None:
    """Why this CPU cannot run the kernels as ``arch`` (a key of :data:`VARIANTS`), naming the feature it lacks
    (after ``CHATD_CPU_ISA``'s cap); None where it can. ValueError for an unknown ``arch``."""
    if arch == NATIVE_ARCH:
        return None
    if arch not in VARIANTS:
        raise ValueError(f"no kernel variant {arch!r}: expected {NATIVE_ARCH} or one of {', '.join(VARIANTS)}")
    features = cpu_features()
    have, needed = _feature_bits(features.flags), VARIANTS[arch][0]
    wanted = needed | next((before for bit, _, _, before in _FEATURES if bit == needed), 0)
    for bit, name, flags, _ in _FEATURES:  # prerequisites first
        if bit & wanted and not bit & have:
            capped = f" (capped by {ISA_ENV}={features.cap})" if features.cap != "native" else ""
            return f"this CPU lacks {name} ({', '.join(sorted(flags - features.flags))}){capped}"
    return None


def _dispatch_bits(arch: str) -> int:
    """The CPU features the kernels run as ``arch`` may use: this CPU's, limited to the class's."""
    missing = variant_missing(arch)
    if missing:
        raise ValueError(f"the kernels cannot run as {arch} here: {missing}")
    bits = _feature_bits(cpu_features().flags)
    return bits if arch == NATIVE_ARCH else bits & VARIANTS[arch][1]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _host_signature() -> str:
    """This CPU, for the cache key: its own flags (what -mtune=native and -march=native see)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def _build_library(cache_dir: Path, stem: str, units: Sequence[tuple[Path, tuple[str, ...]]],
                   inputs: Sequence[Path], link_flags: tuple[str, ...], what: str) -> Path:
    """The shared library ``units`` (sources and their compile flags) make, building it into ``cache_dir`` unless it
    is there already, keyed by ``inputs``' text, the flags, the compiler and this CPU. Raises RuntimeError (no
    compiler, or the build failed)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install cc)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30,
                                 check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"the C compiler {compiler} does not run: {exc}") from None
    parts = [*(path.read_text() for path in inputs), *(f"{path.name} {' '.join(flags)}" for path, flags in units),
             *link_flags, version, platform.machine(), _host_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    target = cache_dir / f"{stem}-{key}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        built = Path(scratch) / target.name
        objects = [str(Path(scratch) / f"{path.stem}.o") for path, _ in units]

        def run(command: list[str], name: str) -> None:
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as exc:
                raise RuntimeError(f"building {name} failed: {exc}") from None
            if result.returncode != 0:
                raise RuntimeError(f"building {name} failed:\n{result.stderr.strip()[-2000:]}")

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            for done in [pool.submit(run, [compiler, *flags, str(path), "-o", obj], path.name)
                         for (path, flags), obj in zip(units, objects, strict=True)]:
                done.result()
        run([compiler, *link_flags, *objects, "-o", str(built), "-lm"], target.name)
        os.replace(built, target)  # atomic: a concurrent start sees the whole library or none
    log.info("built %s: %s", what, target)
    return target


def build(cache_dir: Path, arch: str = NATIVE_ARCH) -> Path:
    """The compiled kernels library for this machine, building it into ``cache_dir`` unless it is there already.
    It holds every variant this machine's architecture has (on x86-64 all of them): ``arch``, the class the caller
    will run them as (:func:`load_kernels`), is only checked here (ValueError for an unknown one). Raises
    RuntimeError (no compiler, or the build failed)."""
    if arch != NATIVE_ARCH and arch not in VARIANTS:
        raise ValueError(f"no kernel variant {arch!r}: expected {NATIVE_ARCH} or one of {', '.join(VARIANTS)}")
    units = [(source.path, (*ISA_FLAGS[source.isa], *TUNE_FLAGS, *_DEFINES, *COMPILE_FLAGS)) for source in SOURCES]
    return _build_library(cache_dir, "engine-kernels", units, [source.path for source in SOURCES] + list(HEADERS),
                          LINK_FLAGS, "the native engine kernels")


def build_planes(cache_dir: Path) -> Path:
    """The snapshot codec's byte-plane library (``chatd/kv/planes.c``), compiled for this CPU after
    ``CHATD_CPU_ISA``'s cap, building it into ``cache_dir`` unless it is there already. Raises RuntimeError."""
    features = cpu_features()
    flags = (f"-march={features.arch}", *features.extra_flags, *PLANES_FLAGS)
    return _build_library(cache_dir, "snapshot-planes", [(PLANES_SOURCE, flags)], [PLANES_SOURCE, PLANES_HEADER],
                          ("-shared",), "the snapshot codec's byte planes")


def _bind(lib: ctypes.CDLL, signatures: dict[str, tuple[type | None, list[type]]]) -> dict[str, Any]:
    """``lib``'s functions named in ``signatures``, with their ctypes signatures."""
    functions = {}
    for name, (restype, argtypes) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype
        functions[name] = function
    return functions


class EngineKernels:
    """The compact forward's native steps over the pool's fp32 K/V, each one call per layer for all rows, and the
    snapshot codec's byte planes (:class:`chatd.kv.snapshot_frames.PlaneKernels`)."""

    def __init__(self, library: Path, *, arch: str = NATIVE_ARCH) -> None:
        """``library``: :func:`build`'s; the kernels run as ``arch`` (:data:`VARIANTS`; ValueError where this CPU
        cannot), by default the best variants this CPU has after ``CHATD_CPU_ISA``'s cap. The byte planes' own
        library is built beside ``library`` (:func:`build_planes`)."""
        functions = _bind(ctypes.CDLL(str(library)), SIGNATURES)
        self._decode_attention = functions["chatd_decode_attention"]
        self._rope_write = functions["chatd_rope_write"]
        self._add_rms_norm = functions["chatd_add_rms_norm"]
        self._silu_mul = functions["chatd_silu_mul"]
        self._tile_matmul = functions["chatd_q4_matmul"]
        self._select_tile_matmul = functions["chatd_q4_matmul_select"]
        self._amx_rows = functions["chatd_q4_matmul_amx_rows"]
        self._forward_step = functions["chatd_forward_step"]
        self._limits = functions["chatd_decode_attention_limits"]
        self._attention_parts = functions["chatd_decode_attention_parts"]
        # This object's dispatch table (chatd_kernels.h): the variants its calls run, filled once here.
        self._table = ctypes.create_string_buffer(functions["chatd_kernels_size"]())
        self._kernels = ctypes.addressof(self._table)
        functions["chatd_kernels_init"](self._kernels, _dispatch_bits(arch))
        self.isa: str = _ISAS[functions["chatd_kernels_isa"](self._kernels)]
        """The variant of the attention and element-wise kernels: ``avx512``, ``avx2`` or ``scalar``."""
        # Which units run tile_matmul: AMX tiles (as the CPU has them, and granted to this process by the
        # kernel), else AVX512-VNNI vectors, else AVX2 vectors, else none.
        self.tile_matmul_kind: str | None = _TILE_KINDS[functions["chatd_q4_matmul_kind"](self._kernels)]
        planes = _bind(ctypes.CDLL(str(build_planes(library.parent))), PLANES_SIGNATURES)
        self._join_planes = planes["chatd_join_planes"]
        self._split_planes = planes["chatd_split_planes"]

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
        return num_heads % num_kv_heads == 0 and bool(self._limits(num_heads // num_kv_heads, head_dim, block_size))

    def attention_parts(self, pairs: int, blocks: int, num_threads: int) -> int:
        """Into how many block ranges :meth:`decode_attention` splits each (row, KV head) pair of a call of
        ``pairs`` pairs whose longest sequence has ``blocks`` blocks (1: each pair whole); the call's pairs
        times ranges run on the threads whenever there are two or more."""
        return int(self._attention_parts(pairs, blocks, num_threads))

    def rope_write(self, qkv: torch.Tensor, num_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Rotate the Q and K heads of ``qkv`` ``[rows, (heads + 2 * kv_heads) * head_dim]`` (contiguous fp32)
        in place at ``positions`` (int64 ``[rows]``; ``cos`` / ``sin`` ``[max_positions, head_dim]``, the
        half-split convention), and copy each row's K and V heads into this layer's pool ``keys`` / ``values``
        (``[kv_heads, num_blocks, block_size, head_dim]``, fp32, or bf16: rounded to nearest even) at ``slots``
        (int64 ``[rows]``). Bit for bit what the torch path computes. An int8 pool's rows
        (``[..., head_dim + 4]``) are quantised as :func:`chatd.engine.pool.paged.quantize_rows` does."""
        num_kv_heads, num_blocks, block_size, row = keys.shape
        head_dim = _head_dim(keys)
        if not (qkv.dtype == cos.dtype == sin.dtype == torch.float32 and keys.dtype == values.dtype in _KV_TYPES
                and qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and keys.is_contiguous()
                and values.is_contiguous() and positions.dtype == slots.dtype == torch.int64
                and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim):
            raise ValueError("rope_write: unexpected dtypes or layouts")
        self._rope_write(self._kernels, qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(),
                         sin.data_ptr(), keys.data_ptr(), values.data_ptr(), num_blocks * block_size * row,
                         slots.data_ptr(), qkv.shape[0], num_heads, num_kv_heads, head_dim, torch.get_num_threads(),
                         _KV_TYPES[keys.dtype])

    def add_rms_norm(self, h: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``h += add`` in place (``add`` bf16 ``[rows, hidden]``, rows may be strided; None: no add), then
        RMSNorm of every row of ``h`` (fp32 ``[rows, hidden]``, contiguous) scaled by ``weight`` (fp32
        ``[hidden]``), returned as a new bf16 ``[rows, hidden]``."""
        rows, hidden = h.shape
        if not (h.dtype == weight.dtype == torch.float32 and h.is_contiguous() and weight.is_contiguous()
                and weight.shape == (hidden,)
                and (add is None or (add.dtype == torch.bfloat16 and add.shape == h.shape and add.stride(1) == 1))):
            raise ValueError("add_rms_norm: unexpected dtypes or layouts")
        out = torch.empty(rows, hidden, dtype=torch.bfloat16)
        self._add_rms_norm(self._kernels, h.data_ptr(), None if add is None else add.data_ptr(),
                           0 if add is None else add.stride(0), weight.data_ptr(), eps, out.data_ptr(), rows,
                           hidden, torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` bf16 ``[rows, 2 * inter]`` (contiguous, gate first), as a new bf16
        ``[rows, inter]``."""
        rows, width = gate_up.shape
        if not (gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous() and width % 2 == 0):
            raise ValueError("silu_mul: unexpected dtypes or layouts")
        out = torch.empty(rows, width // 2, dtype=torch.bfloat16)
        self._silu_mul(self._kernels, gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out

    def join_planes(self, planes: np.ndarray, elements: np.ndarray) -> None:
        """Write ``elements`` (uint8 ``[n, size]``, contiguous: the bytes of n elements of 2 or 4 bytes) from
        their byte planes ``planes`` (uint8 ``[size, n]``, contiguous; plane 0 the most significant byte), on
        the calling thread, the interpreter lock released."""
        n, size = _check_planes("join_planes", planes, elements)
        self._join_planes(planes.ctypes.data, elements.ctypes.data, n, size)

    def split_planes(self, elements: np.ndarray, planes: np.ndarray) -> None:
        """The inverse of :meth:`join_planes`: ``planes`` from ``elements``."""
        n, size = _check_planes("split_planes", planes, elements)
        self._split_planes(elements.ctypes.data, planes.ctypes.data, n, size)

    def select_tile_matmul(self, kind: str | None) -> str | None:
        """Run ``kind`` (``"amx"``, ``"avx512-vnni"``, ``"avx2"``, or ``"scalar"``, the portable reference, which
        reads AVX512-VNNI's layout) for :meth:`tile_matmul` and :meth:`forward_step` from now on where this CPU has
        it, the best one for None; returns the kind in effect. The vector kernels also run where AMX does, AVX2
        where AVX512-VNNI does, the scalar reference anywhere (the tests compare them); the server always runs
        the best. Only this object's dispatch table changes."""
        codes: dict[str | None, int] = {name: number for number, name in _TILE_KINDS.items()}
        code = codes[kind]
        self.tile_matmul_kind = _TILE_KINDS[self._select_tile_matmul(self._kernels, code)]
        return self.tile_matmul_kind

    @property
    def amx_min_rows(self) -> int:
        """Where AMX runs, calls of this many rows or more take it, fewer the vector kernel (on the second
        layout the weights are packed in there). 16 unless set (tests set 1: AMX for every call)."""
        return int(self._amx_rows(self._kernels, 0))

    @amx_min_rows.setter
    def amx_min_rows(self, rows: int) -> None:
        if rows < 1:
            raise ValueError("amx_min_rows must be at least 1")
        self._amx_rows(self._kernels, rows)

    def tile_matmul(self, x: torch.Tensor, tiles: torch.Tensor, n: int, *, q8: bool = False) -> torch.Tensor:
        """bf16 ``x`` ``[M, K]`` (contiguous) times a Q4_1 weight ``[n, K]`` (a Q8_0 one where ``q8``) packed for
        the kernel in effect (:func:`chatd.engine.model.quant.pack_for` with :attr:`tile_matmul_kind`), as a new bf16
        ``[M, n]``. Only where :attr:`tile_matmul_kind` is set."""
        m, k = x.shape
        kind = self.tile_matmul_kind
        if not (kind and x.dtype == torch.bfloat16 and x.is_contiguous() and tiles.dtype == torch.uint8
                and tiles.is_contiguous() and tiles.numel() == tile_bytes(n, k, q8=q8, kind=kind)):
            raise ValueError("tile_matmul: unexpected dtypes or layouts, or no tile kernel here")
        out = torch.empty(m, n, dtype=torch.bfloat16)
        if m:
            _check_status("tile_matmul", self._tile_matmul(self._kernels, x.data_ptr(), m, k, tiles.data_ptr(), int(q8),
                                                           n, out.data_ptr(), torch.get_num_threads()))
        return out

    def decode_attention(self, q: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, scale: float) -> None:
        """Write the attention of query rows ``rows`` of ``q`` ``[n, heads, head_dim]`` (heads contiguous)
        into the same rows of ``out`` ``[n, heads * head_dim]`` (contiguous).

        ``keys``, ``values``: one layer of the pool, ``[kv_heads, num_blocks, block_size, head_dim]``
        contiguous fp32 or bf16, or int8 rows ``[..., head_dim + 4]``. ``tables``: int32
        ``[len(rows), max_blocks]`` block ids; ``lengths``: int32
        ``[len(rows)]`` positions each row attends (its new token included, already written)."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, num_blocks, block_size, row = keys.shape
        if not (q.dtype == out.dtype == torch.float32 and keys.dtype == values.dtype in _KV_TYPES
                and _head_dim(keys) == head_dim and q.stride(1) == head_dim
                and q.stride(2) == 1 and out.is_contiguous() and keys.is_contiguous() and values.is_contiguous()
                and rows.dtype == tables.dtype == lengths.dtype == torch.int32 and tables.is_contiguous()):
            raise ValueError("decode attention: unexpected dtypes or layouts")
        self._decode_attention(self._kernels, q.data_ptr(), q.stride(0), rows.data_ptr(), out.data_ptr(),
                               keys.data_ptr(), values.data_ptr(), num_blocks * block_size * row, tables.data_ptr(),
                               tables.shape[1], lengths.data_ptr(), rows.shape[0], num_heads, num_kv_heads, head_dim,
                               block_size, scale, torch.get_num_threads(), _KV_TYPES[keys.dtype])

    def forward_step(self, plan: StepPlan, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
                     last: torch.Tensor) -> torch.Tensor:
        """A whole forward step of ``plan``'s model (``step.c``): every layer over the rows of ``h`` (fp32
        ``[rows, hidden]`` embeddings, contiguous; left holding the last layer's residual stream), K/V written
        at ``slots`` and attended over ``tables`` / ``lengths`` (each row's block table and visible positions, as
        :meth:`decode_attention` takes them, for rows in order), then the LM head over rows ``last`` (int32):
        their logits, bf16 ``[len(last), vocab]``. ``positions`` and ``slots`` int64 ``[rows]``; ``cos`` / ``sin``
        the RoPE tables, positions already checked against them."""
        rows = h.shape[0]
        if not (h.dtype == torch.float32 and h.is_contiguous() and h.shape[1] == plan.shape.hidden
                and positions.dtype == slots.dtype == torch.int64 and positions.shape == slots.shape == (rows,)
                and tables.dtype == lengths.dtype == last.dtype == torch.int32 and tables.is_contiguous()
                and tables.shape[0] == lengths.shape[0] == rows and last.is_contiguous()
                and cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
                and cos.shape[1] == plan.shape.head_dim):
            raise ValueError("forward_step: unexpected dtypes or layouts")
        logits = torch.empty(last.shape[0], plan.shape.vocab, dtype=torch.bfloat16)
        _check_status("forward_step", self._forward_step(
            self._kernels, ctypes.addressof(plan.shape), ctypes.addressof(plan.layers), plan.final_norm.data_ptr(),
            plan.lm_head.data_ptr(), h.data_ptr(), rows, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), tables.data_ptr(), tables.shape[1], lengths.data_ptr(), last.data_ptr(), last.shape[0],
            logits.data_ptr(), torch.get_num_threads()))
        return logits


def _check_planes(kernel: str, planes: np.ndarray, elements: np.ndarray) -> tuple[int, int]:
    """(n, size) of a join / split, or ValueError for arrays it cannot take."""
    size, n = planes.shape if planes.ndim == 2 else (0, 0)
    if not (size in (2, 4) and planes.dtype == elements.dtype == np.uint8 and elements.shape == (n, size)
            and planes.flags.c_contiguous and elements.flags.c_contiguous):
        raise ValueError(f"{kernel}: expected uint8 planes [2 or 4, n] and elements [n, size], both contiguous")
    return n, size


def _check_status(kernel: str, status: int) -> None:
    """Raise for a tile kernel's (or a native step's) status: -2 no scratch memory, any other non-zero no kernel."""
    if status == -2:
        raise MemoryError(f"{kernel}: no memory for the kernel's scratch buffers")
    if status:
        raise RuntimeError(f"{kernel}: this build has no tile kernel")


def tile_bytes(n: int, k: int, *, q8: bool, kind: str) -> int:
    """The size of an ``[n, k]`` weight packed for the tile kernel ``kind``; -1 where n is not a multiple of 16
    or k of 32 (no packing). Under AMX a weight is packed twice: AMX tiles, then the vector kernel's."""
    if n % 16 or k % 32:
        return -1
    layout = n * k * 17 // 16 if q8 else n * k * 5 // 8  # 544 or 320 bytes per 512 weights
    return 2 * layout if kind == "amx" else layout


class _Layer(ctypes.Structure):
    """chatd_kernels.h's struct chatd_layer."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("attn_norm", "ffn_norm", "qkv", "o", "gate_up", "down", "keys", "values")]


class _Shape(ctypes.Structure):
    """chatd_kernels.h's struct chatd_shape."""

    _fields_ = [*((name, ctypes.c_int) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                                    "inter", "vocab", "block_size", "kv_type")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("head_stride", ctypes.c_int64)]


class StepPlan:
    """What :meth:`EngineKernels.forward_step` reads of a model and its KV pool: sizes, and the addresses of
    every layer's norms, packed projections and pool slices, with the tensors kept alive here. Valid while
    those tensors are: make a new one for a new pool."""

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, inter: int, eps: float, scale: float,
                 layers: list[dict[str, torch.Tensor]], final_norm: torch.Tensor, lm_head: torch.Tensor,
                 vocab: int, kv: torch.Tensor, kind: str) -> None:
        """``layers``: per layer ``attn_norm``, ``ffn_norm`` (fp32 ``[hidden]``) and ``qkv``, ``o``, ``gate_up``,
        ``down`` (Q4_1 tiles); ``lm_head`` Q8_0 tiles, all packed for the tile kernel ``kind``; ``kv``: the pool,
        ``[layers, 2, kv_heads, num_blocks, block_size, head_dim]`` contiguous fp32 or bf16, or int8 rows
        (``head_dim + 4``)."""
        num_layers, _, kv_heads, num_blocks, block_size, row = kv.shape
        hidden = final_norm.shape[0]
        if not (kv.is_contiguous() and kv.dtype in _KV_TYPES and kv_heads == num_kv_heads and _head_dim(kv) == head_dim
                and num_layers == len(layers) and final_norm.dtype == torch.float32 and final_norm.is_contiguous()):
            raise ValueError("StepPlan: unexpected pool or weights")
        self.shape = _Shape(num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, vocab, block_size,
                            _KV_TYPES[kv.dtype], eps, scale, num_blocks * block_size * row)
        self.kv, self.final_norm, self.lm_head = kv, final_norm, lm_head
        self.tensors = [dict(layer) for layer in layers]
        for layer in self.tensors:
            for name in ("attn_norm", "ffn_norm"):
                if not (layer[name].dtype == torch.float32 and layer[name].is_contiguous()
                        and layer[name].shape == (hidden,)):
                    raise ValueError(f"StepPlan: {name} must be fp32 [hidden], contiguous")
            q_n, qkv_n = num_heads * head_dim, (num_heads + 2 * num_kv_heads) * head_dim
            for name, n, k in (("qkv", qkv_n, hidden), ("o", hidden, q_n), ("gate_up", 2 * inter, hidden),
                               ("down", hidden, inter)):
                if not (layer[name].dtype == torch.uint8 and layer[name].is_contiguous()
                        and layer[name].numel() == tile_bytes(n, k, q8=False, kind=kind)):
                    raise ValueError(f"StepPlan: {name} must be Q4_1 tiles of [{n}, {k}]")
        if not (lm_head.dtype == torch.uint8 and lm_head.is_contiguous()
                and lm_head.numel() == tile_bytes(vocab, hidden, q8=True, kind=kind)):
            raise ValueError(f"StepPlan: the LM head must be Q8_0 tiles of [{vocab}, {hidden}]")
        self.layers = (_Layer * num_layers)(*(
            _Layer(*(layer[name].data_ptr() for name in ("attn_norm", "ffn_norm", "qkv", "o", "gate_up", "down")),
                   kv[index, 0].data_ptr(), kv[index, 1].data_ptr())
            for index, layer in enumerate(self.tensors)))


_loaded: dict[tuple[Path, str], EngineKernels | None] = {}


def load_kernels(cache_dir: Path, arch: str = NATIVE_ARCH) -> EngineKernels | None:
    """The kernels built for this machine (once per process, ``cache_dir`` and ``arch``, see :func:`build`), run
    as ``arch`` (:class:`EngineKernels`), or None when they cannot be built here (logged)."""
    key = (cache_dir, arch)
    if key not in _loaded:
        try:
            kernels = EngineKernels(build(cache_dir, arch), arch=arch)
        except (RuntimeError, OSError) as exc:
            log.warning("native kernels unavailable, the engine uses torch's ops alone: %s", exc)
            _loaded[key] = None
        else:
            log.info("native kernels: %s attention and element-wise steps, tile matmul %s", kernels.isa,
                     kernels.tile_matmul_kind or "none")
            _loaded[key] = kernels
    return _loaded[key]
