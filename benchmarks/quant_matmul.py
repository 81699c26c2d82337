"""Weight-only quantized matmuls on this CPU at SmolLM2-135M's shapes: fp32 vs int4 vs int8.

    python -m benchmarks.quant_matmul [--threads 1] [--repeat 7]

Per-call milliseconds of ``y = x @ W^T`` for x fp32 ``[M, K]`` and W ``[N, K]`` (shapes listed as K x N),
every column fp32 in and fp32 out (the bf16 casts around the kernels are included):

* fp32: ``F.linear`` with the dequantized fp32 weight (what the transformers path runs);
* int4: :class:`chatd.engine.model.quant.Int4Linear` (Q4_1 group 32, ``_weight_int4pack_mm_for_cpu``, bf16);
* int8: :class:`chatd.engine.model.quant.Int8RowLinear` (per-row int8, ``_weight_int8pack_mm``, bf16; lossy
  for Q8_0);
* q8_0: :class:`chatd.engine.model.quant.Q8_0Linear` (Q8_0 exactly, as two int4 halves along K) — the LM
  head's chosen path; shown for every shape for comparison.

A second table times one pass over every projection of all 30 layers plus the LM head, with distinct
weights per layer: the real working set (fp32 ~540 MB, more than this CPU's caches; int4 ~75 MB), so
memory traffic counts as it does in a decode step; the LM head there is fp32 / q8_0 / int8.

A third table is the engine's decode path, bf16 in and out, over the same 30 layers' projections (no
LM head): the int4 kernel (``Int4Linear.bf16``), the native tile kernel (``TileQ4Linear``'s
``tile_matmul``) on AMX tiles for every call and on AVX512-VNNI and AVX2 vectors, each where the CPU has it, the
engine's choice (with AMX, calls of fewer than ``EngineKernels.amx_min_rows`` rows on the vectors: this
table sets that threshold), and the prepacked bf16 twin (``PackedBf16Linear``), which shows why a model with
a tile kernel needs no dense twin of its layers.

Random Q4_1/Q8_0 weights (speed only). Each figure is the best of ``--repeat`` timed loops, the least
disturbed by other load on a shared machine; still rough.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from chatd.engine.kernels.loader import load_kernels
from chatd.engine.model.quant import TILE_KINDS, Int4Linear, Int8RowLinear, Q4_1Weight, Q8_0Linear, Q8_0Weight, pack_for
from chatd.engine.model.weights import PackedBf16Linear
from devtools.models import CACHE_DIR

SHAPES = [  # (label, K, N)
    ("576x576 (q, o)", 576, 576),
    ("576x192 (k, v)", 576, 192),
    ("576x960 (q|k|v)", 576, 960),
    ("576x3072 (gate|up)", 576, 3072),
    ("1536x576 (down)", 1536, 576),
    ("576x49152 (LM head)", 576, 49152),
]
BATCHES = (1, 8, 16)
LAYERS = 30
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # qkv, o, gate|up, down
VOCAB = 49152


def best_ms(call: Callable[[], object], repeat: int, budget_s: float = 0.05) -> float:
    """Best per-call time over ``repeat`` loops, each loop sized to roughly ``budget_s``."""
    call()
    start = time.perf_counter()
    call()
    once = max(time.perf_counter() - start, 1e-6)
    number = max(1, min(200, int(budget_s / once)))
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            call()
        best = min(best, (time.perf_counter() - start) / number)
    return best * 1e3


def random_q4_1(n: int, k: int) -> Q4_1Weight:
    return Q4_1Weight(scale=(torch.rand(n, k // 32) * 0.01 + 1e-3).half(),
                      minimum=(-torch.rand(n, k // 32) * 0.08).half(),
                      quants=torch.randint(0, 16, (n, k), dtype=torch.uint8))


def random_q8_0(n: int, k: int) -> Q8_0Weight:
    return Q8_0Weight(scale=(torch.rand(n, k // 32) * 0.01 + 1e-3).half(),
                      quants=torch.randint(-127, 128, (n, k), dtype=torch.int8))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--decode-only", action="store_true", help="only the third table (the decode path)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s); "
          "ms per call, best of", args.repeat)
    with torch.inference_mode():
        if not args.decode_only:
            print()
            print("| K x N | M | fp32 | int4 | int8 | q8_0 | fp32 / int4 |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            for label, k, n in SHAPES:
                shape_rows(label, k, n, args.repeat)
            model_pass(args.repeat)
        decode_pass(args.repeat)


def shape_rows(label: str, k: int, n: int, repeat: int) -> None:
    """One table row per batch size for one weight shape."""
    q4 = random_q4_1(n, k)
    dense = q4.dequantize()  # [N, K] fp32
    methods: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda x: F.linear(x, dense), Int4Linear(q4), Int8RowLinear(q4), Q8_0Linear(random_q8_0(n, k))]
    for m in BATCHES:
        x = torch.randn(m, k)
        fp32_ms, int4_ms, int8_ms, q8_ms = (best_ms(partial(method, x), repeat) for method in methods)
        print(f"| {label} | {m} | {fp32_ms:.3f} | {int4_ms:.3f} | {int8_ms:.3f} | {q8_ms:.3f} "
              f"| {fp32_ms / int4_ms:.1f}x |", flush=True)


def run_all(methods: Sequence[Callable[[torch.Tensor], torch.Tensor]], in_features: Sequence[int],
            inputs: dict[int, torch.Tensor]) -> None:
    for method, k in zip(methods, in_features, strict=True):
        method(inputs[k])


def model_pass(repeat: int) -> None:
    """Time all layers' projections + the LM head in sequence, distinct weights per layer."""
    weights = [random_q4_1(n, k) for _ in range(LAYERS) for k, n in LAYER_SHAPES]
    head = random_q8_0(VOCAB, 576)
    in_features = [w.shape[1] for w in weights] + [576]
    dense = [w.dequantize() for w in weights] + [head.dequantize()]
    variants: list[list[Callable[[torch.Tensor], torch.Tensor]]] = [
        [partial(F.linear, weight=w) for w in dense],
        [*(Int4Linear(w) for w in weights), Q8_0Linear(head)],
        [*(Int8RowLinear(w) for w in weights), Int8RowLinear(head)],
    ]
    print()
    print(f"One pass: {LAYERS} layers x (q|k|v, o, gate|up, down) + LM head, distinct weights per layer")
    print()
    print("| M | fp32 ms | int4 (+q8_0 head) ms | int8 ms | fp32 / int4 |")
    print("| --- | --- | --- | --- | --- |")
    for m in BATCHES:
        inputs = {k: torch.randn(m, k) for k in (576, 1536)}
        fp32_ms, int4_ms, int8_ms = (best_ms(partial(run_all, methods, in_features, inputs), repeat, budget_s=0.0)
                                     for methods in variants)
        print(f"| {m} | {fp32_ms:.2f} | {int4_ms:.2f} | {int8_ms:.2f} | {fp32_ms / int4_ms:.1f}x |", flush=True)


def decode_pass(repeat: int) -> None:
    """All layers' projections, bf16 to bf16, as the fused decode step calls them."""
    kernels = load_kernels(CACHE_DIR / "native")
    weights = [random_q4_1(n, k) for _ in range(LAYERS) for k, n in LAYER_SHAPES]
    int4 = [Int4Linear(w) for w in weights]
    twin = [PackedBf16Linear(w.dequantize()) if PackedBf16Linear.available() else None for w in weights]
    kinds = [kind for kind in TILE_KINDS
             if kernels is not None and kernels.select_tile_matmul(kind) == kind]
    tiles = {kind: [(pack_for(kind, w), w.shape[0]) for w in weights] for kind in kinds}
    if kernels is not None:
        kernels.select_tile_matmul(None)

    def run(kind: str, inputs: dict[int, torch.Tensor]) -> None:
        for index, weight in enumerate(weights):
            x = inputs[weight.shape[1]]
            if kind == "int4":
                int4[index].bf16(x)
            elif kind == "twin" and (dense := twin[index]) is not None:
                dense.bf16(x)
            elif kernels is not None:
                kernels.tile_matmul(x, *tiles[kind][index])

    def timed(column: str, inputs: dict[int, torch.Tensor]) -> float | None:
        # "amx": AMX for every call; "engine": the best kind with its default threshold
        kind = (kinds[0] if kinds else "") if column == "engine" else column
        if (kind == "twin" and twin[0] is None) or kind not in ("int4", "twin", *kinds):
            return None
        if kernels is not None and kind in kinds:
            kernels.select_tile_matmul(kind)
        default_rows = kernels.amx_min_rows if kernels is not None else 0
        if kernels is not None and column == "amx":
            kernels.amx_min_rows = 1
        try:
            return best_ms(partial(run, kind, inputs), repeat, budget_s=0.0)
        finally:
            if kernels is not None:
                kernels.select_tile_matmul(None)
                kernels.amx_min_rows = default_rows

    print()
    print(f"Decode path: {LAYERS} layers x (q|k|v, o, gate|up, down), bf16 in and out, distinct weights per layer"
          + ("" if kinds else " (no tile kernel here: those columns are empty)"))
    print()
    macs = sum(k * n for k, n in LAYER_SHAPES) * LAYERS
    print("| M | int4 ms | AMX tiles ms | AVX512-VNNI ms | AVX2 ms | engine's kernel ms | (GMAC/s) | bf16 twin ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in (1, 2, 4, 8, 12, 16, 32, 64, 128):
        inputs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (576, 1536)}
        cells = [timed(column, inputs) for column in ("int4", "amx", "avx512-vnni", "avx2", "engine")]
        engine = cells[-1]
        cells += [None if engine is None else m * macs / engine / 1e6, timed("twin", inputs)]
        print(f"| {m} | " + " | ".join("-" if c is None else f"{c:.2f}" if i != 5 else f"{c:.0f}"
                                      for i, c in enumerate(cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
