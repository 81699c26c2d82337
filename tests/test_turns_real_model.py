"""Multi-turn reuse and edit invalidation with the real packaged model, against from-scratch decoding."""

from __future__ import annotations

import pytest
import torch

from chatd.service.core import Chatd
from chatd.service.types import GenerationOptions, TurnResult
from tests.support import reference_greedy

pytestmark = pytest.mark.real_model

GREEDY = GenerationOptions(temperature=0, max_tokens=48)


async def _conversation_ids(core: Chatd, session_id: str) -> list[int]:
    messages = await core.repo.get_messages(session_id)
    return core.sessions.template.conversation_ids(m.token_ids for m in messages)


async def _turn(core: Chatd, session_id: str, text: str) -> TurnResult:
    result = await core.sessions.send(session_id, text, GREEDY).wait()
    assert isinstance(result, TurnResult)
    return result


async def test_kept_cache_replies_equal_fresh_computation(real_core: Chatd,
                                                          real_reference: torch.nn.Module) -> None:
    core = real_core
    template = core.sessions.template
    eos = core.runner.info.eos_token_ids
    session = await core.sessions.create()
    questions = ["What is the capital of France?", "And what is the capital of Italy?",
                 "Name one famous building in each of the two cities."]
    cached_before = 0
    for n, question in enumerate(questions):
        history = await _conversation_ids(core, session.session_id)
        user_ids = template.message_ids("user", question, len(await core.repo.get_messages(session.session_id)))
        prompt = [*history, *user_ids, *template.generation_prompt_ids]
        result = await _turn(core, session.session_id, question)
        usage = result.usage
        assert usage.input_tokens == len(prompt)
        assert usage.cached_tokens + usage.prefill_tokens == usage.input_tokens
        if n == 0:
            assert usage.cached_tokens == 0 and usage.cache_tier == "none"
        else:
            # Everything the previous turn left in the cache is reused; only the new turn is prefilled:
            # the closing of the previous reply, the new user message and the assistant header.
            assert usage.cache_tier == "device"
            assert usage.cached_tokens == cached_before
            footer = template.frame("assistant", 1).footer_ids
            added = len(prompt) - len(history) + len(footer)
            assert usage.prefill_tokens == added
        # The reply equals greedy decoding of the same history from scratch.
        reference = reference_greedy(real_reference, prompt, GREEDY.max_tokens or 0, eos)
        messages = await core.repo.get_messages(session.session_id)
        reply_ids = list(messages[-1].token_ids)
        start, end = template.content_span("assistant", messages[-1].index, reply_ids)
        expected_content = [t for t in reference if t not in eos]
        assert reply_ids[start:end] == expected_content
        assert result.assistant_message.content == core.runner.tokenizer.decode(
            expected_content, skip_special_tokens=True)
        assert usage.output_tokens == len(reference)
        # What the cache holds after the turn: the prompt and every reply id but the last one.
        cached_before = len(prompt) + len(reference) - 1
        assert core.kv.cached_ids(session.session_id) == [*prompt, *reference][:cached_before]


async def test_edit_middle_message_recomputes_only_the_rest(real_core: Chatd,
                                                            real_reference: torch.nn.Module) -> None:
    core = real_core
    template = core.sessions.template
    eos = core.runner.info.eos_token_ids
    session = await core.sessions.create(system="You are a concise geography assistant.")
    for question in ["What is the capital of France?", "And of Italy?", "Which is further north?"]:
        await _turn(core, session.session_id, question)
    before = await core.repo.get_messages(session.session_id)
    old_ids = template.conversation_ids(m.token_ids for m in before)
    edit_index = 3  # system, user, assistant, [user "And of Italy?"], ...
    assert before[edit_index].content == "And of Italy?"

    result = await core.sessions.edit(session.session_id, edit_index, "And of Spain?", GREEDY).wait()
    assert isinstance(result, TurnResult)
    usage = result.usage
    kept = template.conversation_ids(m.token_ids for m in before[:edit_index])
    new_user = template.message_ids("user", "And of Spain?", edit_index)
    prompt = [*kept, *new_user, *template.generation_prompt_ids]
    # The first token that differs: inside the edited message, after its unchanged "And of".
    first_changed = next(i for i, (a, b) in enumerate(zip(old_ids, prompt, strict=False)) if a != b)
    assert first_changed > len(kept)
    assert usage.invalidated_from == first_changed
    assert usage.cached_tokens == first_changed
    assert usage.prefill_tokens == len(prompt) - first_changed
    assert usage.cache_tier == "device"

    after = await core.repo.get_messages(session.session_id)
    assert [m.content for m in after[:edit_index]] == [m.content for m in before[:edit_index]]
    assert after[edit_index].content == "And of Spain?"
    assert len(after) == edit_index + 2  # the later turns were dropped; one new reply
    reference = reference_greedy(real_reference, prompt, GREEDY.max_tokens or 0, eos)
    start, end = template.content_span("assistant", after[-1].index, after[-1].token_ids)
    assert list(after[-1].token_ids[start:end]) == [t for t in reference if t not in eos]
    # The old branch is kept as edit history.
    edits = await core.repo.list_edits(session.session_id)
    assert next(m.content for m in edits[-1].archived) == "And of Italy?"
