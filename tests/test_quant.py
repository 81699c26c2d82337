"""chatd.engine.model.quant on the packaged GGUF: the unpacked weights equal transformers' fp32 dequantization
bit for bit, and the int4 kernel paths match ``x @ W^T`` in fp32 within bfloat16 rounding."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open

from chatd.engine.model import gguf_weights, quant
from chatd.engine.model.packaged import PACKAGED_GGUF
from chatd.engine.model.packaged import packaged_model_dir as packaged_gguf_dir
from tests import support

LAYERS = (0, 17, 29)  # a few layers, not all 30: the tests stay quick
PROJECTIONS = {  # GGUF name -> transformers name
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Relative Frobenius error of the bf16 kernel vs fp32 x @ W^T; measured 0.25-0.35% (rounding the exact
# result to bf16 alone gives ~0.17%).
KERNEL_REL_TOL = 6e-3


@pytest.fixture(scope="module")
def reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(str(packaged_gguf_dir() / PACKAGED_GGUF))


@pytest.fixture(scope="module")
def tensors(reader: gguf.GGUFReader) -> dict[str, object]:
    return {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module")
def reference() -> Iterator[object]:
    """The fp32 safetensors that transformers wrote from the same GGUF, opened lazily."""
    path: Path = support.packaged_model_dir() / "model.safetensors"
    with safe_open(str(path), "pt") as handle:
        yield handle


def q4(tensors: dict[str, object], name: str) -> quant.Q4_1Weight:
    value = quant.read_tensor(tensors[name])
    assert isinstance(value, quant.Q4_1Weight)
    return value


def hf_weight(reference: object, layer: int, gguf_name: str) -> torch.Tensor:
    return reference.get_tensor(f"model.layers.{layer}.{PROJECTIONS[gguf_name]}.weight")  # type: ignore[attr-defined]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("layer", LAYERS)
def test_q4_1_dequantizes_to_transformers_fp32_exactly(tensors: dict[str, object], reference: object,
                                                       layer: int) -> None:
    dims = (9, 3)  # query heads, KV heads of SmolLM2-135M
    for name in PROJECTIONS:
        weight = q4(tensors, f"blk.{layer}.{name}.weight")
        if name == "attn_q":
            weight = weight.select_rows(quant.rope_row_order(dims[0], 64))
        elif name == "attn_k":
            weight = weight.select_rows(quant.rope_row_order(dims[1], 64))
        want = hf_weight(reference, layer, name)
        assert weight.scale.dtype == torch.float16 and weight.quants.dtype == torch.uint8
        assert weight.shape == tuple(want.shape)
        assert torch.equal(weight.dequantize(), want), name  # tolerance: 0, bit for bit
    for gguf_name, hf_name in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
        norm = quant.read_tensor(tensors[f"blk.{layer}.{gguf_name}.weight"])
        assert isinstance(norm, torch.Tensor)
        assert torch.equal(norm, reference.get_tensor(f"model.layers.{layer}.{hf_name}.weight"))  # type: ignore[attr-defined]


def test_q8_0_embedding_is_exact(tensors: dict[str, object], reference: object) -> None:
    embed = quant.read_tensor(tensors["token_embd.weight"])
    assert isinstance(embed, quant.Q8_0Weight)
    want = reference.get_tensor("model.embed_tokens.weight")  # type: ignore[attr-defined]
    assert torch.equal(embed.dequantize(), want)
    ids = torch.tensor([[1, 2, 49151], [0, 7, 1234]])
    assert torch.equal(embed.rows(ids), want[ids])


def test_rope_order_is_transformers_reverse_permutation() -> None:
    # within a head, GGUF rows (2j, 2j+1) become rows (j, j + head_dim/2)
    order = quant.rope_row_order(num_heads=2, head_dim=8)
    assert order.tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]


def kernel_reference(weight: quant.Q4_1Weight, x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes before its final bf16 rounding: bf16 inputs, bf16 (d, m + 8d), fp32 math."""
    n, k = weight.shape
    d = weight.scale.float().bfloat16().float()
    zero = (weight.minimum.float() + 8 * weight.scale.float()).bfloat16().float()
    q = weight.quants.view(n, k // 32, 32).float() - 8
    w = (q * d[..., None] + zero[..., None]).reshape(n, k)
    return x.bfloat16().float() @ w.T


@pytest.mark.parametrize("m", [1, 8])
def test_int4_kernel_matches_dequantized_matmul(tensors: dict[str, object], m: int) -> None:
    torch.manual_seed(m)
    for layer in LAYERS[:2]:
        weights = [q4(tensors, f"blk.{layer}.{name}.weight") for name in ("attn_q", "attn_k", "attn_v")]
        fused = quant.cat_rows(weights)  # N = 960, the fused qkv
        for weight in (fused, q4(tensors, f"blk.{layer}.ffn_down.weight")):
            linear = quant.Int4Linear(weight)
            x = torch.randn(m, weight.shape[1])
            got = linear(x)
            assert got.dtype == torch.float32 and got.shape == (m, weight.shape[0])
            want = x @ weight.dequantize().T
            assert rel_err(got, want) < KERNEL_REL_TOL
            # the formula: exactly the bf16 emulation up to the output's own bf16 rounding (2^-8 relative)
            emulated = kernel_reference(weight, x)
            assert ((got - emulated).abs() <= emulated.abs() * 2**-8 + 1e-4).all()


def test_int4_linear_keeps_leading_dims_and_small_n() -> None:
    torch.manual_seed(0)
    n, k = 48, 64  # N a multiple of 16 but not of the CPU's 32/64-row tile
    weight = quant.Q4_1Weight(
        scale=(torch.rand(n, k // 32) * 0.01 + 1e-3).half(), minimum=(-torch.rand(n, k // 32) * 0.05).half(),
        quants=torch.randint(0, 16, (n, k), dtype=torch.uint8))
    linear = quant.Int4Linear(weight)
    x = torch.randn(2, 3, k)
    got = linear(x)
    assert got.shape == (2, 3, n)
    assert rel_err(got, x @ weight.dequantize().T) < KERNEL_REL_TOL
    assert linear(torch.randn(0, k)).shape == (0, n)
    with pytest.raises(ValueError, match="multiple of 16"):
        quant.Int4Linear(quant.Q4_1Weight(weight.scale[:40], weight.minimum[:40], weight.quants[:40]))


@pytest.fixture(scope="module")
def lm_head(tensors: dict[str, object]) -> tuple[quant.Q8_0Linear, torch.Tensor]:
    embed = quant.read_tensor(tensors["token_embd.weight"])
    assert isinstance(embed, quant.Q8_0Weight)
    return quant.Q8_0Linear(embed), embed.dequantize()  # the head, its [49152, 576] fp32 weight


@pytest.mark.parametrize("m", [1, 8])
def test_lm_head_matches_dequantized_fp32(lm_head: tuple[quant.Q8_0Linear, torch.Tensor], m: int) -> None:
    head, weight = lm_head
    torch.manual_seed(10 + m)
    x = torch.randn(m, 576)
    want = x @ weight.T  # [M, 49152] fp32
    got = head(x)
    # measured: relative error 0.29%, max |diff| / max |logit| ~0.4%
    assert rel_err(got, want) < KERNEL_REL_TOL
    assert float((got - want).abs().max() / want.abs().max()) < 1e-2
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_read_layer_fuses_in_transformers_layout(reader: gguf.GGUFReader, reference: object) -> None:
    dims = gguf_weights.read_dims(reader)
    assert (dims.hidden_size, dims.num_layers, dims.num_heads, dims.num_kv_heads, dims.head_dim) == (576, 30, 9, 3, 64)
    assert (dims.intermediate_size, dims.vocab_size, dims.rope_theta) == (1536, 49152, 100000.0)
    assert dims.rms_norm_eps == pytest.approx(1e-5)
    layer = gguf_weights.read_layer(reader, dims, 0)
    torch.manual_seed(3)
    x = torch.randn(4, 576)
    qkv_want = x @ torch.cat([hf_weight(reference, 0, n) for n in ("attn_q", "attn_k", "attn_v")]).T
    assert rel_err(layer.qkv(x), qkv_want) < KERNEL_REL_TOL
    gate_up_want = x @ torch.cat([hf_weight(reference, 0, n) for n in ("ffn_gate", "ffn_up")]).T
    assert rel_err(layer.gate_up(x), gate_up_want) < KERNEL_REL_TOL
    h = torch.randn(4, 1536)
    assert rel_err(layer.down(h), h @ hf_weight(reference, 0, "ffn_down").T) < KERNEL_REL_TOL
    assert rel_err(layer.o(x), x @ hf_weight(reference, 0, "attn_output").T) < KERNEL_REL_TOL
