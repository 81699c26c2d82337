"""The OpenAI-compatible API end to end: the official `openai` SDK against a real `chatd serve` process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from chatd.client import ChatClient
from tests.support import ServerProcess, tiny_model_dir

API_KEY = "test-api-key"
SYSTEM = "You are a helpful assistant who answers every question in a short and friendly way."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        tmp_path_factory.mktemp("openai"), tiny_model_dir(),
        server={"api_keys": [API_KEY], "max_frame_bytes": 16_384, "max_message_chars": 4000},
        cache={"restore_min_tokens": 0},
    ).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def api(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(api: openai.OpenAI) -> str:
    return api.models.list().data[0].id


def _chat(*turns: str) -> list[dict[str, Any]]:
    """A conversation: the system prompt, then alternating user / assistant texts."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return messages


def _detail(server: ServerProcess, session_id: str) -> dict[str, Any]:
    response = httpx.get(f"{server.http_url}/admin/sessions/{session_id}", headers=server.admin_headers)
    response.raise_for_status()
    return dict(response.json())


def test_models_lists_the_served_model(api: openai.OpenAI, model: str) -> None:
    assert model == "tiny-llama-v1"
    assert api.models.retrieve(model).owned_by == "chatd"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4o")


def test_non_streaming_reply(api: openai.OpenAI, model: str) -> None:
    reply = api.chat.completions.create(model=model, messages=_chat("Hello there"), max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == model
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage is not None and usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    extra = reply.model_extra["chatd"]  # type: ignore[index]
    assert extra["session_id"] is None  # stateless: no session is named, no hidden cache id leaks
    assert extra["cached_tokens"] + extra["prefill_tokens"] == usage.prompt_tokens
    assert extra["cached_tokens"] == usage.prompt_tokens_details.cached_tokens


def test_streaming_reply_with_usage(api: openai.OpenAI, model: str) -> None:
    stream = api.chat.completions.create(model=model, messages=_chat("Tell me a story"), max_tokens=6,  # type: ignore[arg-type]
                                         temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.id for c in chunks} == {chunks[0].id} and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    whole = api.chat.completions.create(model=model, messages=_chat("Tell me a story"), max_tokens=6, temperature=0)  # type: ignore[arg-type]
    assert text == whole.choices[0].message.content


def test_streaming_without_usage_ends_with_done(server: ServerProcess, model: str) -> None:
    body = {"model": model, "messages": _chat("Hi"), "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.http_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and '"usage"' not in "".join(lines[:-1])


def test_resent_conversation_reuses_the_cache(api: openai.OpenAI, model: str) -> None:
    messages = _chat("What is the capital of France?")
    first = api.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    assert first.usage is not None
    for question in ("And of Spain?", "And of Italy?"):
        messages = [*messages, {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": question}]
        nxt = api.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
        assert nxt.usage is not None and nxt.usage.prompt_tokens_details is not None
        assert nxt.usage.prompt_tokens_details.cached_tokens >= 0.9 * first.usage.prompt_tokens
        assert nxt.model_extra["chatd"]["cache_tier"] == "device"  # type: ignore[index]
        first = nxt


def test_a_shared_system_prompt_is_reused_across_callers(api: openai.OpenAI, model: str) -> None:
    api.chat.completions.create(model=model, messages=_chat("First caller here"), max_tokens=2, user="alice")  # type: ignore[arg-type]
    other = api.chat.completions.create(model=model, messages=_chat("Someone else entirely"), max_tokens=2,  # type: ignore[arg-type]
                                        user="bob")
    system_tokens = 10  # the system prompt alone is well over this many tokens
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens > system_tokens
    # Only counts come back: the reply carries no trace of the other caller's text.
    assert "First caller" not in other.model_dump_json()


async def test_greedy_reply_equals_the_websocket_reply(server: ServerProcess, api: openai.OpenAI, model: str) -> None:
    async with await ChatClient.connect(server.ws_url, api_key=API_KEY) as client:
        session = await client.create_session(system="Answer like a pirate.")
        done = await (await client.send(session.session_id, "Where is the treasure?", max_tokens=16,
                                        temperature=0)).result()
    messages = [{"role": "system", "content": "Answer like a pirate."},
                {"role": "user", "content": "Where is the treasure?"}]
    reply = await asyncio.to_thread(api.chat.completions.create, model=model, messages=messages, max_tokens=16,
                                    temperature=0)
    assert reply.choices[0].message.content == done.assistant_message.content  # type: ignore[union-attr]
    assert reply.usage is not None and reply.usage.prompt_tokens == done.usage.input_tokens  # type: ignore[union-attr]


def test_named_session_is_reconciled_like_an_edit(server: ServerProcess, api: openai.OpenAI, model: str) -> None:
    first = api.chat.completions.with_raw_response.create(
        model=model, messages=_chat("Count to three"), max_tokens=6, temperature=0,  # type: ignore[arg-type]
        extra_headers={"X-Chatd-Session": "new"})
    session_id = first.headers["x-chatd-session"]
    reply = first.parse()
    assert reply.model_extra["chatd"]["session_id"] == session_id  # type: ignore[index]
    answer = reply.choices[0].message.content
    head = {"X-Chatd-Session": session_id}
    second = api.chat.completions.create(model=model, messages=_chat("Count to three", answer, "Now to four"),  # type: ignore[arg-type]
                                         max_tokens=6, temperature=0, extra_headers=head)
    extra = second.model_extra["chatd"]  # type: ignore[index]
    # The stored reply keeps its exact generated ids: everything but its last token comes from the cache.
    assert reply.usage is not None
    assert extra["cached_tokens"] == reply.usage.prompt_tokens + reply.usage.completion_tokens - 1
    assert extra["invalidated_from"] is None
    # Changing the first user message cuts the conversation there, like an edit.
    third = api.chat.completions.create(model=model, messages=_chat("Count to five"), max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                        extra_headers=head)
    extra = third.model_extra["chatd"]  # type: ignore[index]
    assert extra["invalidated_from"] is not None and 0 < extra["invalidated_from"] < third.usage.prompt_tokens  # type: ignore[union-attr]
    assert extra["cached_tokens"] == extra["invalidated_from"]
    detail = _detail(server, session_id)
    assert [m["content"] for m in detail["messages"][:2]] == [SYSTEM, "Count to five"]
    assert len(detail["messages"]) == 3
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model=model, messages=_chat("Hi"), extra_headers={"X-Chatd-Session": "A" * 24})  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as bad:
        api.chat.completions.create(model=model, messages=_chat("Hi"), extra_headers={"X-Chatd-Session": "no!"})  # type: ignore[arg-type]
    assert bad.value.param == "X-Chatd-Session"  # type: ignore[attr-defined]


def test_client_disconnect_mid_stream_cancels_the_generation(server: ServerProcess, api: openai.OpenAI,
                                                             model: str) -> None:
    raw = api.chat.completions.with_raw_response.create(
        model=model, messages=_chat("Talk for a long time"), max_tokens=3000, temperature=1.0, seed=3,  # type: ignore[arg-type]
        stream=True, extra_headers={"X-Chatd-Session": "new"})
    session_id = raw.headers["x-chatd-session"]
    stream = raw.parse()
    for num, _chunk in enumerate(stream):
        if num >= 5:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while True:
        messages = _detail(server, session_id)["messages"]
        if len(messages) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert messages[-1]["role"] == "assistant"
    assert messages[-1]["finish_reason"] == "cancelled"
    assert messages[-1]["usage"]["output_tokens"] < 3000


def test_keys(server: ServerProcess, model: str) -> None:
    for key in ("wrong-key", server.admin_token):
        wrong = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.chat.completions.create(model=model, messages=_chat("Hi"))  # type: ignore[arg-type]
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    # ... and the API key does not open the admin API.
    response = httpx.get(f"{server.http_url}/admin/stats", headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 401


BAD_FIELDS = [
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("tool_choice", {"tool_choice": "auto"}),
    ("n", {"n": 2}),
    ("logprobs", {"logprobs": True}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("logit_bias", {"logit_bias": {"42": 10}}),
    ("temperature", {"temperature": 3}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_completion_tokens", {"max_completion_tokens": -5}),
    ("seed", {"seed": 1.5}),
    ("stop", {"stop": ["x"] * 9}),
    ("stream_options", {"stream_options": {"include_usage": True}}),
    ("messages[1].content[0].type",
     {"messages": [{"role": "system", "content": "x"},
                   {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}),
    ("messages[0].role", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}),
    ("messages[0].name", {"messages": [{"role": "user", "content": "x", "name": "bob"}]}),
    ("messages[1].role", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}),
    ("messages", {"messages": []}),
    ("bogus_field", {"bogus_field": 1}),
]


@pytest.mark.parametrize(("param", "fields"), BAD_FIELDS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_FIELDS)])
def test_unsupported_or_malformed_fields_are_named(api: openai.OpenAI, model: str, param: str,
                                                   fields: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        # extra_body: the wire body as a client would send it, also fields the SDK has no argument for.
        api.chat.completions.create(model=model, messages=_chat("Hi"), max_tokens=2, extra_body=fields)  # type: ignore[arg-type]
    assert err.value.status_code == 400
    assert err.value.param == param  # type: ignore[attr-defined]
    assert param.split("[")[0] in err.value.message


def test_neutral_values_of_unsupported_features_are_accepted(api: openai.OpenAI, model: str) -> None:
    reply = api.chat.completions.create(model=model, messages=_chat("Hi"), max_tokens=2, n=1, logprobs=False,  # type: ignore[arg-type]
                                        presence_penalty=0, frequency_penalty=0.0, user="someone")
    assert reply.choices[0].message.content is not None


def test_limits(server: ServerProcess, api: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.APIStatusError) as err:
        api.chat.completions.create(model=model, messages=_chat("x" * 20_000))  # type: ignore[arg-type]
    assert err.value.status_code == 413 and err.value.code == "request_too_large"  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError) as missing:
        api.chat.completions.create(model="gpt-4o", messages=_chat("Hi"))  # type: ignore[arg-type]
    assert missing.value.param == "model" or "gpt-4o" in missing.value.message  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as long:
        api.chat.completions.create(model=model, messages=_chat("Hi"), max_tokens=100_000)  # type: ignore[arg-type]
    assert long.value.code == "context_length_exceeded"  # type: ignore[attr-defined]
    response = httpx.post(f"{server.http_url}/v1/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_named_session_survives_sigkill_and_restores_from_disk(tmp_path: Path) -> None:
    proc = ServerProcess(tmp_path, tiny_model_dir(), cache={"restore_min_tokens": 0, "persist_idle_s": 0.2}).start()
    try:
        api = openai.OpenAI(base_url=f"{proc.http_url}/v1", api_key="unused", max_retries=0, timeout=60)
        model = api.models.list().data[0].id
        raw = api.chat.completions.with_raw_response.create(
            model=model, messages=_chat("Remember the number 42"), max_tokens=8, temperature=0,  # type: ignore[arg-type]
            extra_headers={"X-Chatd-Session": "new"})
        session_id, first = raw.headers["x-chatd-session"], raw.parse()
        deadline = time.monotonic() + 30
        while _detail(proc, session_id)["snapshot_bytes"] == 0:  # written ahead while idle
            assert time.monotonic() < deadline, "no snapshot was written"
            time.sleep(0.2)
        proc.kill()
        proc.start()
        messages = _chat("Remember the number 42", first.choices[0].message.content, "Which number?")
        reply = api.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,  # type: ignore[arg-type]
                                            extra_headers={"X-Chatd-Session": session_id})
        extra = reply.model_extra["chatd"]  # type: ignore[index]
        assert extra["cache_tier"] == "disk" and extra["restore_ms"] is not None
        assert first.usage is not None
        assert extra["cached_tokens"] == first.usage.prompt_tokens + first.usage.completion_tokens - 1
    finally:
        proc.stop()
