"""One log format for chatd and uvicorn: ``[server] log_format = "text" | "json"``.

:func:`setup` installs one handler on the root logger and makes uvicorn's loggers propagate to it (uvicorn
is started with ``log_config=None``), so every line has the same shape. A record may carry structured
fields as ``extra={"fields": {...}}``: the JSON format puts them in the object, the text format shows the
message only (which repeats them for people).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatd.service.types import TurnResult

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_LOGGERS = ("alembic", "httpx", "transformers")
"""Chatty at INFO; they log at WARNING and above only."""
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")

turn_log = logging.getLogger("chatd.turn")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (ISO 8601 UTC), ``level``, ``logger``, ``message``, the record's
    ``fields``, and ``exc`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            body.update({k: v for k, v in fields.items() if k not in body})
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body, ensure_ascii=False, default=str)


def setup(level: str, fmt: str = "text", stream: IO[str] | None = None) -> None:
    """Route every record (chatd's, uvicorn's, libraries') through one handler in format ``fmt``."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))


def log_turn(result: TurnResult) -> None:
    """One line per finished turn: the session (its first 8 characters: a full id is a capability), the
    tier the cache came from, cached and prefilled tokens, and the timings."""
    usage = result.usage
    fields: dict[str, Any] = {
        "event": "turn", "session": result.session_id[:8], "tier": usage.cache_tier,
        "input_tokens": usage.input_tokens, "cached_tokens": usage.cached_tokens,
        "prefill_tokens": usage.prefill_tokens, "output_tokens": usage.output_tokens,
        "finish_reason": result.finish_reason, "ttft_ms": round(usage.ttft_ms, 2),
        "decode_tokens_per_s": round(usage.decode_tokens_per_s, 2),
    }
    extra = ""
    if usage.restore_ms is not None:
        fields["restore_ms"] = round(usage.restore_ms, 2)
        extra += f" restore={usage.restore_ms:.0f}ms"
    if usage.invalidated_from is not None:
        fields["invalidated_from"] = usage.invalidated_from
        extra += f" invalidated_from={usage.invalidated_from}"
    turn_log.info("turn session=%s tier=%s cached=%d prefilled=%d out=%d ttft=%.0fms %.1ftok/s finish=%s%s",
                  fields["session"], usage.cache_tier, usage.cached_tokens, usage.prefill_tokens,
                  usage.output_tokens, usage.ttft_ms, usage.decode_tokens_per_s, result.finish_reason, extra,
                  extra={"fields": fields})
