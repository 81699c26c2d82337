// The chat page: wires the connection, the sidebar of sessions, the
// conversation view, the composer, settings, error alerts and the two views
// (chat and admin, switched by the URL hash so the connection and the open
// conversation survive a look at the admin view).

import { mountAdmin } from "./admin.js";
import { ChatError, CLIENT_ERROR, Connection, defaultUrl } from "./connection.js";
import { $, h, replaceChildren } from "./dom.js";
import { formatRelative, titleFrom } from "./format.js";
import { renderMessage, streamingMessage } from "./messages.js";
import {
  currentSession,
  forgetSession,
  getSession,
  listSessions,
  loadSettings,
  paramsFrom,
  saveSession,
  saveSettings,
  setCurrentSession,
} from "./store.js";
import { ERROR, ERROR_CODES } from "./wire.js";

const ERROR_TITLES = {
  [ERROR.BAD_REQUEST]: "Bad request",
  [ERROR.UNKNOWN_TYPE]: "Not understood",
  [ERROR.TOO_LARGE]: "Too large",
  [ERROR.NOT_FOUND]: "Not found",
  [ERROR.BUSY]: "Busy",
  [ERROR.CONTEXT_LENGTH_EXCEEDED]: "Conversation too long",
  [ERROR.UNAUTHORIZED]: "Not authorized",
  [ERROR.RATE_LIMITED]: "Slow down",
  [ERROR.UNAVAILABLE]: "Unavailable",
  [ERROR.REPLY_NOT_SAVED]: "Reply not saved",
  [ERROR.INTERNAL]: "Server error",
  [CLIENT_ERROR.CONNECTION_LOST]: "Connection lost",
  [CLIENT_ERROR.OFFLINE]: "Offline",
  [CLIENT_ERROR.TIMEOUT]: "No answer",
  [CLIENT_ERROR.PROTOCOL]: "Protocol error",
};
// A code the server gained without a title here would show as a bare "Error": say so where tests look.
for (const code of [...ERROR_CODES, ...Object.values(CLIENT_ERROR)]) {
  if (!(code in ERROR_TITLES)) console.error(`no title for error code ${code}`);
}

// Codes that mean the server did not keep a sent message: put its text back in the composer.
const NOT_STORED = new Set([ERROR.BUSY, ERROR.BAD_REQUEST, ERROR.TOO_LARGE, ERROR.CONTEXT_LENGTH_EXCEEDED,
  ERROR.RATE_LIMITED, ERROR.NOT_FOUND, CLIENT_ERROR.OFFLINE]);

const CONNECTION_TEXT = {
  connecting: "Connecting…",
  connected: "Connected",
  reconnecting: "Reconnecting…",
  offline: "Offline",
};

let settings = loadSettings();
const conn = new Connection(defaultUrl(), () => settings.api_key);

const state = {
  sessionId: null, // the open session; null while a new chat is not created yet
  info: null, // its SessionInfo
  messages: [], // its messages, ordered by index
  loading: false, // waiting for session.resumed
  openError: null, // why it could not be opened
  editing: null, // index of the message being edited
  turns: new Map(), // session id -> the reply running in it: {text, view, expectsReply}
  // Usage of replies and results of edits made in this page, by `${session}:${index}` (session.resumed
  // carries usage, but not edit results). `content` guards against showing them for a message that
  // changed since.
  meta: new Map(),
  notes: new Map(),
};
let openRequest = 0;

const el = {
  sidebar: $("#sidebar"),
  scrim: $("#scrim"),
  toggleSidebar: $("#toggle-sidebar"),
  sessionList: $("#session-list"),
  sessionsEmpty: $("#sessions-empty"),
  newChat: $("#new-chat"),
  openForm: $("#open-form"),
  openId: $("#open-id"),
  model: $("#model-name"),
  connection: $("#connection"),
  connectionText: $("#connection-text"),
  alerts: $("#alerts"),
  title: $("#chat-title"),
  sessionIdButton: $("#session-id"),
  messages: $("#messages"),
  composer: $("#composer"),
  input: $("#input"),
  send: $("#send"),
  stop: $("#stop"),
  hint: $("#composer-hint"),
  chatView: $("#chat-view"),
  adminView: $("#admin-view"),
  settingsButton: $("#settings-button"),
  settingsDialog: $("#settings-dialog"),
  settingsForm: $("#settings-form"),
};

const key = (sessionId, index) => `${sessionId}:${index}`;
const shortId = (id) => (id.length > 12 ? `${id.slice(0, 8)}…` : id);

// ----------------------------------------------------------------------------- alerts

/** Show an error in words: a title for its code, the server's message, and the code itself. */
function showError(err, context = "") {
  const code = err instanceof ChatError ? err.code : ERROR.INTERNAL;
  const message = err instanceof ChatError ? err.message : String(err?.message ?? err);
  const text = context ? `${context}: ${message}` : message;
  // The same problem twice in a row is shown once.
  const last = el.alerts.lastElementChild;
  if (last && last.dataset.code === code && last.dataset.text === text) return;
  const alert = h("div", { class: "alert", role: "alert", "data-testid": "error", dataset: { code, text } },
    h("strong", { class: "alert-title" }, ERROR_TITLES[code] ?? "Error"),
    h("span", { class: "alert-text" }, text),
    h("code", { class: "alert-code" }, code),
    h("button", {
      type: "button",
      class: "ghost small",
      "aria-label": "Dismiss",
      onclick: () => alert.remove(),
    }, "✕"));
  el.alerts.append(alert);
  while (el.alerts.children.length > 4) el.alerts.firstElementChild.remove();
}

function clearAlerts(codes) {
  for (const alert of [...el.alerts.children]) {
    if (codes.includes(alert.dataset.code)) alert.remove();
  }
}

// ----------------------------------------------------------------------------- connection

conn.addEventListener("state", (event) => {
  const { state: connState, retryInMs } = event.detail;
  el.connection.dataset.state = connState;
  let text = CONNECTION_TEXT[connState] ?? connState;
  if (connState === "offline" && conn.stopped) text = "Offline: not authorized";
  else if (retryInMs && connState !== "connected") text += ` retrying in ${Math.max(1, Math.round(retryInMs / 1000))} s`;
  el.connectionText.textContent = text;
  el.connection.title = text;
  updateComposer();
  renderChat();
});

conn.addEventListener("hello", (event) => {
  const { hello, reconnected } = event.detail;
  el.model.textContent = hello.model;
  el.model.title = `Model ${hello.model}, context ${hello.max_context} tokens, server ${hello.server_version}`;
  clearAlerts([CLIENT_ERROR.CONNECTION_LOST, CLIENT_ERROR.OFFLINE]);
  // Resuming also makes the server start restoring the session's cache before the next message.
  if (state.sessionId) openSession(state.sessionId, { keepView: reconnected });
});

conn.addEventListener("error", (event) => {
  showError(new ChatError(event.detail.code, event.detail.message));
});

// ----------------------------------------------------------------------------- sessions

async function openSession(id, { keepView = false } = {}) {
  id = id.trim();
  if (!id) return;
  if (state.sessionId !== id) {
    state.sessionId = id;
    state.info = null;
    state.messages = [];
    keepView = false;
  }
  if (!keepView) state.editing = null;
  state.openError = null;
  state.loading = !keepView || state.messages.length === 0;
  renderAll();
  if (!conn.connected) return; // the hello handler opens it once connected
  const request = ++openRequest;
  try {
    const answer = await conn.request({ type: "session.resume", session_id: id });
    if (request !== openRequest || state.sessionId !== id) return; // another session was opened meanwhile
    const edited = state.messages.find((m) => m.index === state.editing);
    state.info = answer.session;
    state.messages = answer.messages;
    state.loading = false;
    // An edit in progress survives a reconnect only if its message is still the same.
    const now = state.messages.find((m) => m.index === state.editing);
    if (!edited || !now || now.content !== edited.content || now.role !== edited.role) state.editing = null;
    saveSession(id, { title: answer.session.title, updatedAt: Date.parse(answer.session.updated_at) || Date.now() });
    setCurrentSession(id);
  } catch (err) {
    if (request !== openRequest || state.sessionId !== id) return;
    if (err.code === CLIENT_ERROR.CONNECTION_LOST) return; // opened again on reconnect
    state.loading = false;
    state.openError = err;
    showError(err, `Could not open session ${shortId(id)}`);
    if (currentSession() === id) setCurrentSession(null);
  }
  renderAll();
  scrollToEnd(true);
}

function newChat({ switchView = true } = {}) {
  state.sessionId = null;
  state.info = null;
  state.messages = [];
  state.loading = false;
  state.openError = null;
  state.editing = null;
  setCurrentSession(null);
  renderAll();
  if (!switchView) return;
  showView("chat");
  closeSidebar();
  el.input.focus();
}

// ----------------------------------------------------------------------------- turns

async function send() {
  const content = el.input.value;
  if (!content.trim() || !canSend()) return;
  let sessionId = state.sessionId;
  el.input.value = "";
  autosize();
  try {
    if (!sessionId) sessionId = await createSession();
  } catch (err) {
    el.input.value = content;
    autosize();
    showError(err, "Could not start the conversation");
    return;
  }
  const index = state.messages.length;
  state.messages.push({ index, role: "user", content, created_at: new Date().toISOString(), pending: true });
  const ok = await runTurn(sessionId, {
    type: "message.send",
    session_id: sessionId,
    content,
    params: paramsFrom(settings),
  }, true);
  if (!ok.stored && !el.input.value) {
    el.input.value = content;
    autosize();
  }
}

async function createSession() {
  const systemInput = $("#system-prompt");
  const system = systemInput?.value.trim() ?? "";
  const answer = await conn.request({ type: "session.create", ...(system ? { system } : {}) });
  const info = answer.session;
  state.sessionId = info.session_id;
  state.info = info;
  state.messages = system ? [{ index: 0, role: "system", content: system, created_at: info.created_at }] : [];
  if (systemInput) systemInput.value = "";
  saveSession(info.session_id, { title: info.title, updatedAt: Date.now() });
  setCurrentSession(info.session_id);
  return info.session_id;
}

/**
 * Run message.send or message.edit in `sessionId`, streaming the reply into the view when that
 * session is open. Resolves {stored}: false when the server answered with an error meaning the
 * message was not kept.
 */
async function runTurn(sessionId, frame, expectsReply) {
  const turn = { text: "", view: null, expectsReply };
  let handle;
  try {
    handle = conn.stream(frame, (answer) => {
      if (answer.type !== "token") return;
      turn.text += answer.text;
      if (turn.view) {
        const follow = nearBottom();
        turn.view.update(turn.text);
        if (follow) scrollToEnd(true);
      }
    });
  } catch (err) {
    showError(err);
    resync(sessionId);
    return { stored: false };
  }
  state.turns.set(sessionId, turn);
  renderAll();
  scrollToEnd(true);
  let stored = true;
  try {
    finishTurn(sessionId, frame, await handle.done);
  } catch (err) {
    stored = !NOT_STORED.has(err.code);
    if (err.code === CLIENT_ERROR.CONNECTION_LOST) {
      showError(err, "The reply was cut off; what arrived is saved on the server and shown after reconnecting");
    } else if (err.code === ERROR.NOT_FOUND && sessionId === state.sessionId) {
      // The session is gone (deleted by an operator): say so once, there is nothing to resync.
      state.openError = err;
      showError(err, "This conversation no longer exists on the server");
    } else {
      showError(err);
    }
  } finally {
    state.turns.delete(sessionId);
  }
  const gone = sessionId === state.sessionId && state.openError !== null;
  if (!gone && (!stored || !state.messages.every((m) => !m.pending))) resync(sessionId);
  renderAll();
  return { stored };
}

function finishTurn(sessionId, frame, answer) {
  const open = sessionId === state.sessionId;
  if (answer.type === "message.done") {
    const { user_message: user, assistant_message: reply } = answer;
    state.meta.set(key(sessionId, reply.index),
      { usage: answer.usage, finishReason: answer.finish_reason, content: reply.content });
    if (open) state.messages = [...state.messages.filter((m) => m.index < user.index), user, reply];
    const stored = getSession(sessionId);
    // The server titles a session after its first message; mirror that without asking.
    const title = stored?.title || (frame.type === "message.send" ? titleFrom(user.content) : "");
    saveSession(sessionId, { title, updatedAt: Date.now() });
    if (open && state.info && !state.info.title) state.info = { ...state.info, title };
  } else if (answer.type === "message.edited") {
    const message = answer.message;
    state.notes.set(key(sessionId, message.index), { invalidatedFrom: answer.invalidated_from, content: message.content });
    if (open) state.messages = [...state.messages.filter((m) => m.index < message.index), message];
    saveSession(sessionId, { updatedAt: Date.now() });
  }
}

/** Ask the server for the truth after a failed turn (what was stored, what was not). */
function resync(sessionId) {
  if (sessionId === state.sessionId && conn.connected) openSession(sessionId, { keepView: true });
}

async function stop() {
  const sessionId = state.sessionId;
  if (!sessionId || !state.turns.has(sessionId)) return;
  try {
    await conn.request({ type: "generation.cancel", session_id: sessionId });
  } catch (err) {
    showError(err, "Could not stop the reply");
  }
}

function startEdit(message) {
  state.editing = message.index;
  renderChat();
  const textarea = el.messages.querySelector(`[data-index="${message.index}"] textarea`);
  if (textarea) {
    textarea.focus();
    textarea.setSelectionRange(textarea.value.length, textarea.value.length);
  }
}

function cancelEdit() {
  const index = state.editing;
  state.editing = null;
  renderChat();
  el.messages.querySelector(`[data-index="${index}"] [data-testid="edit"]`)?.focus();
}

function saveEdit(message, content) {
  if (content === message.content) {
    cancelEdit();
    return;
  }
  if (!conn.connected) {
    showError(new ChatError(CLIENT_ERROR.OFFLINE, "not connected to the server; the edit was not sent"));
    return;
  }
  const sessionId = state.sessionId;
  state.editing = null;
  // Everything after the edited message is replaced, so results shown for it are void.
  for (const map of [state.meta, state.notes]) {
    for (const k of [...map.keys()]) {
      const [sid, index] = [k.slice(0, k.lastIndexOf(":")), Number(k.slice(k.lastIndexOf(":") + 1))];
      if (sid === sessionId && index >= message.index) map.delete(k);
    }
  }
  state.messages = [...state.messages.filter((m) => m.index < message.index), { ...message, content, pending: true }];
  runTurn(sessionId, {
    type: "message.edit",
    session_id: sessionId,
    index: message.index,
    content,
    params: paramsFrom(settings),
  }, message.role === "user");
}

async function copyMessage(message, button) {
  try {
    await navigator.clipboard.writeText(message.content);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
}

// ----------------------------------------------------------------------------- rendering

function canSend() {
  return conn.connected && !state.loading && !state.openError && !state.turns.has(state.sessionId);
}

function updateComposer() {
  const running = state.sessionId !== null && state.turns.has(state.sessionId);
  el.send.hidden = running;
  el.stop.hidden = !running;
  el.send.disabled = !canSend();
  let hint = "Enter sends · Shift+Enter adds a line";
  if (!conn.connected) hint = "Not connected. What you type is kept; send once the connection is back.";
  else if (state.openError) hint = "This conversation could not be opened. Start a new chat or open another one.";
  else if (state.loading) hint = "Opening the conversation…";
  else if (running) hint = "Writing a reply… Stop ends it and keeps what was written.";
  el.hint.textContent = hint;
}

function welcomePanel() {
  // Built once so a half-written system prompt survives re-renders.
  welcomePanel.node ??= h("div", { class: "welcome", "data-testid": "welcome" },
    h("h2", {}, "Start a conversation"),
    h("p", { class: "muted" },
      "Each conversation keeps its KV cache on the server between turns: the line under every reply says how " +
      "many prompt tokens came from the cache, from which tier, and how many had to be computed."),
    h("details", { class: "system-details" },
      h("summary", {}, "System prompt (optional)"),
      h("label", { for: "system-prompt", class: "visually-hidden" }, "System prompt"),
      h("textarea", {
        id: "system-prompt",
        rows: 3,
        "data-testid": "system-prompt",
        placeholder: "e.g. You are a concise assistant.",
      })));
  return welcomePanel.node;
}

function renderChat() {
  const follow = nearBottom();
  const draft = state.editing === null ? null : el.messages.querySelector('[data-testid="edit-input"]');
  const title = state.sessionId ? (state.info?.title || getSession(state.sessionId)?.title || "Untitled conversation")
    : "New conversation";
  el.title.textContent = title;
  document.title = state.sessionId ? `${title} · chatd` : "chatd";
  el.sessionIdButton.hidden = !state.sessionId;
  if (state.sessionId) {
    el.sessionIdButton.textContent = `id ${shortId(state.sessionId)}`;
    el.sessionIdButton.dataset.sessionId = state.sessionId;
  }

  const nodes = [];
  if (!state.sessionId) nodes.push(welcomePanel());
  if (state.loading) {
    nodes.push(h("p", { class: "placeholder muted", "data-testid": "loading" },
      conn.connected ? "Opening the conversation…" : "Waiting for the connection to open the conversation…"));
  }
  if (state.openError) {
    nodes.push(h("div", { class: "placeholder error-panel", "data-testid": "open-error", dataset: { code: state.openError.code } },
      h("strong", {}, ERROR_TITLES[state.openError.code] ?? "Error"),
      ` This conversation could not be opened: ${state.openError.message} (${state.openError.code}).`));
  }
  const running = state.turns.get(state.sessionId);
  const canEdit = conn.connected && !running && !state.loading;
  for (const message of state.messages) {
    const id = key(state.sessionId, message.index);
    const meta = state.meta.get(id);
    const note = state.notes.get(id);
    // Replies from earlier visits carry their usage in session.resumed.
    const stored = message.usage
      ? { usage: message.usage, finishReason: message.finish_reason, content: message.content } : null;
    nodes.push(renderMessage(message, {
      meta: meta && meta.content === message.content ? meta : stored,
      note: note && note.content === message.content ? note : null,
      editing: state.editing === message.index,
      canEdit,
      onEdit: startEdit,
      onSave: saveEdit,
      onCancel: cancelEdit,
      onCopy: copyMessage,
    }));
  }
  if (running?.expectsReply) {
    running.view = streamingMessage(state.messages.length);
    running.view.update(running.text);
    nodes.push(running.view);
  }
  if (state.sessionId && !state.loading && !state.openError && state.messages.length === 0 && !running) {
    nodes.push(h("p", { class: "placeholder muted" }, "No messages yet. Say hello."));
  }
  replaceChildren(el.messages, nodes);
  if (draft) {
    // Re-rendering (say, on a connection change) must not lose a half-written edit.
    const editor = el.messages.querySelector('[data-testid="edit-input"]');
    if (editor) editor.value = draft.value;
    if (document.activeElement === document.body) editor?.focus();
  }
  if (follow) scrollToEnd(true);
  updateComposer();
}

function renderSidebar() {
  // Re-rendering replaces the buttons: put keyboard focus back where it was.
  const focused = el.sessionList.contains(document.activeElement) ? document.activeElement : null;
  const focusKey = focused && [focused.closest("[data-session-id]")?.dataset.sessionId, focused.className];
  const sessions = listSessions();
  el.sessionsEmpty.hidden = sessions.length > 0;
  replaceChildren(el.sessionList, sessions.map((s) => {
    const title = s.title || "Untitled conversation";
    const live = state.turns.has(s.id);
    return h("li", { class: "session-row" },
      h("button", {
        type: "button",
        class: "session-item",
        "data-testid": "session-item",
        "aria-current": s.id === state.sessionId ? "true" : null,
        dataset: { sessionId: s.id },
        title,
        onclick: () => {
          showView("chat");
          openSession(s.id);
          closeSidebar();
        },
      },
      h("span", { class: "session-title" }, title),
      h("span", { class: "session-time muted", dataset: { updated: live ? null : s.updatedAt } },
        live ? "writing…" : formatRelative(s.updatedAt))),
      h("button", {
        type: "button",
        class: "ghost small forget",
        "aria-label": `Remove “${title}” from this browser`,
        dataset: { sessionId: s.id },
        title: "Remove from this browser (the session stays on the server)",
        onclick: () => {
          forgetSession(s.id);
          if (state.sessionId === s.id) newChat();
          renderSidebar();
        },
      }, "✕"));
  }));
  if (focusKey) {
    const [id, className] = focusKey;
    const again = [...el.sessionList.querySelectorAll("button")]
      .find((b) => b.dataset.sessionId === id && b.className === className);
    (again ?? el.newChat).focus();
  }
}

/** Update the "5 minutes ago" texts in place (no re-render, so focus and hover stay). */
function refreshTimes() {
  for (const span of el.sessionList.querySelectorAll(".session-time[data-updated]")) {
    span.textContent = formatRelative(Number(span.dataset.updated));
  }
}

function renderAll() {
  renderChat();
  renderSidebar();
}

function nearBottom() {
  const m = el.messages;
  return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
}

function scrollToEnd(force) {
  if (force || nearBottom()) el.messages.scrollTop = el.messages.scrollHeight;
}

function autosize() {
  el.input.style.height = "auto";
  el.input.style.height = `${Math.min(el.input.scrollHeight, window.innerHeight * 0.4)}px`;
}

// ----------------------------------------------------------------------------- views, sidebar, settings

const admin = mountAdmin(el.adminView, {
  onSessionDeleted(id) {
    forgetSession(id);
    if (state.sessionId === id) newChat({ switchView: false });
    renderSidebar();
  },
});

function showView(view) {
  const isAdmin = view === "admin";
  el.chatView.hidden = isAdmin;
  el.adminView.hidden = !isAdmin;
  for (const tab of document.querySelectorAll(".tabs a")) {
    if (tab.dataset.view === view) tab.setAttribute("aria-current", "page");
    else tab.removeAttribute("aria-current");
  }
  if (isAdmin) admin.show();
}

function route() {
  const hash = decodeURIComponent(location.hash.slice(1));
  if (hash.startsWith("session/")) {
    history.replaceState(null, "", "#chat");
    showView("chat");
    openSession(hash.slice("session/".length));
    return;
  }
  showView(hash === "admin" ? "admin" : "chat");
}

function openSidebar() {
  el.sidebar.classList.add("open");
  el.scrim.hidden = false;
  el.toggleSidebar.setAttribute("aria-expanded", "true");
  el.sidebar.querySelector("button")?.focus();
}

function closeSidebar() {
  if (!el.sidebar.classList.contains("open")) return;
  el.sidebar.classList.remove("open");
  el.scrim.hidden = true;
  el.toggleSidebar.setAttribute("aria-expanded", "false");
}

function openSettings() {
  for (const input of el.settingsForm.querySelectorAll("input[name]")) input.value = settings[input.name] ?? "";
  el.settingsDialog.showModal();
}

el.settingsDialog.addEventListener("close", () => {
  if (el.settingsDialog.returnValue !== "save") return;
  const previousKey = settings.api_key;
  const next = { ...settings };
  for (const input of el.settingsForm.querySelectorAll("input[name]")) next[input.name] = input.value.trim();
  settings = next;
  saveSettings(settings);
  if (settings.api_key !== previousKey) conn.reconnect();
});

// ----------------------------------------------------------------------------- events

el.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
el.input.addEventListener("keydown", (event) => {
  // Enter sends, Shift+Enter is a new line; never send in the middle of an IME composition.
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  } else if (event.key === "Escape" && state.turns.has(state.sessionId)) {
    stop();
  }
});
el.input.addEventListener("input", autosize);
el.stop.addEventListener("click", stop);
el.newChat.addEventListener("click", () => newChat());
el.openForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const id = el.openId.value.trim();
  if (!id) return;
  el.openId.value = "";
  showView("chat");
  closeSidebar();
  openSession(id);
});
el.sessionIdButton.addEventListener("click", async () => {
  try {
    await navigator.clipboard.writeText(state.sessionId);
    el.sessionIdButton.textContent = "id copied";
  } catch {
    el.sessionIdButton.textContent = state.sessionId; // let the person select it instead
  }
});
el.settingsButton.addEventListener("click", openSettings);
el.toggleSidebar.addEventListener("click", () => {
  if (el.sidebar.classList.contains("open")) closeSidebar();
  else openSidebar();
});
el.scrim.addEventListener("click", closeSidebar);
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape") closeSidebar();
});
window.addEventListener("hashchange", route);
window.addEventListener("storage", (event) => {
  // Another tab changed the list of sessions.
  if (event.key?.startsWith("chatd.sessions")) renderSidebar();
});
// Relative times in the sidebar ("2 minutes ago") drift; refresh them now and then.
setInterval(refreshTimes, 30000);

// ----------------------------------------------------------------------------- start

state.sessionId = currentSession();
state.loading = state.sessionId !== null;
renderAll();
route();
conn.connect();
