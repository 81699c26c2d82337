"""Render conversations to token ids one message at a time.

A conversation's ids are the concatenation of its messages' ids, and each message's ids are fixed
once computed: ``frame.header + content ids + frame.footer``. Replies keep the exact ids the model
generated (never re-tokenised from text), so the cached prefix of a conversation stays valid turn
after turn and a new turn only adds the ids of what is new.

The per-role header and footer texts are read off the model's own chat template by rendering a
sentinel content and splitting around it, so any prefix-stable template works (ChatML, Llama-3,
...). A template that inserts a default system prompt when the conversation has none does so
through the "first message" frame.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from chatd.domain import ROLES
from chatd.errors import ConfigError

_SENTINEL = "CHATDSENTINEL7f3a"


@dataclass(frozen=True)
class Frame:
    header_ids: tuple[int, ...]
    footer_ids: tuple[int, ...]


@dataclass(frozen=True)
class RenderedMessage:
    role: str
    content: str
    token_ids: tuple[int, ...]


class ChatTemplate:
    """Turns (role, content) into token ids with the tokenizer's chat template. Pure CPU work."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._first: dict[str, Frame] = {}
        self._later: dict[str, Frame] = {}
        anchor = [{"role": "system", "content": "x"}]
        anchor_text = self._render(anchor)
        for role in ROLES:
            self._first[role] = self._frame(self._render([{"role": role, "content": _SENTINEL}]))
            later = self._render([*anchor, {"role": role, "content": _SENTINEL}])
            if not later.startswith(anchor_text):
                raise ConfigError("the model's chat template is not prefix-stable: cannot render it incrementally")
            self._later[role] = self._frame(later[len(anchor_text):])
        prompt = self._render(anchor, generation_prompt=True)
        if not prompt.startswith(anchor_text):
            raise ConfigError("the model's chat template generation prompt is not an append")
        self.generation_prompt_ids: tuple[int, ...] = tuple(self._encode_special(prompt[len(anchor_text):]))

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert isinstance(text, str)
        return text

    def _frame(self, text: str) -> Frame:
        head, sep, tail = text.partition(_SENTINEL)
        if not sep:
            raise ConfigError("the model's chat template drops message content")
        return Frame(tuple(self._encode_special(head)), tuple(self._encode_special(tail)))

    def _encode_special(self, text: str) -> list[int]:
        # Template text: its special tokens (<|im_start|> ...) must become control ids.
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    def encode_content(self, text: str) -> list[int]:
        """Ids of message content. Special-token text typed by a user stays plain text, so nobody can
        forge a turn boundary."""
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids)

    def frame(self, role: str, index: int) -> Frame:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        return (self._first if index == 0 else self._later)[role]

    def message_ids(self, role: str, content: str, index: int) -> tuple[int, ...]:
        """Ids of a whole message at position ``index`` of the conversation."""
        if role == "assistant":
            return self.assistant_ids(self.encode_content(content), index)
        frame = self.frame(role, index)
        return (*frame.header_ids, *self.encode_content(content), *frame.footer_ids)

    def assistant_ids(self, content_ids: Sequence[int], index: int) -> tuple[int, ...]:
        """Ids of an assistant message whose content ids are given (a generated reply).

        The header is the generation prompt, the exact ids the reply was generated after."""
        header = self.generation_prompt_ids if index > 0 else self.frame("assistant", 0).header_ids
        return (*header, *content_ids, *self.frame("assistant", index).footer_ids)

    def content_span(self, role: str, index: int, message_ids: Sequence[int]) -> tuple[int, int]:
        """(start, end) of the content within ``message_ids`` of a message at ``index``."""
        if role == "assistant" and index > 0:
            start = len(self.generation_prompt_ids)
        else:
            start = len(self.frame(role, index).header_ids)
        return start, len(message_ids) - len(self.frame(role, index).footer_ids)

    @staticmethod
    def conversation_ids(messages: Iterable[Sequence[int]]) -> list[int]:
        ids: list[int] = []
        for message in messages:
            ids.extend(message)
        return ids

    def prompt_ids(self, messages: Iterable[Sequence[int]]) -> list[int]:
        """Ids to prefill before generating the next assistant reply."""
        return [*self.conversation_ids(messages), *self.generation_prompt_ids]
