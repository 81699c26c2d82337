"""Streaming text out of generated ids: incremental detokenisation and stop strings. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDetokenizer:
    """Turns ids into text pieces as they arrive, never splitting a multi-byte character.

    Byte-level BPE can end a token in the middle of a UTF-8 sequence; decoding then yields U+FFFD.
    A piece is only released once the text decoded so far no longer ends in U+FFFD, and it is
    decoded with a little left context so that tokenizers which strip leading spaces behave.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this were already released as text

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def push(self, token_id: int) -> str:
        """Add one id; return the newly complete text (possibly empty)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of generation (may contain U+FFFD for a cut character)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""


class StopMatcher:
    """Holds back text that might be the start of a stop string; reports when one completes."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Return the text that is safe to emit. After a stop string appears, ``stopped`` is True and
        the returned text ends right before it; later calls return nothing."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            return buf[:cut]
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), 0, -1):
                if buf.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """Held-back text when generation ends without a stop string."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
