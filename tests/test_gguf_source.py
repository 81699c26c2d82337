"""A GGUF file as ``[model] source``: the tiny random Llama written as GGUF files of each type chatd can write
(with the packaged model's tokenizer metadata), loaded through ModelRunner, against transformers' forward over the
same file's dequantised weights; ``weights = "q4"`` from a file's own blocks and quantised on load."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from chatd.config import ModelSettings
from chatd.engine.model.gguf_file import describe_gguf, write_gguf
from chatd.engine.model.gguf_weights import read_blocks
from chatd.engine.model.packaged import PACKAGED_GGUF, packaged_model_dir
from chatd.engine.model.quant import Q4_1Weight, Q8_0Weight, read_tensor
from chatd.engine.model.quantise import q4_blocks_problem
from chatd.engine.model.runner import ModelRunner
from chatd.errors import ConfigError
from chatd.preflight import check_model_source
from devtools.kquants import ENCODERS
from devtools.models import ROOT, tiny_model_dir
from devtools.reference import teacher_forced_agreement
from tests.support import ServerProcess, assert_cache_paths_exact

# Teacher-forced bounds for q4 (activations rounded to int8 or bf16 into the kernels) against the fp32 forward
# over the same blocks dequantised, on the tiny model (logits of a few units: its LM head is drawn with std 0.5).
# The AVX512-VNNI and AVX2 kernels read 0.12 here; the fp32 forward over the same file reads 2e-5.
Q4_MAX_LOGIT_DIFF = 0.25
Q4_MIN_AGREEMENT = 0.9
WIDE_MAX_LOGIT_DIFF = 1.0  # the wide tiny model's logits are larger (hidden 256): 0.52-0.59 measured, Q8_0 too


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data folder for the tests that do not count what is in it: each file is converted once."""
    return tmp_path_factory.mktemp("data")



def written(model: torch.nn.Module, folder: Path, matrix_type: str) -> Path:
    path = folder / f"tiny-{matrix_type}.gguf"
    if not path.exists():
        write_gguf(model, path, matrix_type, tokenizer_from=packaged_model_dir() / PACKAGED_GGUF,
                         name="tiny")
    return path


def dequantised_reference(path: Path) -> torch.nn.Module:
    """transformers' own reading of the file: the weights dequantised to fp32, its forward."""
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def load(path: Path, data_dir: Path, weights: str) -> ModelRunner:
    return ModelRunner.load(ModelSettings(source=str(path), weights=weights, threads=1), data_dir)


def test_describe_names_each_tensor_kinds_type(tiny_model: torch.nn.Module, gguf_dir: Path) -> None:
    summary = describe_gguf(written(tiny_model, gguf_dir, "Q4_0"))
    config = tiny_model.config
    assert (summary.architecture, summary.num_layers, summary.hidden_size) == ("llama", 2, config.hidden_size)
    assert (summary.num_heads, summary.num_kv_heads, summary.head_dim) == (4, 2, 16)
    assert summary.vocab_size == config.vocab_size and summary.has_chat_template
    assert summary.parameters == sum(p.numel() for p in tiny_model.parameters())
    assert summary.tensor_types["attn_q"] == "Q4_0" and summary.tensor_types["ffn_down"] == "Q4_0"
    assert summary.tensor_types["token_embd"] == "Q8_0" and summary.tensor_types["attn_norm"] == "F32"
    assert summary.matrix_types() == {"Q4_0", "Q8_0"}
    assert q4_blocks_problem(summary.architecture, summary.tensor_types) is None
    for matrix_type, problem in (("Q8_0", None), ("F16", "attn_q is F16")):
        other = describe_gguf(written(tiny_model, gguf_dir, matrix_type))
        assert q4_blocks_problem(other.architecture, other.tensor_types) == problem


def test_q4_0_blocks_read_as_the_q4_1_blocks_of_the_same_values(tiny_model: torch.nn.Module, gguf_dir: Path) -> None:
    reader = gguf.GGUFReader(str(written(tiny_model, gguf_dir, "Q4_0")))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    weight = read_tensor(tensor)
    assert isinstance(weight, Q4_1Weight)
    want = gguf.quants.dequantize(np.asarray(tensor.data), gguf.GGMLQuantizationType.Q4_0)
    assert torch.equal(weight.dequantize(), torch.from_numpy(want.astype(np.float32)))


# Unquantised files, whose fp32 forward is the faithful choice, and one quantised type through the same route.
@pytest.mark.parametrize("matrix_type", ["F32", "F16", "BF16", "Q4_0"])
def test_a_gguf_source_decodes_like_transformers_over_its_dequantised_weights(
        tiny_model: torch.nn.Module, gguf_dir: Path, shared_data: Path, matrix_type: str) -> None:
    path = written(tiny_model, gguf_dir, matrix_type)
    runner = load(path, shared_data, "float32")
    assert runner.info.weights == "float32" and runner.forward is not None
    assert runner.tokenizer.chat_template  # from the file's metadata
    # runner.model is transformers' model over the file's weights dequantised (its converted folder).
    agreement = teacher_forced_agreement(runner, runner.model, max_new_tokens=8)
    assert agreement.agree == agreement.total
    assert agreement.max_abs_diff < 1e-3


@pytest.mark.parametrize("matrix_type", ["Q4_0", "Q4_1"])
def test_q4_runs_a_files_own_blocks(tiny_model: torch.nn.Module, gguf_dir: Path, shared_data: Path,
                                    matrix_type: str) -> None:
    path = written(tiny_model, gguf_dir, matrix_type)
    runner = load(path, shared_data, "auto")  # auto runs the blocks on the CPU
    assert runner.info.weights == "q4"
    assert runner.info.weights_from == f"the blocks of {path.name} as they are"
    agreement = teacher_forced_agreement(runner, runner.model)
    assert agreement.ratio >= Q4_MIN_AGREEMENT and agreement.clear_misses == 0
    assert agreement.max_abs_diff < Q4_MAX_LOGIT_DIFF
    assert not list((shared_data / "models").glob("q4_1-*.gguf"))  # nothing quantised


def test_q4_quantises_other_weights_once_and_says_it_is_lossy(
        tiny_dir: Path, tiny_model: torch.nn.Module, gguf_dir: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    with caplog.at_level(logging.INFO):
        runner = ModelRunner.load(ModelSettings(source=str(tiny_dir), weights="q4", threads=1), data)
    assert runner.info.weights == "q4" and "quantised on load to Q4_1, lossy" in runner.info.weights_from
    assert "lossy" in caplog.text
    cached = list((data / "models").glob("q4_1-*.gguf"))
    assert len(cached) == 1
    assert describe_gguf(cached[0]).tensor_types["attn_v"] == "Q4_1"
    agreement = teacher_forced_agreement(runner, dequantised_reference(cached[0]))
    assert agreement.ratio >= Q4_MIN_AGREEMENT and agreement.max_abs_diff < Q4_MAX_LOGIT_DIFF
    stamp = cached[0].stat().st_mtime_ns
    again = ModelRunner.load(ModelSettings(source=str(tiny_dir), weights="q4", threads=1), data)
    assert again.info.weights_hash == runner.info.weights_hash
    assert cached[0].stat().st_mtime_ns == stamp  # read back, not quantised again
    # An F16 file is quantised too (its projections are not q4 blocks), into a cache entry of its own.
    f16 = load(written(tiny_model, gguf_dir, "F16"), data, "q4")
    assert "attn_q is F16" in f16.info.weights_from
    assert len(list((data / "models").glob("q4_1-*.gguf"))) == 2
    assert f16.info.weights_hash != runner.info.weights_hash


def test_each_file_is_its_own_weights(tiny_model: torch.nn.Module, gguf_dir: Path, shared_data: Path) -> None:
    hashes = {load(written(tiny_model, gguf_dir, t), shared_data, "float32").info.weights_hash
              for t in ("Q4_0", "Q4_1", "Q8_0")}
    assert len(hashes) == 3


def test_a_bad_gguf_source_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ConfigError, match=r"model\.gguf"):
        load(bogus, tmp_path / "data", "auto")
    with pytest.raises(ConfigError, match=r"missing\.gguf"):
        load(tmp_path / "missing.gguf", tmp_path / "data", "auto")
    with pytest.raises(ConfigError, match=r"model\.gguf is not a GGUF file"):  # what chatd serve checks first
        check_model_source(ModelSettings(source=str(bogus)))
    assert not (tmp_path / "data" / "models").exists() or not any((tmp_path / "data" / "models").iterdir())


async def test_a_gguf_q4_model_resumes_restores_and_edits_like_one_computed_at_once(
        tiny_model: torch.nn.Module, gguf_dir: Path, shared_data: Path, make_settings: Any) -> None:
    path = written(tiny_model, gguf_dir, "Q4_0")
    runner = load(path, shared_data, "q4")
    await assert_cache_paths_exact(runner, make_settings(path, cache={"restore_min_tokens": 0}))


def chatd_models(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATD_")}
    return subprocess.run([sys.executable, "-m", "chatd", "models", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)


def test_chatd_models_reports_what_a_source_holds(tiny_model: torch.nn.Module, gguf_dir: Path, tiny_dir: Path,
                                                  tmp_path: Path) -> None:
    path = written(tiny_model, gguf_dir, "Q8_0")
    run = chatd_models("--model", str(path), "--json")
    assert run.returncode == 0, run.stderr
    facts = json.loads(run.stdout)
    assert (facts["format"], facts["architecture"], facts["num_layers"]) == ("gguf", "llama", 2)
    assert facts["parameters"] == sum(p.numel() for p in tiny_model.parameters())
    assert facts["tensor_types"]["attn_q"] == "Q8_0" and facts["compact_forward"] is True
    assert facts["q4_blocks_as_they_are"] is True and facts["q4_why_quantised"] is None
    # 2 layers x 2 KV heads x K and V x 16 values: fp32 4 bytes each, bf16 2, int8 1 plus a 4-byte scale
    assert facts["kv_bytes_per_token"] == {"float32": 512, "bfloat16": 256, "int8": 8 * 20}

    folder = json.loads(chatd_models("--model", str(tiny_dir), "--json").stdout)
    assert (folder["format"], folder["architecture"], folder["compact_forward"]) == ("transformers", "llama", True)
    assert folder["parameters"] >= facts["parameters"] and folder["tensor_types"]["self_attn.q_proj"] == "F32"

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)).save_pretrained(gpt2)
    other = json.loads(chatd_models("--model", str(gpt2), "--json").stdout)
    assert other["architecture"] == "gpt2" and other["compact_forward"] is False
    assert "not a supported decoder" in other["compact_forward_why_not"]
    text = chatd_models("--model", str(path)).stdout
    assert "compact forward  yes" in text and "runs the file's blocks" in text
    f16 = chatd_models("--model", str(written(tiny_model, gguf_dir, "F16"))).stdout
    assert "quantises on load (attn_q is F16)" in f16

    missing = chatd_models("--model", str(tmp_path / "nothing-here"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "nothing-here" in missing.stderr


def test_a_server_on_a_gguf_file_says_what_it_runs(tiny_model: torch.nn.Module, gguf_dir: Path,
                                                   tmp_path: Path) -> None:
    path = written(tiny_model, gguf_dir, "Q4_1")
    server = ServerProcess(tmp_path / "server", path).start()
    try:
        models = httpx.get(f"{server.http_url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["tiny"]
        ours = models[0]["chatd"]
        assert ours["weights"] == "q4" and ours["weights_from"] == f"the blocks of {path.name} as they are"
        assert ours["architecture"] == "llama" and ours["compact_forward"] is True
        stats = httpx.get(f"{server.http_url}/admin/stats", headers=server.admin_headers, timeout=30).json()
        assert stats["model"]["weights_from"] == ours["weights_from"]
        assert stats["model"]["parameters"] == ours["parameters"] > 0
        reply = httpx.post(f"{server.http_url}/v1/chat/completions", timeout=120, json={
            "model": "tiny", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}]})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        server.stop()


# ----------------------------------------------------------------------------- every quantisation type

# Mixes as llama.cpp's quantiser makes them (its _M files keep attn_v, ffn_down and the embedding in Q6_K), on the
# wide tiny model, whose rows hold whole K-quant super-blocks.
MIXES: dict[str, tuple[str, dict[str, str]]] = {
    "Q4_K_M": ("Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}),
    "Q5_K_M": ("Q5_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}),
    "Q6_K": ("Q6_K", {}),
    "Q5_0": ("Q5_0", {}),
    "Q5_1": ("Q5_1", {}),
    "Q8_0": ("Q8_0", {}),
}


@pytest.fixture(scope="module")
def wide_model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(wide=True), dtype=torch.float32).eval()


def written_mix(model: torch.nn.Module, folder: Path, mix: str) -> Path:
    path = folder / f"wide-{mix}.gguf"
    if not path.exists():
        matrix_type, kinds = MIXES[mix]
        write_gguf(model, path, matrix_type, tokenizer_from=packaged_model_dir() / PACKAGED_GGUF,
                         name=f"wide-{mix}", encoders=ENCODERS, kind_types=kinds)
    return path


def test_k_quants_and_q5_read_into_the_kernels_formats(wide_model: torch.nn.Module, gguf_dir: Path) -> None:
    def tensor(mix: str, name: str) -> Any:
        reader = gguf.GGUFReader(str(written_mix(wide_model, gguf_dir, mix)))
        return next(t for t in reader.tensors if t.name == name)

    def dequantised(found: Any) -> torch.Tensor:
        return torch.from_numpy(gguf.quants.dequantize(np.asarray(found.data), found.tensor_type).astype(np.float32))

    q4_k = tensor("Q4_K_M", "blk.0.attn_q.weight")
    weight, how = read_blocks(q4_k)
    assert isinstance(weight, Q4_1Weight) and how == "repacked to Q4_1 (scales rounded to fp16)"
    want = dequantised(q4_k)
    # The quants as they are; only each sub-block's d * scale and dmin * min are rounded to fp16.
    assert float((weight.dequantize() - want).abs().max()) <= 2e-3 * float(want.abs().max())
    q5_0 = tensor("Q5_0", "blk.1.ffn_up.weight")
    weight, how = read_blocks(q5_0)
    assert isinstance(weight, Q8_0Weight) and how == "repacked to Q8_0 (exact)"
    assert torch.equal(weight.dequantize(), dequantised(q5_0))
    for mix in ("Q5_K_M", "Q6_K", "Q5_1"):
        found = tensor(mix, "blk.0.attn_output.weight")
        weight, how = read_blocks(found)
        assert isinstance(weight, Q8_0Weight) and how == f"requantised from {found.tensor_type.name} to Q8_0 (lossy)"
        want = dequantised(found)
        # Q8_0's rounding: at most half a step of each block's largest value / 127.
        assert float((weight.dequantize() - want).abs().max()) <= 0.51 * float(want.abs().max()) / 127 + 1e-6


@pytest.mark.parametrize("mix", list(MIXES))
def test_q4_runs_every_quantised_type(wide_model: torch.nn.Module, gguf_dir: Path, shared_data: Path,
                                      mix: str) -> None:
    path = written_mix(wide_model, gguf_dir, mix)
    runner = load(path, shared_data, "auto")
    assert runner.info.weights == "q4"
    assert runner.forward is not None
    runs_as = runner.forward.weights.runs_as
    matrix_type, kinds = MIXES[mix]
    assert runs_as["attn_q"].startswith(f"{matrix_type}: ")
    assert runs_as["attn_v"].startswith(f"{kinds.get('attn_v', matrix_type)}: ")
    lossy = any(t not in ("Q8_0", "Q5_0") for t in (matrix_type, *kinds.values()))
    assert ("(lossy)" in runner.info.weights_from) == lossy
    agreement = teacher_forced_agreement(runner, runner.model)
    assert agreement.ratio >= Q4_MIN_AGREEMENT and agreement.clear_misses == 0
    assert agreement.max_abs_diff < WIDE_MAX_LOGIT_DIFF


def test_a_model_card_keeps_the_files_tensor_types(tiny_model: torch.nn.Module, gguf_dir: Path,
                                                   tmp_path: Path) -> None:
    """The q4 decision reads the converted folder's card, not the file's headers (seconds at every start);
    a card written before it kept them gets them at the next start."""
    path = written(tiny_model, gguf_dir, "Q4_1")
    load(path, tmp_path, "float32")
    (card_path,) = (tmp_path / "models").glob("*/chatd-model.json")
    card = json.loads(card_path.read_text())
    assert card["gguf_architecture"] == "llama" and card["gguf_tensor_types"]["attn_q"] == "Q4_1"
    old = {k: v for k, v in card.items() if not k.startswith("gguf_")}
    card_path.write_text(json.dumps(old))
    assert load(path, tmp_path, "auto").info.weights == "q4"
    assert json.loads(card_path.read_text()) == card
