"""The engine's native CPU kernels: RoPE with the K/V write into the paged pool, decode attention over
it and the element-wise steps between a layer's projections (``decode_attention.c``), the Q4_1 and
Q8_0 matmuls on AMX tiles, AVX512-VNNI vectors or AVX2 ones (``tile_matmul.c``), and a whole forward step of the q4
model made of those in one call (``step.c``); and, for the KV snapshot codec, the split of a head slab into
byte planes and their join back (``chatd/kv/planes.c``, beside the codec: a library of its own, built beside the
kernels', whose functions :class:`EngineKernels` forwards to as the codec's ``PlaneKernels``).

They are compiled on first use with the machine's C compiler (``cc``, or ``$CC``) for this very CPU
(``-march=native``), cached under ``<data_dir>/native`` by a hash of the source, the flags, the compiler
and the CPU, and loaded with ctypes; a restart loads the cached library. Where no compiler is found or
the build fails, :func:`load_kernels` says why in the log and returns None, and the engine keeps
its torch path (one SDPA call per session).

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
from pathlib import Path

import numpy as np
import torch

from chatd.engine.kernels.cpu import cpu_features
from chatd.engine.pool.paged import INT8_SCALE_BYTES

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in ("decode_attention.c", "tile_matmul.c", "step.c"))
PLANES_SOURCE = Path(__file__).parent.parent.parent / "kv" / "planes.c"
PLANES_HEADER = PLANES_SOURCE.with_suffix(".h")
# The pool dtypes the attention and the K/V write take, and their kv_type codes (decode_attention.c); an int8
# pool's positions are rows of head_dim values and their fp32 scale (chatd.engine.pool.paged.quantize_rows).
_KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
# chatd_q4_matmul_kind()'s answers
_TILE_KINDS: dict[int, str | None] = {0: None, 1: "avx512-vnni", 2: "amx", 3: "avx2"}
# -ffast-math lets the dot products and the exp loop vectorise (reassociation, glibc's vector expf). It is
# given to the compile step only: linked with it, gcc adds start-up code that switches the whole process
# to flush-to-zero for denormals, which changes torch's own arithmetic.
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp", "-fPIC", "-c")
# The instruction set compiled for: this very CPU, as the engine sees it (chatd.engine.kernels.cpu: CHATD_CPU_ISA=avx2
# builds for x86-64-v3). The tests also build for x86-64-v3 (AVX2, FMA, F16C: a CPU without AVX512, such as
# AMD's Zen 3) to run the AVX2 kernels on a machine that has AVX512 too.
NATIVE_ARCH = "native"
LINK_FLAGS = ("-shared", "-fopenmp")
# The byte planes' library: for this very CPU, as the engine sees it (CHATD_CPU_ISA=avx2 builds for x86-64-v3).
PLANES_FLAGS = ("-O3", "-fPIC", "-c")
BUILD_TIMEOUT_S = 120


def _head_dim(kv: torch.Tensor) -> int:
    """The head dimension of pool ``kv`` (its last axis: head_dim, or an int8 row's head_dim + 4)."""
    return kv.shape[-1] - (INT8_SCALE_BYTES if kv.dtype == torch.int8 else 0)


def _cpu_signature() -> str:
    features = cpu_features()
    return " ".join(sorted(features.flags)) or platform.processor()


def _arch_flags(arch: str) -> tuple[str, ...]:
    """The ``-march`` (and any flag beside it) for ``arch``; ``native`` is this CPU after CHATD_CPU_ISA's cap."""
    if arch != NATIVE_ARCH:
        return (f"-march={arch}",)
    features = cpu_features()
    return (f"-march={features.arch}", *features.extra_flags)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build_library(cache_dir: Path, stem: str, sources: tuple[Path, ...], flags: tuple[str, ...],
                   link_flags: tuple[str, ...], what: str) -> Path:
    """The shared library ``sources`` make, compiled with ``flags``, building it into ``cache_dir`` unless it is
    there already (keyed by the sources' text, the flags, the compiler and this CPU). Raises RuntimeError (no
    compiler, or the build failed)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or install cc)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30,
                                 check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"the C compiler {compiler} does not run: {exc}") from None
    texts = [source.read_text() for source in sources]
    key = hashlib.sha256("\0".join([*texts, *flags, *link_flags, version, platform.machine(),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    target = cache_dir / f"{stem}-{key}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        built = Path(scratch) / target.name
        compiled = [source for source in sources if source.suffix == ".c"]
        objects = [str(Path(scratch) / f"{source.stem}.o") for source in compiled]
        commands = [([compiler, *flags, str(source), "-o", obj], source.name)
                    for source, obj in zip(compiled, objects, strict=True)]
        commands.append(([compiler, *link_flags, *objects, "-o", str(built), "-lm"], target.name))
        for command, name in commands:
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as exc:
                raise RuntimeError(f"building {name} failed: {exc}") from None
            if result.returncode != 0:
                raise RuntimeError(f"building {name} failed:\n{result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent start sees the whole library or none
    log.info("built %s: %s", what, target)
    return target


def build(cache_dir: Path, arch: str = NATIVE_ARCH) -> Path:
    """The compiled library for this machine (``-march=arch``), building it into ``cache_dir`` unless it is
    there already. Raises RuntimeError (no compiler, or the build failed)."""
    return _build_library(cache_dir, "engine-kernels", SOURCES, (*_arch_flags(arch), *COMPILE_FLAGS), LINK_FLAGS,
                          "the native engine kernels")


def build_planes(cache_dir: Path) -> Path:
    """The snapshot codec's byte-plane library (``chatd/kv/planes.c``), compiled for this CPU after
    ``CHATD_CPU_ISA``'s cap, building it into ``cache_dir`` unless it is there already. Raises RuntimeError."""
    return _build_library(cache_dir, "snapshot-planes", (PLANES_SOURCE, PLANES_HEADER),
                          (*_arch_flags(NATIVE_ARCH), *PLANES_FLAGS), ("-shared",), "the snapshot codec's byte planes")


class EngineKernels:
    """The compact forward's native steps over the pool's fp32 K/V, each one call per layer for all rows, and the
    snapshot codec's byte planes (:class:`chatd.kv.snapshot_frames.PlaneKernels`)."""

    def __init__(self, library: Path) -> None:
        """``library``: :func:`build`'s. The byte planes' own library is built beside it (:func:`build_planes`)."""
        lib = ctypes.CDLL(str(library))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._decode_attention = lib.chatd_decode_attention
        self._decode_attention.argtypes = [p, i64, p, p, p, p, i64, p, i64, p, i32, i32, i32, i32, i32,
                                           ctypes.c_float, i32, i32]
        self._decode_attention.restype = None
        self._rope_write = lib.chatd_rope_write
        self._rope_write.argtypes = [p, i64, p, p, p, p, p, i64, p, i32, i32, i32, i32, i32, i32]
        self._rope_write.restype = None
        self._add_rms_norm = lib.chatd_add_rms_norm
        self._add_rms_norm.argtypes = [p, p, i64, p, ctypes.c_float, p, i32, i32, i32]
        self._add_rms_norm.restype = None
        self._silu_mul = lib.chatd_silu_mul
        self._silu_mul.argtypes = [p, p, i32, i32, i32]
        self._silu_mul.restype = None
        self._tile_matmul = lib.chatd_q4_matmul
        self._tile_matmul.argtypes = [p, i32, i32, p, i32, i32, p, i32]
        self._tile_matmul.restype = i32
        # Which units run tile_matmul: AMX tiles (compiled in, as the CPU has them, and granted to this
        # process by the kernel), else AVX512-VNNI vectors, else AVX2 vectors, else none.
        self._select_tile_matmul = lib.chatd_q4_matmul_select
        self._select_tile_matmul.argtypes = [i32]
        self._select_tile_matmul.restype = i32
        self.tile_matmul_kind: str | None = _TILE_KINDS[lib.chatd_q4_matmul_kind()]
        self._amx_rows = lib.chatd_q4_matmul_amx_rows
        self._amx_rows.argtypes = [i32]
        self._amx_rows.restype = i32
        self._forward_step = lib.chatd_forward_step
        self._forward_step.argtypes = [p, p, p, p, p, i32, p, p, p, p, p, i64, p, p, i32, p, i32]
        self._forward_step.restype = i32
        self._limits = lib.chatd_decode_attention_limits
        self._limits.argtypes = [i32, i32, i32]
        self._limits.restype = i32
        self._attention_parts = lib.chatd_decode_attention_parts
        self._attention_parts.argtypes = [i32, i32, i32]
        self._attention_parts.restype = i32
        planes = ctypes.CDLL(str(build_planes(library.parent)))
        self._join_planes = planes.chatd_join_planes
        self._join_planes.argtypes = [p, p, i64, i32]
        self._join_planes.restype = i32
        self._split_planes = planes.chatd_split_planes
        self._split_planes.argtypes = [p, p, i64, i32]
        self._split_planes.restype = i32

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
        self._rope_write(qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                         keys.data_ptr(), values.data_ptr(), num_blocks * block_size * row, slots.data_ptr(),
                         qkv.shape[0], num_heads, num_kv_heads, head_dim, torch.get_num_threads(),
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
        self._add_rms_norm(h.data_ptr(), None if add is None else add.data_ptr(),
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
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
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
        """Run ``kind`` (``"amx"``, ``"avx512-vnni"`` or ``"avx2"``) for :meth:`tile_matmul` from now on where
        this CPU has it, the best one for None; returns the kind in effect. The vector kernels also run where AMX
        does, AVX2 where AVX512-VNNI does (the tests compare them); the server always runs the best."""
        codes: dict[str | None, int] = {name: number for number, name in _TILE_KINDS.items()}
        code = codes[kind]
        self.tile_matmul_kind = _TILE_KINDS[self._select_tile_matmul(code)]
        return self.tile_matmul_kind

    @property
    def amx_min_rows(self) -> int:
        """Where AMX runs: calls of this many rows or more take it, fewer the vector kernel (on the second
        layout the weights are packed in there). 16 unless set (tests set 1: AMX for every call)."""
        return int(self._amx_rows(0))

    @amx_min_rows.setter
    def amx_min_rows(self, rows: int) -> None:
        if rows < 1:
            raise ValueError("amx_min_rows must be at least 1")
        self._amx_rows(rows)

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
            _check_status("tile_matmul", self._tile_matmul(x.data_ptr(), m, k, tiles.data_ptr(), int(q8), n,
                                                           out.data_ptr(), torch.get_num_threads()))
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
        self._decode_attention(q.data_ptr(), q.stride(0), rows.data_ptr(), out.data_ptr(), keys.data_ptr(),
                               values.data_ptr(), num_blocks * block_size * row, tables.data_ptr(),
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
            ctypes.byref(plan.shape), plan.layers, plan.final_norm.data_ptr(), plan.lm_head.data_ptr(), h.data_ptr(),
            rows, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(),
            tables.shape[1], lengths.data_ptr(), last.data_ptr(), last.shape[0], logits.data_ptr(),
            torch.get_num_threads()))
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
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("attn_norm", "ffn_norm", "qkv", "o", "gate_up", "down", "keys", "values")]


class _Shape(ctypes.Structure):
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
    """The kernels built for this machine (once per process, ``cache_dir`` and ``arch``, see :func:`build`),
    or None when they cannot be built here (logged)."""
    key = (cache_dir, arch)
    if key not in _loaded:
        try:
            _loaded[key] = EngineKernels(build(cache_dir, arch))
        except (RuntimeError, OSError) as exc:
            log.warning("native kernels unavailable, the engine uses torch's ops alone: %s", exc)
            _loaded[key] = None
    return _loaded[key]
