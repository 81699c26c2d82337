"""The compact forward on each architecture it covers (Llama with Llama 3's RoPE scaling, Mistral with its sliding
window, Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3), against transformers' own eager forward on tiny random checkpoints
made here with transformers' config classes and the packaged tokenizer; an architecture it does not cover runs on
transformers' forward and says why."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from chatd.config import ModelSettings
from chatd.engine.model.gguf_file import file_identity, write_gguf
from chatd.engine.model.packaged import PACKAGED_GGUF
from chatd.engine.model.packaged import packaged_model_dir as package_dir
from chatd.engine.model.runner import ModelRunner
from chatd.engine.model.weights import Rope
from chatd.errors import ConfigError
from devtools.reference import teacher_forced_agreement
from tests.support import assert_cache_paths_exact, packaged_model_dir

SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                         "max_position_embeddings": 4096}
# Sliding windows of 8 positions: shorter than every prompt here, so a forward that ignores them fails.
ARCHITECTURES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"sliding_window": 8}),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"sliding_window": 8, "query_pre_attn_scalar": 16,
                                                 "attn_logit_softcapping": 1.0, "final_logit_softcapping": 5.0,
                                                 "hidden_activation": "gelu_pytorch_tanh"}),
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM, {
        # Gemma 3's own pattern (every sixth layer global), which a GGUF does not record: six layers.
        "num_hidden_layers": 6, "sliding_window": 8, "query_pre_attn_scalar": 16,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}}}),
    "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM, {}),  # not on the compact forward
}
COMPACT = [name for name in ARCHITECTURES if name != "gpt_neox"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tokenizer = AutoTokenizer.from_pretrained(packaged_model_dir())
    made = {}
    for name, (config_class, model_class, extra) in ARCHITECTURES.items():
        config = config_class(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                              **{**SHAPE, **extra})
        torch.manual_seed(7)
        model = model_class(config)
        with torch.no_grad():
            model.get_output_embeddings().weight.normal_(0, 0.5)  # wider logits: greedy paths that differ show
            for module_name, param in model.named_parameters():
                if "norm" in module_name:  # norms that are not all ones (Gemma's: not all zeros) must be applied
                    param.add_(torch.randn_like(param) * 0.3)
                elif module_name.endswith("bias") and "proj" in module_name:  # Qwen2's q/k/v biases, non-zero
                    param.normal_(0, 0.5)
                elif module_name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                    param.normal_(0, 0.2)  # attention far from uniform: how scores are scaled and capped shows
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        made[name] = folder
    return made


def reference(folder: Path) -> torch.nn.Module:
    """transformers' eager forward (its SDPA path drops Gemma 2's soft-capping)."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def load(folder: Path, data: Path, weights: str = "float32", dtype: str = "auto") -> ModelRunner:
    return ModelRunner.load(ModelSettings(source=str(folder), weights=weights, dtype=dtype, threads=1), data)


@pytest.mark.parametrize("arch", COMPACT)
def test_the_compact_forward_reproduces_transformers(folders: dict[str, Path], tmp_path: Path, arch: str) -> None:
    runner = load(folders[arch], tmp_path)
    assert runner.forward is not None and runner.info.architecture == arch
    want = reference(folders[arch])
    agreement = teacher_forced_agreement(runner, want)
    assert agreement.agree == agreement.total and agreement.max_abs_diff < 1e-3
    runner.forward.kernels = None  # torch's ops alone, as on CUDA
    agreement = teacher_forced_agreement(runner, want)
    assert agreement.agree == agreement.total and agreement.max_abs_diff < 1e-3
    for weights in ("int8", "bfloat16"):  # close, not equal (bf16: the fused native path where it runs)
        close = teacher_forced_agreement(load(folders[arch], tmp_path, weights), want)
        assert close.ratio >= 0.9 and close.clear_misses == 0, weights


def test_a_window_no_run_reaches_attends_through_the_native_kernel(folders: dict[str, Path], tmp_path: Path) -> None:
    """A sliding window longer than every run's view (but shorter than the context) cuts nothing: the step takes
    the native attention kernel, with transformers' logits."""
    model = reference(folders["mistral"])
    model.config.sliding_window = 1000
    folder = tmp_path / "wide-window"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(folders["mistral"]).save_pretrained(folder)
    runner = load(folder, tmp_path)
    forward = runner.forward
    assert forward is not None and forward.shape.windows == (1000, 1000)
    if forward.kernels is None:
        pytest.skip("the native kernels did not build here: nothing native to take")
    native = forward.kernels.decode_attention
    calls = []

    def counted(*args: Any) -> None:
        calls.append(1)
        native(*args)

    forward.kernels.decode_attention = counted  # type: ignore[method-assign]
    agreement = teacher_forced_agreement(runner, reference(folder))
    assert agreement.agree == agreement.total and agreement.max_abs_diff < 1e-3
    assert calls


def test_what_each_architecture_changes_is_in_its_shape(folders: dict[str, Path], tmp_path: Path) -> None:
    shapes = {arch: load(folders[arch], tmp_path).forward.shape for arch in COMPACT}  # type: ignore[union-attr]
    assert shapes["llama"].plain and shapes["qwen2"].plain
    assert shapes["llama"].ropes[0] != Rope.default(500000.0, 16)  # Llama 3's scaled frequencies
    assert shapes["mistral"].windows == (8, 8) and shapes["phi3"].windows == (8, 8)
    assert shapes["gemma2"].windows == (8, None) and shapes["gemma2"].attention_softcap == 1.0
    assert shapes["gemma2"].final_softcap == 5.0 and shapes["gemma2"].activation == "gelu_tanh"
    gemma3 = shapes["gemma3_text"]
    assert gemma3.qk_norm and gemma3.sandwich_norms and len(gemma3.ropes) == 2
    assert gemma3.layer_ropes == (1, 1, 1, 1, 1, 0) and gemma3.windows == (8, 8, 8, 8, 8, None)
    assert shapes["qwen3"].qk_norm and not shapes["qwen3"].sandwich_norms


@pytest.mark.parametrize("arch", COMPACT)
async def test_cached_paths_are_exact(folders: dict[str, Path], tmp_path: Path, make_settings: Any,
                                      arch: str) -> None:
    runner = load(folders[arch], tmp_path)
    await assert_cache_paths_exact(runner, make_settings(folders[arch], cache={"restore_min_tokens": 0}))


@pytest.mark.parametrize("matrix_type", ["F32", "Q4_0"])
def test_a_llama_3_gguf_keeps_its_rope_scaling(folders: dict[str, Path], tmp_path: Path, matrix_type: str) -> None:
    """llama.cpp keeps Llama 3's RoPE scaling as a ``rope_freqs`` tensor, which transformers' GGUF loader drops: the
    conversion recovers the scaling from it, and both forwards run it."""
    original = reference(folders["llama"])
    path = tmp_path / f"llama3-{matrix_type}.gguf"
    write_gguf(original, path, matrix_type, tokenizer_from=package_dir() / PACKAGED_GGUF, name="llama3")
    assert "rope_freqs.weight" in {tensor.name for tensor in gguf.GGUFReader(str(path)).tensors}
    # A folder converted by a chatd before the RoPE scaling was recovered (its config plain) is not reused.
    stale = tmp_path / "models" / f"{path.stem}-{file_identity(path)[:16]}"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text(original.config.to_json_string().replace('"llama3"', '"default"'))
    (stale / "chatd-model.json").write_text(json.dumps({"name": "llama3", "weights_hash": file_identity(path)}))
    runner = load(path, tmp_path, "float32")
    assert runner.model.config.rope_parameters["rope_type"] == "llama3"
    folder = load(folders["llama"], tmp_path).forward
    assert runner.forward is not None and folder is not None and runner.forward.shape.ropes == folder.shape.ropes
    if matrix_type == "F32":  # the same weights as the folder's: the same logits
        agreement = teacher_forced_agreement(runner, original)
        assert agreement.agree == agreement.total and agreement.max_abs_diff < 1e-3
    else:  # the file's own blocks, against the fp32 forward over them dequantised
        blocks = load(path, tmp_path, "q4")
        assert blocks.forward is not None and blocks.forward.shape.ropes == runner.forward.shape.ropes
        close = teacher_forced_agreement(blocks, runner.model)
        assert close.ratio >= 0.9 and close.clear_misses == 0


# A Mistral GGUF is a llama one, which has no sliding window (llama.cpp runs it without): the folder's window differs.
@pytest.mark.parametrize("arch", [name for name in COMPACT if name != "mistral"])
def test_a_gguf_file_of_each_architecture_runs_like_its_folder(folders: dict[str, Path], tmp_path: Path,
                                                                arch: str) -> None:
    """Written as llama.cpp lays the architecture out (write_gguf), converted through transformers' GGUF loader
    (with the RoPE scaling it drops put back): F32 gives the folder's logits, Q8_0 close ones."""
    original = reference(folders[arch])
    for matrix_type in ("F32", "Q8_0"):
        path = tmp_path / f"{arch}-{matrix_type}.gguf"
        write_gguf(original, path, matrix_type, tokenizer_from=package_dir() / PACKAGED_GGUF, name=arch)
        runner = load(path, tmp_path, "float32")
        assert runner.forward is not None and runner.info.architecture == arch
        agreement = teacher_forced_agreement(runner, original)
        if matrix_type == "F32":
            assert agreement.agree == agreement.total and agreement.max_abs_diff < 1e-3
        else:
            assert agreement.ratio >= 0.9 and agreement.clear_misses == 0


def test_transformers_forward_keeps_the_sliding_window_over_the_pool(folders: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    runner = load(folders["mistral"], tmp_path, "transformers")
    assert runner.forward is None
    agreement = teacher_forced_agreement(runner, reference(folders["mistral"]))
    assert agreement.agree == agreement.total and agreement.max_abs_diff < 1e-3


def test_an_architecture_the_compact_forward_lacks_runs_on_transformers(
        folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        runner = load(folders["gpt_neox"], tmp_path, "auto")
    assert runner.forward is None and runner.info.weights == "transformers"
    assert "'gpt_neox' is not a supported decoder" in runner.info.weights_from
    assert "transformers' forward" in caplog.text
    with pytest.raises(ConfigError, match="gpt_neox"):
        load(folders["gpt_neox"], tmp_path, "float32")


# A llama GGUF has no sliding window (see above), so Mistral's quantised file cannot be read back as a reference.
@pytest.mark.parametrize("arch", [name for name in COMPACT if name != "mistral"])
def test_q4_runs_each_architecture(folders: dict[str, Path], tmp_path: Path, arch: str) -> None:
    """``q4`` on every architecture: a Q4_1 GGUF's own blocks (biases, q/k norms, Gemma's norms, Phi-3's fused
    tensors read from the file) and the folder quantised on load (the same blocks), each close to transformers'
    eager forward over the file's weights dequantised. (Against the unquantised folder 4 bits lose more than the
    tiny models' margins: the comparison is with the weights the blocks hold.)"""
    path = tmp_path / f"{arch}-Q4_1.gguf"
    write_gguf(reference(folders[arch]), path, "Q4_1", tokenizer_from=package_dir() / PACKAGED_GGUF, name=arch)
    load(path, tmp_path, "float32")  # converts the file: its folder holds the dequantised weights
    converted = next(folder for folder in (tmp_path / "models").iterdir() if (folder / "config.json").exists())
    want = reference(converted)
    blocks = load(path, tmp_path, "auto")  # auto runs a GGUF's blocks on the CPU
    assert blocks.info.weights == "q4" and blocks.info.weights_from == f"the blocks of {path.name} as they are"
    on_load = load(folders[arch], tmp_path, "q4")
    assert on_load.forward is not None and "quantised on load to Q4_1" in on_load.info.weights_from
    assert on_load.forward.shape == load(folders[arch], tmp_path).forward.shape  # type: ignore[union-attr]
    for runner in (blocks, on_load):
        close = teacher_forced_agreement(runner, want)
        # The kernels round activations to int8 per block of 32: near-ties may flip, clear winners may not.
        assert close.ratio >= 0.85 and close.clear_misses == 0, (runner.info.weights_from, close)


def test_q4_refuses_to_quantise_what_it_cannot_write(folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gpt_neox"):
        load(folders["gpt_neox"], tmp_path, "q4")
    assert not (tmp_path / "models").exists()
