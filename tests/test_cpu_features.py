"""The CPU features the engine chooses its paths by, and CHATD_CPU_ISA's cap (chatd.engine.kernels.cpu)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatd.engine.kernels import cpu
from chatd.engine.kernels.cpu import ISA_ENV, CpuFeatures, cpu_features, isa_cap, library_environment
from chatd.engine.kernels.loader import load_kernels
from tests.support import ROOT

# A CPU with everything the engine can use: AMX (Sapphire Rapids and later).
SAPPHIRE_RAPIDS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                             "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"})


def _capped(flags: frozenset[str], cap: str) -> CpuFeatures:
    return CpuFeatures(flags=flags - cpu._REMOVED[cap], cap=cap, machine="x86_64")


def test_each_cap_takes_away_the_classes_above_it() -> None:
    native = _capped(SAPPHIRE_RAPIDS, "native")
    assert native.names == ("avx2", "avx512", "avx512-vnni", "avx512-bf16", "amx")
    assert native.bf16_matmul and native.arch == "native" and native.extra_flags == ()
    assert native.describe() == "avx2, avx512, avx512-vnni, avx512-bf16, amx"

    zen4 = _capped(SAPPHIRE_RAPIDS, "avx512")
    assert zen4.names == ("avx2", "avx512", "avx512-vnni", "avx512-bf16") and not zen4.amx
    assert zen4.bf16_matmul  # AVX512-BF16 multiplies bf16 in hardware
    assert zen4.arch == "native" and "-mno-amx-tile" in zen4.extra_flags

    zen3 = _capped(SAPPHIRE_RAPIDS, "avx2")
    assert zen3.names == ("avx2",) and not zen3.bf16_matmul and not zen3.avx512_vnni
    assert zen3.arch == "x86-64-v3" and zen3.extra_flags == ()
    assert zen3.describe() == f"avx2 (capped by {ISA_ENV}=avx2)"

    old = CpuFeatures(flags=frozenset({"sse4_2", "avx"}), cap="native", machine="x86_64")
    assert old.names == () and "none of" in old.describe()
    arm = CpuFeatures(flags=frozenset({"neon", "asimd"}), cap="avx2", machine="aarch64")
    assert arm.arch == "native"  # the cap names x86 classes; elsewhere the build stays the machine's own


def test_the_cap_is_read_checked_and_passed_on_to_torch_and_onednn() -> None:
    assert isa_cap({}) == "native"
    assert isa_cap({ISA_ENV: " AVX2 "}) == "avx2"
    with pytest.raises(ValueError, match="expected one of native, avx512, avx2"):
        isa_cap({ISA_ENV: "avx9"})
    environ = {ISA_ENV: "avx2"}
    assert library_environment(environ) == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    # A value the user set is kept.
    environ = {ISA_ENV: "avx512", "ATEN_CPU_CAPABILITY": "default"}
    assert library_environment(environ) == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    assert environ["ATEN_CPU_CAPABILITY"] == "default"
    assert library_environment({}) == {}


def test_the_features_are_this_cpus_after_the_cap() -> None:
    features = cpu_features()
    flags = cpu._cpuinfo_flags()
    assert features.flags <= flags
    assert features.avx2 == ({"avx2", "fma", "f16c"} <= flags)
    if features.cap == "avx2":
        assert not features.avx512 and not features.amx


@pytest.mark.skipif(not cpu_features().avx2, reason="this CPU lacks AVX2 (with FMA and F16C)")
def test_capped_to_avx2_the_engine_builds_and_runs_the_avx2_kernels(tmp_path: Path) -> None:
    """In a fresh process with CHATD_CPU_ISA=avx2 the native kernels are the x86-64-v3 build whatever this CPU has
    beyond AVX2, the tile matmul is the AVX2 one, bf16 matmuls count as slow, and torch runs its AVX2 kernels."""
    code = ("import tests, json, sys, torch; from pathlib import Path; "
            "from chatd.engine.kernels.loader import load_kernels; "
            "from chatd.engine.model.weights import bf16_matmul_is_fast; "
            "from chatd.engine.kernels.cpu import cpu_features; "
            f"k = load_kernels(Path({str(tmp_path)!r})); "
            "print(json.dumps([k.tile_matmul_kind, bf16_matmul_is_fast(), torch.backends.cpu.get_cpu_capability(), "
            "cpu_features().names]))")
    env = {**os.environ, ISA_ENV: "avx2"}
    env.pop("ATEN_CPU_CAPABILITY", None)
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    kind, bf16_fast, torch_capability, names = json.loads(run.stdout.strip().splitlines()[-1])
    assert kind == "avx2" and bf16_fast is False and torch_capability == "AVX2" and names == ["avx2"]


def test_the_loaded_kernels_follow_the_features(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="chatd.engine.kernels.loader"):
        kernels = load_kernels(tmp_path)
    if kernels is None:
        pytest.fail("the test machine has a C compiler (make test installs one)")
    features = cpu_features()
    expected = "amx" if features.amx else "avx512-vnni" if features.avx512_vnni else "avx2" if features.avx2 else None
    # AMX also needs the kernel's permission for this process; the vector kernel stands in without it.
    assert kernels.tile_matmul_kind == expected or (expected == "amx" and kernels.tile_matmul_kind == "avx512-vnni")
