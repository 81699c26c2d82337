"""The compact forward on each architecture it covers (Llama, Mistral, Qwen2), against transformers' own forward
on tiny random checkpoints made here with transformers' config classes and the packaged tokenizer; an architecture
it does not cover runs on transformers' forward and says why."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from chatd.config import ModelSettings
from chatd.engine.model.runner import ModelRunner
from chatd.errors import ConfigError
from devtools.reference import teacher_forced_agreement
from tests.support import assert_cache_paths_exact, packaged_model_dir

SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                         "max_position_embeddings": 4096}
ARCHITECTURES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"rope_theta": 500000.0}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"rope_theta": 1000000.0, "tie_word_embeddings": True}),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"sliding_window": 64, "query_pre_attn_scalar": 16}),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tokenizer = AutoTokenizer.from_pretrained(packaged_model_dir())
    made = {}
    for name, (config_class, model_class, extra) in ARCHITECTURES.items():
        config = config_class(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                              **SHAPE, **extra)
        torch.manual_seed(7)
        model = model_class(config)
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 0.5)  # wider logits: greedy paths that differ show
            if name == "qwen2":  # non-zero q/k/v biases, so a forward that drops them fails
                for layer in model.model.layers:
                    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                        proj.bias.normal_(0, 0.5)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        made[name] = folder
    return made


def load(folder: Path, data: Path, weights: str = "float32", dtype: str = "auto") -> ModelRunner:
    return ModelRunner.load(ModelSettings(source=str(folder), weights=weights, dtype=dtype, threads=1), data)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_the_compact_forward_reproduces_transformers(folders: dict[str, Path], tmp_path: Path, arch: str) -> None:
    runner = load(folders[arch], tmp_path)
    assert runner.forward is not None and runner.info.architecture == arch
    agreement = teacher_forced_agreement(runner, runner.model)
    assert agreement.agree == agreement.total and agreement.max_abs_diff < 1e-3
    int8 = load(folders[arch], tmp_path, "int8")  # int8 weights: close, not equal
    close = teacher_forced_agreement(int8, runner.model)
    assert close.ratio >= 0.9 and close.clear_misses == 0


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
async def test_cached_paths_are_exact(folders: dict[str, Path], tmp_path: Path, make_settings: Any,
                                      arch: str) -> None:
    runner = load(folders[arch], tmp_path)
    await assert_cache_paths_exact(runner, make_settings(folders[arch], cache={"restore_min_tokens": 0}))


def test_an_architecture_the_compact_forward_lacks_runs_on_transformers(
        folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        runner = load(folders["gemma2"], tmp_path, "auto")
    assert runner.forward is None and runner.info.weights == "transformers"
    assert "'gemma2' is not a supported Llama-family decoder" in runner.info.weights_from
    assert "transformers' forward" in caplog.text
    with pytest.raises(ConfigError, match="gemma2"):
        load(folders["gemma2"], tmp_path, "float32")


def test_q4_quantises_llama_models_only(folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Llama models only, not 'qwen2'"):
        load(folders["qwen2"], tmp_path, "q4")
    assert not (tmp_path / "models").exists()
