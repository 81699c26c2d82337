// The websocket connection to chatd (protocol v1): request ids, routing of
// answers, and reconnecting with backoff.
//
// Every frame we send carries an `id`; the server echoes it on each frame that
// answers (token, message.done, error...), so answers are routed by id and
// several requests can be in flight at once.
//
// Events (all CustomEvent, details in `event.detail`):
//   "state"  {state, attempt, retryInMs}  state: connecting | connected | reconnecting | offline
//   "hello"  {hello, reconnected}         the server greeted us; safe to send
//   "error"  {code, message}              an error frame that answers no request of ours

import { CLOSE_UNAUTHORIZED, ERROR, KEY_SUBPROTOCOL_PREFIX, SUBPROTOCOL } from "./wire.js";

const REQUEST_TIMEOUT_MS = 30000;
const BACKOFF_FIRST_MS = 250;
const BACKOFF_MAX_MS = 5000;
// After this many failed attempts in a row we call it "offline" (and keep trying).
const ATTEMPTS_BEFORE_OFFLINE = 5;

/** Codes of errors that happen in the browser, beside the server's wire codes (`ERROR`). */
export const CLIENT_ERROR = Object.freeze({
  CONNECTION_LOST: "connection_lost",
  OFFLINE: "offline",
  TIMEOUT: "timeout",
  PROTOCOL: "protocol",
});

/** An error the page shows: `code` is a wire code (`ERROR`) or a client-side one (`CLIENT_ERROR`). */
export class ChatError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

export class Connection extends EventTarget {
  /**
   * @param {string} url  ws:// or wss:// URL of /ws
   * @param {() => string} getApiKey  read on every (re)connect, so a new key applies at once
   */
  constructor(url, getApiKey = () => "") {
    super();
    this.url = url;
    this.getApiKey = getApiKey;
    this.state = "connecting";
    this.hello = null;
    this.ws = null;
    this.attempt = 0;
    this.nextId = 1;
    this.pending = new Map(); // id -> {resolve, reject, onFrame?, timer?}
    this.retryTimer = null;
    this.everConnected = false;
    this.stopped = false; // true after an unauthorized close: retrying cannot help
    window.addEventListener("online", () => this.retryNow());
    window.addEventListener("offline", () => this.setState("offline"));
  }

  get connected() {
    return this.state === "connected";
  }

  connect() {
    clearTimeout(this.retryTimer);
    this.retryTimer = null;
    if (this.ws) return;
    const protocols = [SUBPROTOCOL];
    const key = this.getApiKey();
    if (key) protocols.push(KEY_SUBPROTOCOL_PREFIX + key);
    let ws;
    try {
      ws = new WebSocket(this.url, protocols);
    } catch (err) {
      // The browser rejects keys that are not valid subprotocol tokens.
      this.stopped = true;
      this.setState("offline");
      this.emit("error", { code: ERROR.BAD_REQUEST, message: `cannot open the connection: ${err.message}` });
      return;
    }
    this.ws = ws;
    if (!this.everConnected) this.setState("connecting");
    ws.addEventListener("message", (event) => this.onMessage(ws, event));
    ws.addEventListener("close", (event) => this.onClose(ws, event));
  }

  /** Forget the current socket (e.g. after the API key changed) and connect again. */
  reconnect() {
    this.stopped = false;
    this.attempt = 0;
    if (this.ws) this.ws.close(1000, "reconnecting");
    else this.connect();
  }

  retryNow() {
    if (this.stopped || this.ws) return;
    this.attempt = 0;
    this.connect();
  }

  setState(state, extra = {}) {
    this.state = state;
    this.emit("state", { state, attempt: this.attempt, ...extra });
  }

  emit(name, detail) {
    this.dispatchEvent(new CustomEvent(name, { detail }));
  }

  onMessage(ws, event) {
    if (ws !== this.ws) return;
    let frame;
    try {
      frame = JSON.parse(event.data);
    } catch {
      this.emit("error", { code: CLIENT_ERROR.PROTOCOL, message: "the server sent a frame that is not JSON" });
      return;
    }
    if (frame.type === "hello") {
      const reconnected = this.everConnected;
      this.hello = frame;
      this.everConnected = true;
      this.attempt = 0;
      this.setState("connected");
      this.emit("hello", { hello: frame, reconnected });
      return;
    }
    const waiter = frame.id ? this.pending.get(frame.id) : undefined;
    if (!waiter) {
      if (frame.type === "error") {
        if (frame.code === ERROR.UNAUTHORIZED) this.stopped = true;
        this.emit("error", { code: frame.code, message: frame.message });
      }
      return; // e.g. answers to a request we gave up on
    }
    if (frame.type === "error") {
      this.finish(frame.id);
      waiter.reject(new ChatError(frame.code, frame.message));
    } else if (waiter.onFrame) {
      // Streams end with message.done (a reply) or message.edited (nothing generated).
      if (frame.type === "message.done" || frame.type === "message.edited") {
        this.finish(frame.id);
        waiter.resolve(frame);
      } else {
        waiter.onFrame(frame);
      }
    } else {
      this.finish(frame.id);
      waiter.resolve(frame);
    }
  }

  onClose(ws, event) {
    if (ws !== this.ws) return;
    this.ws = null;
    this.hello = null;
    const lost = new ChatError(CLIENT_ERROR.CONNECTION_LOST, "the connection to the server was lost");
    for (const [id, waiter] of this.pending) {
      this.finish(id);
      waiter.reject(lost);
    }
    if (event.code === CLOSE_UNAUTHORIZED) this.stopped = true;
    if (this.stopped) {
      this.setState("offline");
      return;
    }
    this.scheduleRetry();
  }

  scheduleRetry() {
    this.attempt += 1;
    const base = Math.min(BACKOFF_FIRST_MS * 2 ** (this.attempt - 1), BACKOFF_MAX_MS);
    // Jitter keeps a crowd of tabs from reconnecting in lockstep after a restart.
    const delay = Math.round(base * (0.8 + Math.random() * 0.4));
    const offline = !navigator.onLine || this.attempt > ATTEMPTS_BEFORE_OFFLINE;
    this.setState(offline ? "offline" : "reconnecting", { retryInMs: delay });
    this.retryTimer = setTimeout(() => this.connect(), delay);
  }

  finish(id) {
    const waiter = this.pending.get(id);
    if (waiter?.timer) clearTimeout(waiter.timer);
    this.pending.delete(id);
  }

  sendFrame(frame) {
    if (!this.connected || !this.ws) {
      throw new ChatError(CLIENT_ERROR.OFFLINE, "not connected to the server; waiting to reconnect");
    }
    const id = `r${this.nextId++}`;
    this.ws.send(JSON.stringify({ ...frame, id }));
    return id;
  }

  /**
   * Send a frame; the promise resolves with the first frame answering it or rejects with a
   * ChatError. Throws ChatError "offline" at once when not connected.
   */
  request(frame, timeoutMs = REQUEST_TIMEOUT_MS) {
    const id = this.sendFrame(frame);
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.finish(id);
        reject(new ChatError(CLIENT_ERROR.TIMEOUT, `no answer to ${frame.type} within ${timeoutMs / 1000} s`));
      }, timeoutMs);
      // Answers arrive in later tasks, so registering after sending cannot miss one.
      this.pending.set(id, { resolve, reject, timer });
    });
  }

  /**
   * Send message.send or message.edit. `onFrame` gets every token frame; `done` resolves with the
   * closing message.done / message.edited frame or rejects with a ChatError. Throws ChatError
   * "offline" at once when not connected. No timeout: a long reply is not an error.
   */
  stream(frame, onFrame) {
    const id = this.sendFrame(frame);
    const done = new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject, onFrame });
    });
    return { id, done };
  }
}

/** The /ws URL of the server that served this page (an ?api_key= in the page URL is passed on). */
export function defaultUrl(location = window.location) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const url = new URL(`${scheme}//${location.host}/ws`);
  const key = new URLSearchParams(location.search).get("api_key");
  if (key) url.searchParams.set("api_key", key);
  return url.href;
}
