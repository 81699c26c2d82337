"""docs/protocol.schema.json is generated from chatd/protocol.py, and every frame example in docs/protocol.md
is valid against it."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from chatd.domain import new_session_id
from chatd.protocol import ClientFrame, ServerFrame, parse_server_frame
from chatd.server import frameschema
from tests.support import ROOT

DOC = ROOT / "docs" / "protocol.md"
SESSION_ID = new_session_id()
TIME = "2026-12-02T18:48:38.811900Z"


def _validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(frameschema.SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _concrete(value: Any) -> Any:
    """An example with its placeholders filled in: session ids shortened to "S", elided "..." fields."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "...":
                continue
            if key == "session_id" and item == "S":
                item = SESSION_ID
            elif key in ("created_at", "updated_at") and item == "...":
                item = TIME
            out[key] = _concrete(item)
        return out
    if isinstance(value, list):
        return [_concrete(v) for v in value]
    return value


def _doc_frames() -> list[tuple[dict[str, Any], bool]]:
    frames = []
    decoder = json.JSONDecoder()
    for block in re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.DOTALL):
        position = 0
        while True:
            while position < len(block) and block[position].isspace():
                position += 1
            if position >= len(block):
                break
            value, position = decoder.raw_decode(block, position)
            if isinstance(value, dict) and "type" in value:
                frames.append((_concrete(value), _elided(value)))
    return frames


def _without_required(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _without_required(v) for k, v in schema.items() if k != "required"}
    if isinstance(schema, list):
        return [_without_required(v) for v in schema]
    return schema


def _elided(value: Any) -> bool:
    if isinstance(value, dict):
        return "..." in value or any(_elided(v) for v in value.values())
    return isinstance(value, list) and any(_elided(v) for v in value)


def _errors(validator: jsonschema.Draft202012Validator, frame: dict[str, Any], elided: bool) -> list[str]:
    """What is wrong with ``frame``. An example with "...": "..." shows some fields only: the fields shown must
    be valid (types, values, no unknown fields), the missing ones are not asked for."""
    if elided:
        validator = jsonschema.Draft202012Validator(_without_required(validator.schema))
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(frame)]


def test_the_committed_schema_is_generated_from_the_models() -> None:
    assert frameschema.SCHEMA_FILE.read_text() == frameschema.render(), \
        "run python -m chatd.server.frameschema"


def test_every_frame_example_in_the_protocol_doc_is_valid() -> None:
    validator = _validator()
    frames = _doc_frames()
    assert len(frames) >= 15
    for frame, elided in frames:
        errors = _errors(validator, frame, elided)
        assert not errors, (frame, errors)
    # Every frame type of both directions has an example.
    documented = {frame["type"] for frame, _ in frames}
    schema = json.loads(frameschema.SCHEMA_FILE.read_text())
    for union in ("ClientFrame", "ServerFrame"):
        assert set(schema["$defs"][union]["discriminator"]["mapping"]) <= documented, union


def test_the_schema_refuses_what_the_server_refuses() -> None:
    validator = _validator()
    good = {"type": "message.send", "id": "1", "session_id": SESSION_ID, "content": "Hi"}
    assert validator.is_valid(good)
    for bad in ({**good, "type": "message.sned"}, {**good, "extra": 1}, {**good, "session_id": "S"},
                {k: v for k, v in good.items() if k != "content"},
                {**good, "params": {"temperature": 9}}):
        assert not validator.is_valid(bad), bad


def test_frames_the_server_sends_are_valid() -> None:
    validator = _validator()
    hello = parse_server_frame(json.dumps({"type": "hello", "protocol_version": 1, "model": "m",
                                           "server_version": "0.1.0", "max_context": 8192}))
    assert validator.is_valid(json.loads(hello.model_dump_json(exclude_none=True)))
    assert ClientFrame is not None and ServerFrame is not None
