"""docs/protocol.schema.json: a JSON Schema (draft 2020-12) of every websocket frame, generated from the
pydantic models in chatd/protocol.py, for clients written in other languages and for validators.

``#/$defs/ClientFrame`` is what a client may send, ``#/$defs/ServerFrame`` what the server sends; both are
unions discriminated by ``type``. After changing chatd/protocol.py, regenerate it::

    python -m chatd.server.frameschema          # rewrites docs/protocol.schema.json
    python -m chatd.server.frameschema --check  # exit status 1 when the committed file is stale

tests/test_frame_schema.py fails while the committed file differs from :func:`render`, and checks every
frame example in docs/protocol.md against the schema.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from chatd.protocol import PROTOCOL_VERSION, ClientFrame, ServerFrame

SCHEMA_FILE = Path(__file__).resolve().parent.parent.parent / "docs" / "protocol.schema.json"
REF_TEMPLATE = "#/$defs/{model}"


def schema() -> dict[str, Any]:
    """The schema document: both frame unions and every model they use under ``$defs``."""
    defs: dict[str, Any] = {}
    unions: dict[str, TypeAdapter[Any]] = {"ClientFrame": TypeAdapter(ClientFrame),
                                           "ServerFrame": TypeAdapter(ServerFrame)}
    for name, adapter in unions.items():
        # Validation mode for both: what a parser of the frame accepts (chatd's own client parses server
        # frames with the same models).
        generated = adapter.json_schema(ref_template=REF_TEMPLATE, mode="validation")
        for model, definition in generated.pop("$defs", {}).items():
            if defs.get(model, definition) != definition:
                raise ValueError(f"two different definitions of {model}")
            defs[model] = definition
        defs[name] = generated
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"chatd-protocol-v{PROTOCOL_VERSION}.schema.json",
        "title": f"chatd websocket protocol v{PROTOCOL_VERSION} (GET /ws, JSON text frames)",
        "description": "ClientFrame: what a client sends; ServerFrame: what the server sends. Generated from "
                       "chatd/protocol.py by `python -m chatd.server.frameschema`; docs/protocol.md explains it.",
        "anyOf": [{"$ref": "#/$defs/ClientFrame"}, {"$ref": "#/$defs/ServerFrame"}],
        "$defs": dict(sorted(defs.items())),
    }


def render() -> str:
    """The text of docs/protocol.schema.json. Deterministic: same models, same bytes."""
    return json.dumps(schema(), indent=2, sort_keys=False, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = SCHEMA_FILE.read_text(encoding="utf-8") if SCHEMA_FILE.exists() else ""
        if current != text:
            print(f"{SCHEMA_FILE} is stale: run python -m chatd.server.frameschema", file=sys.stderr)
            return 1
        return 0
    SCHEMA_FILE.write_text(text, encoding="utf-8")
    print(f"wrote {SCHEMA_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
