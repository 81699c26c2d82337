"""The native kernels' one header against everything that must agree with it, so that no signature can drift.

Every function chatd/engine/kernels/chatd_kernels.h declares (and the snapshot codec's byte planes,
chatd/kv/planes.h) is bound by chatd/engine/kernels/loader.py with ctypes argtypes of the same count and kinds
(pointer, int32, int64, float) and the same return kind, and nothing else is bound; the structs and codes Python
spells again are the header's; every source file of the library is built and reaches the header through its
includes, and none repeats a prototype of it; and the built libraries export the headers' functions and no others.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from chatd.engine.kernels import loader
from chatd.engine.pool.paged import INT8_SCALE_BYTES

HEADERS = {loader.HEADER: loader.SIGNATURES, loader.PLANES_HEADER: loader.PLANES_SIGNATURES}
# What a ctypes type passes, and what a C type is, in the kinds a signature can drift between.
_CTYPES_KINDS = {ctypes.c_void_p: "pointer", ctypes.c_int: "int32", ctypes.c_int64: "int64", ctypes.c_float: "float",
                 None: "void"}
_C_KINDS = {"void": "void", "int": "int32", "int32_t": "int32", "int64_t": "int64", "float": "float"}


def _without_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def _kind(declaration: str, *, named: bool) -> str:
    """The kind of a C type (``named``: a parameter, its name last): pointer, or what _C_KINDS says of the type."""
    if "*" in declaration:
        return "pointer"
    words = [word for word in declaration.split() if word not in ("const", "restrict")]
    if named:
        words = words[:-1]
    assert len(words) == 1 and words[0] in _C_KINDS, f"a parameter or return type ctypes has no kind for: {declaration}"
    return _C_KINDS[words[0]]


def prototypes(header: Path) -> dict[str, tuple[str, list[str]]]:
    """The functions ``header`` declares: name -> (return kind, parameter kinds)."""
    found = {}
    pattern = r"^([A-Za-z_][\w \t*]*?)\s*\b(chatd_\w+)\s*\(([^;{}()]*)\)\s*;"
    for match in re.finditer(pattern, _without_comments(header.read_text()), flags=re.M):
        result, name, parameters = match.groups()
        params = [p.strip() for p in parameters.split(",")]
        kinds = [] if params == ["void"] else [_kind(p, named=True) for p in params]
        found[name] = (_kind(result, named=False), kinds)
    return found


def defines(header: Path) -> dict[str, int]:
    return {name: int(value) for name, value in re.findall(r"^#define (CHATD_\w+) (\d+)\b", header.read_text(), re.M)}


@pytest.mark.parametrize("header", list(HEADERS), ids=lambda path: path.name)
def test_every_prototype_is_bound_with_the_same_argument_kinds(header: Path) -> None:
    declared, bound = prototypes(header), HEADERS[header]
    assert declared, f"no prototypes found in {header}"
    assert sorted(declared) == sorted(bound)  # every exported function bound, and only those
    for name, (result, parameters) in declared.items():
        restype, argtypes = bound[name]
        assert _CTYPES_KINDS[restype] == result, name
        assert [_CTYPES_KINDS[t] for t in argtypes] == parameters, name


def _declarator(text: str, pattern: str) -> tuple[str, ...]:
    match = re.fullmatch(pattern, text.strip(), re.S)
    assert match is not None, text
    return match.groups()


def _members(header: Path, struct: str) -> list[tuple[str, str]]:
    """The members of ``struct`` in ``header``, in order: (name, kind)."""
    body = re.search(rf"struct {struct} \{{(.*?)\}};", _without_comments(header.read_text()), re.S)
    assert body is not None, struct
    members = []
    for declaration in filter(None, (d.strip() for d in body.group(1).split(";"))):
        first, *rest = declaration.split(",")
        base, *declarator = _declarator(first, r"(.*?)([\s*]*)(\w+)")
        for stars, name in [declarator, *(_declarator(d, r"([\s*]*)(\w+)") for d in rest)]:
            members.append((name, "pointer" if "*" in stars else _kind(f"{base} {name}", named=True)))
    return members


@pytest.mark.parametrize(("struct", "mirror"), [("chatd_shape", loader._Shape), ("chatd_layer", loader._Layer)])
def test_the_shared_structs_are_the_headers(struct: str, mirror: type[ctypes.Structure]) -> None:
    fields = [(name, _CTYPES_KINDS[kind]) for name, kind in mirror._fields_]
    assert fields == _members(loader.HEADER, struct)


def test_the_codes_python_spells_are_the_headers() -> None:
    codes = defines(loader.HEADER)
    assert loader._KV_TYPES == {torch.float32: codes["CHATD_KV_F32"], torch.bfloat16: codes["CHATD_KV_BF16"],
                                torch.int8: codes["CHATD_KV_INT8"]}
    assert codes["CHATD_KV_SCALE_BYTES"] == INT8_SCALE_BYTES
    spelled = {"AVX2": "AVX2", "AVX-512": "AVX512", "AVX512-VNNI": "AVX512_VNNI", "AVX512-BF16": "AVX512_BF16",
               "AMX": "AMX"}
    for bit, name, _, _ in loader._FEATURES:
        assert codes[f"CHATD_CPU_{spelled[name]}"] == bit, name
    assert loader._ISAS == {codes[f"CHATD_ISA_{name.upper()}"]: name for name in loader._ISAS.values()}
    matmul = {"NONE": None, "VNNI": "avx512-vnni", "AMX": "amx", "AVX2": "avx2", "SCALAR": "scalar"}
    assert loader._TILE_KINDS == {codes[f"CHATD_MATMUL_{name}"]: kind for name, kind in matmul.items()}


def _includes(source: Path) -> set[str]:
    """The files of the library ``source`` includes, itself and through them."""
    seen: set[str] = set()
    todo = [source]
    while todo:
        path = todo.pop()
        for name in re.findall(r'^#include "([\w.]+)"', path.read_text(), re.M):
            if name not in seen:
                seen.add(name)
                todo.append(path.with_name(name))
    return seen


def test_every_source_is_built_and_includes_the_header_and_repeats_no_prototype() -> None:
    sources = sorted(loader.KERNELS_DIR.glob("*.c"))
    built = {source.path.name for source in loader.SOURCES}
    x86_only = {path.name for path in sources if re.search(r"_(avx2|avx512|amx)\.c$", path.name)}
    assert {path.name for path in sources} == (built if loader.X86 else built | x86_only)
    exported = [*loader.SIGNATURES, *loader.PLANES_SIGNATURES]
    declaration = r"^\s*(?:const\s+)?(?:void|int|int64_t|float|struct\s+\w+)[\s*]+({})\s*\([^;{{}}]*\)\s*;"
    for path in [*sources, loader.PLANES_SOURCE]:
        header = "planes.h" if path == loader.PLANES_SOURCE else "chatd_kernels.h"
        assert header in _includes(path), path.name
        repeated = re.findall(declaration.format("|".join(exported)), _without_comments(path.read_text()), re.M)
        assert not repeated, f"{path.name} repeats the prototypes of {repeated}"


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm (binutils) on this machine")
def test_the_libraries_export_the_headers_functions_and_no_others(tmp_path: Path) -> None:
    for library, header in ((loader.build(tmp_path), loader.HEADER), (loader.build_planes(tmp_path),
                                                                        loader.PLANES_HEADER)):
        symbols = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                                 check=True).stdout.split("\n")
        names = {line.split()[-1] for line in symbols if line.strip() and line.split()[-2] in "TtDdBbRr"}
        assert {name for name in names if not name.startswith("_")} == set(prototypes(header)), library.name
