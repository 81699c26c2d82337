"""Which CPU features the engine uses: the machine's own, or fewer where ``CHATD_CPU_ISA`` caps them.

The cap makes a machine run as a smaller CPU class would, so the suite and the server can be tried as an
AVX2-only machine (AMD Zen 3, Intel before Skylake-SP) runs them on a host that has AVX-512 or AMX:

- ``native`` (the default): everything this CPU has;
- ``avx512``: no AMX tiles (an AVX-512 CPU such as AMD Zen 4 or Intel Ice Lake);
- ``avx2``: no AVX-512 and no AMX (x86-64-v3's vector units: AVX2, FMA, F16C).

The cap reaches every place that picks a path by the CPU: the native kernels' dispatch table (which variants of the
one library run, chatd.engine.kernels.loader) and the byte planes' build (:attr:`CpuFeatures.arch`), the choice of
bf16 matmuls and attention, and, through :func:`library_environment`, torch's own kernels
(``ATEN_CPU_CAPABILITY``) and oneDNN's (``ONEDNN_MAX_CPU_ISA``), which read their variables once, before
torch's first operation: ``chatd serve`` and the test suite export them before importing torch.

This module imports nothing heavy (no torch): the CLI uses it before torch is loaded.
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

ISA_ENV = "CHATD_CPU_ISA"
ISA_CAPS = ("native", "avx512", "avx2")
# The flags (as /proc/cpuinfo names them) that each cap takes away.
_AMX = frozenset({"amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "amx_complex"})
_REMOVED = {"native": frozenset(), "avx512": _AMX,
            "avx2": _AMX | frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni",
                                      "avx512_bf16", "avx512_fp16", "avx512ifma", "avx512vbmi", "avx512_vbmi2",
                                      "avx512_bitalg", "avx512_vpopcntdq", "avx512_vp2intersect"})}
# What torch's and oneDNN's own variables say for each cap (their spellings).
_LIBRARY_CAPS = {"avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
                 "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU features the engine may use (after the cap), by /proc/cpuinfo's flag names."""

    flags: frozenset[str]
    cap: str
    """The ``CHATD_CPU_ISA`` in effect: ``native`` unless capped."""
    machine: str

    @property
    def x86(self) -> bool:
        return self.machine in ("x86_64", "AMD64")

    @property
    def avx2(self) -> bool:
        """AVX2 with FMA and F16C (x86-64-v3): the native kernels' AVX2 variants."""
        return {"avx2", "fma", "f16c"} <= self.flags

    @property
    def avx512(self) -> bool:
        return {"avx512f", "avx512bw"} <= self.flags

    @property
    def avx512_vnni(self) -> bool:
        return self.avx512 and "avx512_vnni" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        return self.avx512 and "avx512_bf16" in self.flags

    @property
    def amx(self) -> bool:
        return {"amx_tile", "amx_bf16", "amx_int8"} <= self.flags

    @property
    def bf16_matmul(self) -> bool:
        """Whether bf16 matrices multiply in hardware here (AMX tiles or AVX512-BF16)."""
        return self.amx or self.avx512_bf16

    @property
    def arch(self) -> str:
        """The ``-march`` the byte planes' library is built with: this very CPU, or the cap's class. (The kernels'
        library is built for every class at once, and the cap chooses among its variants at load.)"""
        if self.cap == "avx2" and self.x86:
            return "x86-64-v3"
        return "native"

    @property
    def extra_flags(self) -> tuple[str, ...]:
        """Compiler flags beside ``-march`` that the cap needs (``avx512``: no AMX code)."""
        if self.cap == "avx512" and self.x86:
            return ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
        return ()

    @property
    def names(self) -> tuple[str, ...]:
        """The features that choose the engine's paths, for logs and ``/admin/stats``."""
        found = [("avx2", self.avx2), ("avx512", self.avx512), ("avx512-vnni", self.avx512_vnni),
                 ("avx512-bf16", self.avx512_bf16), ("amx", self.amx)]
        return tuple(name for name, present in found if present)

    def describe(self) -> str:
        features = ", ".join(self.names) or "none of avx2, avx512, amx"
        capped = f" (capped by {ISA_ENV}={self.cap})" if self.cap != "native" else ""
        return f"{features}{capped}"


def _cpuinfo_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def isa_cap(environ: Mapping[str, str] | None = None) -> str:
    """The cap ``CHATD_CPU_ISA`` asks for (``native`` when unset). Raises ValueError for an unknown value."""
    value = (os.environ if environ is None else environ).get(ISA_ENV, "native").strip().lower() or "native"
    if value not in ISA_CAPS:
        raise ValueError(f"{ISA_ENV}={value!r}: expected one of {', '.join(ISA_CAPS)}")
    return value


@functools.cache
def cpu_features() -> CpuFeatures:
    """This CPU's features after the cap (read once per process)."""
    cap = isa_cap()
    return CpuFeatures(flags=_cpuinfo_flags() - _REMOVED[cap], cap=cap, machine=platform.machine())


def library_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Export the cap to torch's and oneDNN's own variables (those not set already) in ``environ`` (the
    process's by default), before torch is imported; returns what was set."""
    environ = os.environ if environ is None else environ
    wanted = _LIBRARY_CAPS.get(isa_cap(environ), {})
    added = {name: value for name, value in wanted.items() if name not in environ}
    environ.update(added)
    return added
