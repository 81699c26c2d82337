"""The layering rules of docs/architecture.md, checked on the source: data runs downhill.

Imports are read with ``ast`` (also those inside functions and ``TYPE_CHECKING`` blocks: a rule that
holds only at run time is not a rule).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "chatd"


def chatd_imports(path: Path) -> set[str]:
    """Every chatd module that ``path`` imports (absolute names)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "chatd")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "chatd":
                found.add(node.module)
                # `from chatd import x` may name a module
                found.update(f"{node.module}.{alias.name}" for alias in node.names
                             if (PACKAGE.parent / node.module.replace(".", "/") / f"{alias.name}.py").exists())
    return found


def modules_in(*parts: str) -> list[Path]:
    return sorted((PACKAGE.joinpath(*parts)).rglob("*.py"))


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("layer", ["engine", "kv"])
def test_engine_and_kv_never_import_the_edges(layer: str) -> None:
    forbidden = ("chatd.protocol", "chatd.server", "chatd.store", "chatd.client", "chatd.service")
    offenders = {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in modules_in(layer) for name in chatd_imports(path)
        if any(_within(name, f) for f in forbidden)
    }
    assert not offenders


def test_store_imports_only_errors_and_the_domain() -> None:
    allowed = ("chatd.errors", "chatd.domain", "chatd.store")
    offenders = {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in modules_in("store") for name in chatd_imports(path)
        if not any(_within(name, a) for a in allowed)
    }
    assert not offenders


def test_pure_core_modules_import_no_io_layers() -> None:
    # The domain words and the wire models are shared by every layer, so they depend on nothing of chatd
    # but the error tree (and the wire on the domain).
    rules = {"domain.py": set(), "errors.py": set(), "protocol.py": {"chatd.errors", "chatd.domain"},
             "kv/policy.py": set(), "kv/snapshot.py": {"chatd.errors", "chatd.kv.snapshot_frames"},
             "kv/snapshot_frames.py": {"chatd.errors"}}
    for rel, allowed in rules.items():
        extra = chatd_imports(PACKAGE / rel) - allowed
        assert not extra, f"chatd/{rel} imports {sorted(extra)}"


def test_only_the_kv_layer_hands_work_to_the_engine_thread() -> None:
    callers = sorted(str(path.relative_to(PACKAGE.parent)) for path in modules_in()
                     if "worker.call(" in path.read_text() and path.name != "worker.py")
    assert callers == ["chatd/kv/manager.py", "chatd/kv/restore.py"]


def test_loading_the_engine_and_kv_layers_loads_no_edge_module() -> None:
    # A fresh interpreter: what those modules pull in at run time, also indirectly.
    modules = [f"chatd.{p.relative_to(PACKAGE).with_suffix('').as_posix().replace('/', '.')}"
               for layer in ("engine", "kv") for p in modules_in(layer) if p.name != "__init__.py"]
    code = f"import sys, {', '.join(modules)}; print('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True,
                            check=True).stdout.split()
    assert "chatd.kv.manager" in loaded and "chatd.engine.worker" in loaded
    forbidden = ("chatd.protocol", "chatd.server", "chatd.store", "chatd.client")
    assert [name for name in loaded if any(_within(name, f) for f in forbidden)] == []


def _third_party_imports(path: Path) -> set[str]:
    """The top-level names of every non-chatd, non-stdlib module ``path`` imports (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return {name for name in found if name != "chatd" and name not in sys.stdlib_module_names}


def _server_distributions() -> set[str]:
    """Every distribution a ``pip install 'chatd[server,postgres]'`` brings, dependencies of dependencies included."""
    from importlib import metadata

    from packaging.requirements import Requirement

    def norm(name: str) -> str:
        return name.lower().replace("_", "-").replace(".", "-")

    seen: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [("chatd", frozenset({"server", "postgres"}))]
    while todo:
        name, extras = todo.pop()
        if norm(name) in seen:
            continue
        seen.add(norm(name))
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            wanted = any(requirement.marker is None or requirement.marker.evaluate({"extra": extra})
                         for extra in {"", *extras})
            if wanted:
                todo.append((requirement.name, frozenset(requirement.extras)))
    return seen


def test_the_package_imports_nothing_a_server_install_lacks() -> None:
    """A server-only install (``chatd[server]``, with ``postgres``) has every third-party module chatd imports: no
    test or benchmark tooling (httpx, tomli-w, pytest...) in the package. Those live in devtools/."""
    from importlib import metadata

    allowed = _server_distributions()
    owners = metadata.packages_distributions()
    offenders = {
        f"{path.relative_to(PACKAGE.parent)} imports {name} ({', '.join(owners.get(name, ['not installed']))})"
        for path in modules_in() for name in _third_party_imports(path)
        if not any(dist.lower().replace("_", "-") in allowed for dist in owners.get(name, []))
    }
    assert "dev" not in {p.stem for p in modules_in()}
    assert not offenders


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_service_layer_imports_no_wire_model_and_no_edge() -> None:
    """The service works in its own types (chatd.service.types); the edges map them to the wire's models."""
    forbidden = ("chatd.protocol", "chatd.server", "chatd.client", "chatd.cli")
    offenders = {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in [*modules_in("service"), PACKAGE / "counters.py"] for name in chatd_imports(path)
        if any(_within(name, f) for f in forbidden)
    }
    assert not offenders


def test_counters_are_a_leaf() -> None:
    assert chatd_imports(PACKAGE / "counters.py") == set()


def test_no_import_circles() -> None:
    """No chatd module reaches itself through its imports: type-only imports and imports inside functions count."""
    graph = {_module_name(path): {name for name in chatd_imports(path)} for path in modules_in()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                cycles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert cycles == []
