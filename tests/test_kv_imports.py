"""The KV layer knows nothing of the store, the wire or the server: not in its sources, not at run time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

FORBIDDEN_FOR_KV = ("chatd.store", "chatd.protocol", "chatd.server")


def _imported_modules(path: Path) -> set[str]:
    """Every module a file names in an import statement, type-checking-only imports included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN_FOR_KV)


def test_kv_sources_never_import_store_protocol_or_server() -> None:
    files = sorted((ROOT / "chatd" / "kv").glob("*.py"))
    assert len(files) >= 5
    offending = {f"{path.name}: {name}" for path in files for name in _imported_modules(path) if _forbidden(name)}
    assert not offending


def test_loading_the_kv_layer_loads_no_store_protocol_or_server_module() -> None:
    # A fresh interpreter: what the KV modules pull in at run time, also indirectly.
    code = ("import sys, chatd.kv.manager, chatd.kv.persistence, chatd.kv.policy, chatd.kv.snapshot, "
            "chatd.kv.snapshot_store; print('\\n'.join(sorted(sys.modules)))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    assert "chatd.kv.persistence" in loaded
    assert [name for name in loaded if _forbidden(name)] == []

