"""The browser chat UI in a real Chromium (Playwright) against a real ``chatd serve`` with the tiny model.

The tiny model is random-init, so its text is gibberish: these tests assert structure (elements,
data attributes, counts), never wording. At temperature 4 with top-k off it writes words; at low
temperatures it mostly writes newlines, which render as nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Locator, Page, Playwright, expect, sync_playwright

from tests.support import ROOT, ServerProcess, tiny_model_dir

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOTS = ROOT / "test-artifacts" / "screenshots"
TIMEOUT_MS = 20_000

XSS_USER = '<script>window.__pwned=1</script> and <img src=x onerror="window.__pwned=2"> in a user message'
XSS_ASSISTANT = """Here is **bold**, *italic* and `inline <b>code</b>`.

<script>window.__pwned=1</script>
<img src=x onerror="window.__pwned=2">

- a [safe link](https://example.com/docs)
- a [bad link](javascript:window.__pwned=3)
- an ![image](https://example.com/x.png)

```html
<img src=x onerror="window.__pwned=4">
```
"""

REALISTIC_ANSWER = """chatd keeps each conversation's **KV cache** between turns, so a new turn only prefills
the tokens it adds.

1. The prompt's token ids are compared with the cached ids.
2. The longest common prefix is *reused*; the rest is cropped.
3. Only the new suffix goes through `prefill`, then decoding starts.

```python
usage = done.usage
assert usage.cached_tokens + usage.prefill_tokens == usage.input_tokens
```

Idle sessions are evicted to compressed snapshots on disk; see [the design notes](https://example.com/chatd).
"""


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path_factory.mktemp("ui"), tiny_model_dir(),
                            cache={"restore_min_tokens": 0, "persist_idle_s": 0, "idle_evict_s": 0}).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: apt-get install chromium"
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
    yield browser
    browser.close()


@pytest.fixture
def page(browser: Browser, server: ServerProcess) -> Iterator[Page]:
    """A fresh browser profile (empty localStorage) on the chat page, connected, with quick settings."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"uncaught: {exc}"))
    # The browser logs failed websocket handshakes (restart test) and 401 answers (admin test) itself.
    page.on("console", lambda msg: problems.append(f"console: {msg.text}") if msg.type == "error" and not re.search(
        r"WebSocket connection|Failed to load resource", msg.text) else None)
    page.goto(f"{server.http_url}/")
    expect_connected(page)
    configure(page)
    yield page
    context.close()
    assert not problems, problems


# ----------------------------------------------------------------------------- helpers


def expect_connected(page: Page, timeout: float = TIMEOUT_MS) -> None:
    expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "connected", timeout=timeout)


def configure(page: Page) -> None:
    """Short, wordy replies: max 24 tokens at temperature 4 without top-k, seeded."""
    page.get_by_test_id("settings-button").click()
    dialog = page.get_by_test_id("settings-dialog")
    expect(dialog).to_be_visible()
    page.get_by_label("Temperature").fill("4")
    page.get_by_label("Max tokens").fill("24")
    page.get_by_label("Top-k").fill("0")
    page.get_by_label("Seed").fill("7")
    page.get_by_test_id("settings-save").click()
    expect(dialog).to_be_hidden()


def usage_lines(page: Page) -> Locator:
    return page.get_by_test_id("messages").get_by_test_id("usage")


def messages(page: Page, role: str) -> Locator:
    return page.locator(f'[data-testid="message"][data-role="{role}"]:not([data-streaming])')


def watch_stream(page: Page) -> None:
    """Record the text length of the streaming reply at every DOM change (reset on each call)."""
    page.evaluate("""() => {
        window.__streamLengths = [];
        window.__streamObserver?.disconnect();
        const root = document.querySelector('[data-testid="messages"]');
        window.__streamObserver = new MutationObserver(() => {
            const body = root.querySelector('[data-streaming="true"] [data-testid="message-body"]');
            if (body) window.__streamLengths.push(body.textContent.length);
        });
        window.__streamObserver.observe(root, {subtree: true, childList: true, characterData: true});
    }""")


def assert_streamed(page: Page) -> None:
    """The reply was seen growing before it was done: at least one partial, non-empty state."""
    lengths: list[int] = page.evaluate("window.__streamLengths")
    final = len(messages(page, "assistant").last.get_by_test_id("message-body").text_content() or "")
    partial = [n for n in lengths if 0 < n < final]
    assert partial, f"no intermediate state seen: lengths {lengths}, final {final}"
    assert len(set(lengths)) >= 2, lengths


def send(page: Page, text: str) -> Locator:
    """Type `text` and press Enter; wait for the reply's usage line. Returns that usage line."""
    before = usage_lines(page).count()
    box = page.get_by_test_id("input")
    box.fill(text)
    box.press("Enter")
    expect(usage_lines(page)).to_have_count(before + 1)
    return usage_lines(page).last


def session_id(page: Page) -> str:
    value = page.get_by_test_id("session-id").get_attribute("data-session-id")
    assert value
    return value


def int_attr(locator: Locator, name: str) -> int:
    value = locator.get_attribute(name)
    assert value is not None and value.isdigit(), f"{name}={value!r}"
    return int(value)


def shoot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / name), full_page=True)


# ----------------------------------------------------------------------------- tests


def test_reply_streams_and_reports_cache_tiers(page: Page) -> None:
    watch_stream(page)
    first = send(page, "Hello there! What is a KV cache?")
    expect(first).to_have_attribute("data-tier", "none")
    assert int_attr(first, "data-cached") == 0
    assert int_attr(first, "data-prefilled") == int_attr(first, "data-input") > 0
    assert int_attr(first, "data-output") > 0
    expect(first).to_contain_text("first token")
    assert_streamed(page)

    # Shift+Enter is a new line inside the message; Enter sends it.
    watch_stream(page)
    box = page.get_by_test_id("input")
    box.click()
    page.keyboard.type("And a second question")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("over two lines")
    page.keyboard.press("Enter")
    expect(usage_lines(page)).to_have_count(2)
    second = usage_lines(page).last
    expect(second).to_have_attribute("data-tier", "device")
    cached = int_attr(second, "data-cached")
    assert cached > 0
    assert cached + int_attr(second, "data-prefilled") == int_attr(second, "data-input")
    assert_streamed(page)

    users = messages(page, "user")
    expect(users).to_have_count(2)
    assert users.last.get_by_test_id("message-body").text_content() == "And a second question\nover two lines"
    expect(box).to_have_value("")
    # The sidebar lists the session under the server's title rule (the first message).
    item = page.get_by_test_id("session-item")
    expect(item).to_have_count(1)
    expect(item).to_contain_text("Hello there! What is a KV cache?")
    expect(item).to_have_attribute("data-session-id", session_id(page))


def test_edit_first_user_message_replaces_the_rest(page: Page) -> None:
    send(page, "First question about caching")
    send(page, "Second question")
    expect(messages(page, "user")).to_have_count(2)

    first_user = messages(page, "user").first
    first_user.get_by_test_id("edit").click()
    editor = first_user.get_by_test_id("edit-input")
    expect(editor).to_have_value("First question about caching")
    editor.fill("First question, rewritten")
    watch_stream(page)
    first_user.get_by_test_id("edit-save").click()

    expect(usage_lines(page)).to_have_count(1)
    expect(messages(page, "user")).to_have_count(1)
    expect(messages(page, "assistant")).to_have_count(1)
    expect(page.get_by_test_id("messages").get_by_text("Second question")).to_have_count(0)
    expect(messages(page, "user").first.get_by_test_id("message-body")).to_have_text("First question, rewritten")
    usage = usage_lines(page).first
    expect(usage).to_have_attribute("data-invalidated-from", re.compile(r"^\d+$"))
    expect(usage).to_contain_text(re.compile(r"invalidated from token \d+"))
    invalidated = int_attr(usage, "data-invalidated-from")
    # Everything before the first changed token came from the cache.
    assert 0 < int_attr(usage, "data-cached") <= invalidated
    assert_streamed(page)


def test_stop_ends_the_reply_and_keeps_what_was_written(page: Page) -> None:
    page.get_by_test_id("settings-button").click()
    page.get_by_label("Max tokens").fill("3000")  # long enough to still be running when Stop is clicked
    page.get_by_test_id("settings-save").click()
    box = page.get_by_test_id("input")
    box.fill("Tell me a very long story")
    box.press("Enter")
    stop = page.get_by_test_id("stop")
    expect(stop).to_be_visible()
    expect(page.get_by_test_id("send")).to_be_hidden()
    expect(page.locator('[data-streaming="true"] [data-testid="message-body"]')).to_have_text(re.compile(r"\S"))
    stop.click()
    usage = usage_lines(page).last
    expect(usage).to_have_attribute("data-finish-reason", "cancelled")
    expect(usage).to_contain_text("stopped")
    assert 0 < int_attr(usage, "data-output") < 3000
    expect(messages(page, "assistant").last.get_by_test_id("message-body")).to_have_text(re.compile(r"\S"))
    expect(stop).to_be_hidden()
    expect(page.get_by_test_id("send")).to_be_visible()


def test_admin_evict_then_next_turn_restores_from_disk(page: Page, server: ServerProcess) -> None:
    send(page, "Please remember this conversation")
    sid = session_id(page)

    page.get_by_test_id("tab-admin").click()
    expect(page.get_by_test_id("admin-login")).to_be_visible()
    # A wrong token is refused in words.
    page.get_by_test_id("admin-token").fill("not-the-token")
    page.get_by_test_id("admin-unlock").click()
    error = page.get_by_test_id("admin-error")
    expect(error).to_contain_text("401")
    expect(error).to_contain_text("did not accept the admin token")

    page.get_by_test_id("admin-token").fill(server.admin_token)
    page.get_by_test_id("admin-unlock").click()
    expect(error).to_be_hidden()
    row = page.locator(f'[data-testid="admin-row"][data-session-id="{sid}"]')
    expect(row).to_have_attribute("data-tier", "device")
    expect(row).to_contain_text("Please remember this conversation")
    expect(page.get_by_test_id("stat-ratio")).to_contain_text("%")
    expect(page.get_by_test_id("stat-device")).to_contain_text("of")
    # The token is never written into the page.
    assert server.admin_token not in page.content()

    row.locator('[data-action="evict"]').click()
    expect(row).to_have_attribute("data-tier", "disk")
    expect(page.get_by_test_id("admin-status")).to_contain_text("Evicted")
    row.locator('[data-action="restore"]').click()
    expect(row).to_have_attribute("data-tier", "device")
    row.locator('[data-action="evict"]').click()
    expect(row).to_have_attribute("data-tier", "disk")
    expect(page.get_by_test_id("stat-disk")).to_contain_text("1 session evicted")
    shoot(page, "admin.png")

    page.locator("#tab-chat").click()
    usage = send(page, "Are you still there?")
    expect(usage).to_have_attribute("data-tier", "disk")
    expect(usage).to_have_attribute("data-restore-ms", re.compile(r"^\d+(\.\d+)?$"))
    expect(usage.get_by_test_id("restore")).to_contain_text("restored in")
    assert int_attr(usage, "data-cached") > 0

    # Delete takes two clicks; the chat then forgets the session.
    page.get_by_test_id("tab-admin").click()
    expect(row).to_have_attribute("data-tier", "device")
    delete = row.locator('[data-action="delete"]')
    delete.click()
    expect(delete).to_have_text("Confirm delete")
    delete.click()
    expect(row).to_have_count(0)
    assert httpx.get(f"{server.http_url}/admin/sessions/{sid}", headers=server.admin_headers).status_code == 404
    expect(page.get_by_test_id("session-item")).to_have_count(0)


def test_reload_finds_the_session_in_the_sidebar(page: Page) -> None:
    send(page, "A conversation to come back to")
    send(page, "With a second turn")
    sid = session_id(page)

    # The open session is opened again after a reload.
    page.reload()
    expect_connected(page)
    expect(page.get_by_test_id("message")).to_have_count(4)
    expect(page.get_by_test_id("chat-title")).to_have_text("A conversation to come back to")

    page.get_by_test_id("new-chat").click()
    expect(page.get_by_test_id("welcome")).to_be_visible()
    page.reload()
    expect_connected(page)
    expect(page.get_by_test_id("message")).to_have_count(0)
    item = page.locator(f'[data-testid="session-item"][data-session-id="{sid}"]')
    expect(item).to_contain_text("A conversation to come back to")
    item.click()
    expect(item).to_have_attribute("aria-current", "true")
    expect(page.get_by_test_id("message")).to_have_count(4)
    users = messages(page, "user")
    expect(users.first.get_by_test_id("message-body")).to_have_text("A conversation to come back to")
    expect(users.last.get_by_test_id("message-body")).to_have_text("With a second turn")
    expect(messages(page, "assistant")).to_have_count(2)
    # The replies' usage lines come back with the session: turn 2 still shows its device-tier cache hit.
    expect(usage_lines(page)).to_have_count(2)
    expect(usage_lines(page).last).to_have_attribute("data-tier", "device")
    assert int_attr(usage_lines(page).last, "data-cached") > 0


def check_no_markup_ran(page: Page) -> None:
    log = page.get_by_test_id("messages")
    expect(log.locator("img")).to_have_count(0)
    expect(log.locator("script")).to_have_count(0)
    expect(log.locator("b")).to_have_count(0)
    user = messages(page, "user").first.get_by_test_id("message-body")
    expect(user).to_have_text(XSS_USER)
    reply = messages(page, "assistant").first.get_by_test_id("message-body")
    expect(reply).to_contain_text("<script>window.__pwned=1</script>")
    expect(reply).to_contain_text('<img src=x onerror="window.__pwned=2">')
    expect(reply.locator("pre code")).to_have_text('<img src=x onerror="window.__pwned=4">')
    expect(reply.locator("code").first).to_have_text("inline <b>code</b>")
    expect(reply.locator("strong")).to_have_text("bold")
    expect(reply.locator("em")).to_have_text("italic")
    expect(reply.locator("li")).to_have_count(3)
    links = reply.locator("a")
    expect(links).to_have_count(2)  # the https link, and the image's https URL shown as a link
    expect(links.first).to_have_attribute("href", "https://example.com/docs")
    expect(links.first).to_have_attribute("rel", re.compile(r"\bnoopener\b"))
    expect(reply.locator('a[href^="javascript"]')).to_have_count(0)
    expect(reply).to_contain_text("bad link")
    assert page.evaluate("window.__pwned") is None


def test_markup_in_messages_is_shown_as_text(page: Page) -> None:
    send(page, XSS_USER)
    reply = messages(page, "assistant").first
    reply.get_by_test_id("edit").click()
    reply.get_by_test_id("edit-input").fill(XSS_ASSISTANT)
    reply.get_by_test_id("edit-save").click()
    note = page.get_by_test_id("edit-note")
    expect(note).to_have_count(1)
    expect(note).to_have_attribute("data-invalidated-from", re.compile(r"^\d+$"))
    check_no_markup_ran(page)

    # Both messages come back from the server (session.resumed) and still render as text.
    page.reload()
    expect_connected(page)
    expect(page.get_by_test_id("message")).to_have_count(2)
    check_no_markup_ran(page)


def test_errors_are_shown_in_words(page: Page, server: ServerProcess) -> None:
    open_id = page.get_by_test_id("open-id")
    open_id.fill("no-such-session-0123456789abcdef")
    open_id.press("Enter")
    alert = page.locator('[data-testid="error"][data-code="not_found"]')
    expect(alert).to_contain_text("Not found")
    expect(alert).to_contain_text("no such session")
    expect(page.get_by_test_id("open-error")).to_contain_text("not_found")
    expect(page.get_by_test_id("send")).to_be_disabled()
    expect(page.get_by_test_id("session-item")).to_have_count(0)
    alert.get_by_role("button", name="Dismiss").click()
    expect(alert).to_have_count(0)

    # A session deleted by an operator while it is open: the next message fails in words.
    page.get_by_test_id("new-chat").click()
    send(page, "This session will be deleted")
    sid = session_id(page)
    assert httpx.delete(f"{server.http_url}/admin/sessions/{sid}", headers=server.admin_headers).status_code == 204
    box = page.get_by_test_id("input")
    box.fill("Anyone there?")
    box.press("Enter")
    expect(alert).to_have_count(1)
    expect(alert).to_contain_text("no such session")
    expect(box).to_have_value("Anyone there?")  # not stored, so it is given back
    expect(page.get_by_test_id("open-error")).to_contain_text("not_found")


def test_reconnects_after_server_restart(page: Page, server: ServerProcess) -> None:
    send(page, "Before the restart")
    sid = session_id(page)
    connection = page.get_by_test_id("connection")

    server.stop()
    expect(connection).to_have_attribute("data-state", re.compile("reconnecting|offline"))
    expect(connection).to_contain_text(re.compile("Reconnecting|Offline"))
    expect(page.get_by_test_id("send")).to_be_disabled()
    server.start()
    expect_connected(page, timeout=60_000)
    expect(connection).to_have_text("Connected")

    # The session was resumed on the new connection and works as before.
    expect(page.get_by_test_id("message")).to_have_count(2)
    assert session_id(page) == sid
    usage = send(page, "After the restart")
    assert int_attr(usage, "data-output") > 0
    expect(messages(page, "user")).to_have_count(2)
    expect(messages(page, "user").last.get_by_test_id("message-body")).to_have_text("After the restart")


def test_system_prompt_and_screenshots(page: Page) -> None:
    """A realistic conversation for the screenshots (light, dark, narrow); the first reply is edited into a
    readable answer, since the tiny model writes gibberish."""
    page.get_by_test_id("welcome").get_by_text("System prompt (optional)").click()
    page.get_by_test_id("system-prompt").fill("You are chatd's helpful and concise assistant.")
    send(page, "How does chatd reuse the KV cache between turns?")
    system = page.locator('[data-testid="message"][data-role="system"]')
    expect(system).to_have_attribute("data-index", "0")
    expect(messages(page, "user").first).to_have_attribute("data-index", "1")

    reply = messages(page, "assistant").first
    reply.get_by_test_id("edit").click()
    reply.get_by_test_id("edit-input").fill(REALISTIC_ANSWER)
    reply.get_by_test_id("edit-save").click()
    expect(page.get_by_test_id("edit-note")).to_have_count(1)
    usage = send(page, "And when I edit an earlier message?")
    expect(usage).to_have_attribute("data-tier", "device")
    expect(reply.locator("ol li")).to_have_count(3)

    messages(page, "user").last.hover()
    shoot(page, "chat.png")
    page.emulate_media(color_scheme="dark")
    page.wait_for_timeout(300)  # let colour transitions finish
    shoot(page, "chat-dark.png")
    page.emulate_media(color_scheme="light")
    page.set_viewport_size({"width": 390, "height": 800})
    page.wait_for_timeout(300)  # the sidebar slides away
    shoot(page, "chat-narrow.png")


def test_api_docs_render_with_no_request_leaving_the_server(browser: Browser, server: ServerProcess) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    context.set_default_timeout(TIMEOUT_MS)
    outside: list[str] = []

    def only_this_server(route) -> None:  # type: ignore[no-untyped-def]
        if route.request.url.startswith(server.http_url):
            route.continue_()
        else:  # a CDN asset would land here: offline, the page must not need it
            outside.append(route.request.url)
            route.abort()

    context.route("**/*", only_this_server)
    page = context.new_page()
    page.goto(f"{server.http_url}/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("chatd")
    expect(page.locator(".opblock-tag-section", has_text="admin")).to_have_count(1)
    page.get_by_role("button", name="Authorize").first.click()
    expect(page.get_by_text("adminToken")).to_be_visible()  # the bearer scheme the admin routes declare
    context.close()
    assert outside == [], outside
