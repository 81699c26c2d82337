"""static/wire.js is generated from the Python definitions, committed, and the only place the browser
gets wire constants from."""

from __future__ import annotations

import json
import re

import pytest

from chatd import domain
from chatd.errors import ERROR_CODES, WIRE_ERRORS, ChatdError
from chatd.server import wirejs
from tests.support import ROOT

STATIC = ROOT / "static"


def test_committed_wire_js_is_what_the_generator_writes() -> None:
    committed = (STATIC / "wire.js").read_text(encoding="utf-8")
    assert committed == wirejs.render(), "static/wire.js is stale: run python -m chatd.server.wirejs"
    assert wirejs.main(["--check"]) == 0


def test_wire_js_carries_every_constant() -> None:
    text = wirejs.render()
    exported = dict(re.findall(r"^export const (\w+) = (.+?);$", text, flags=re.MULTILINE))
    assert json.loads(exported["SUBPROTOCOL"]) == domain.SUBPROTOCOL
    assert json.loads(exported["KEY_SUBPROTOCOL_PREFIX"]) == domain.KEY_SUBPROTOCOL_PREFIX
    for name in ("CLOSE_IDLE", "CLOSE_UNAUTHORIZED", "CLOSE_TOO_SLOW"):
        assert int(exported[name]) == getattr(domain, name)
    frozen = {name: json.loads(value.removeprefix("Object.freeze(").removesuffix(")"))
              for name, value in exported.items() if value.startswith("Object.freeze(")}
    assert frozen["ERROR_CODES"] == list(ERROR_CODES)
    assert sorted(frozen["ERROR"].values()) == sorted(ERROR_CODES)
    assert frozen["ROLES"] == list(domain.ROLES)
    assert frozen["FINISH_REASONS"] == list(domain.FINISH_REASONS)
    assert frozen["TIERS"] == list(domain.TIERS)


def test_error_codes_are_the_error_classes_codes_and_documented() -> None:
    assert ERROR_CODES == tuple(cls.code for cls in WIRE_ERRORS)
    assert len(set(ERROR_CODES)) == len(ERROR_CODES)
    assert all(issubclass(cls, ChatdError) for cls in WIRE_ERRORS)
    protocol_doc = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    for code in ERROR_CODES:
        assert f"| `{code}` |" in protocol_doc, code


@pytest.mark.parametrize("path", sorted(p.name for p in STATIC.glob("*.js") if p.name != "wire.js"))
def test_browser_code_imports_wire_constants_instead_of_writing_them(path: str) -> None:
    text = (STATIC / path).read_text(encoding="utf-8")
    literals = {domain.SUBPROTOCOL, domain.KEY_SUBPROTOCOL_PREFIX, *ERROR_CODES}
    for literal in literals:
        assert not re.search(rf"[\"'`]{re.escape(literal)}[\"'`]", text), f"{path} writes {literal!r}"
    for code in (domain.CLOSE_IDLE, domain.CLOSE_UNAUTHORIZED, domain.CLOSE_TOO_SLOW):
        assert not re.search(rf"(?:===?|code\s*[:=]|case)\s*{code}\b", text), f"{path} compares with {code}"
    # Whatever it takes from wire.js, wire.js exports.
    exported = set(re.findall(r"^export const (\w+)", wirejs.render(), flags=re.MULTILINE))
    for names in re.findall(r"import\s*\{([^}]*)\}\s*from\s*\"\./wire\.js\"", text):
        imported = {name.strip().split(" as ")[0] for name in names.split(",") if name.strip()}
        assert imported <= exported, imported - exported
