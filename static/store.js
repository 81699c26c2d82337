// What this browser remembers, in localStorage: the sessions opened here (id,
// title, last activity), the open session and the generation settings.
// Session ids are capabilities, so they stay in this browser only.

const SESSIONS_KEY = "chatd.sessions.v1";
const CURRENT_KEY = "chatd.current.v1";
const SETTINGS_KEY = "chatd.settings.v1";
const MAX_SESSIONS = 200;

function read(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback; // storage disabled or a damaged value: start over
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch {
    // Quota or privacy mode: the page still works, it just forgets on reload.
  }
}

/** Sessions, most recently active first: [{id, title, updatedAt}]. */
export function listSessions() {
  const list = read(SESSIONS_KEY, []);
  if (!Array.isArray(list)) return [];
  return list
    .filter((s) => s && typeof s.id === "string")
    .sort((a, b) => (b.updatedAt ?? 0) - (a.updatedAt ?? 0));
}

export function getSession(id) {
  return listSessions().find((s) => s.id === id) ?? null;
}

/** Add or update a session; `patch` fields replace the stored ones. */
export function saveSession(id, patch = {}) {
  const list = listSessions();
  const found = list.find((s) => s.id === id);
  if (found) Object.assign(found, patch);
  else list.unshift({ id, title: "", updatedAt: Date.now(), ...patch });
  write(SESSIONS_KEY, list.sort((a, b) => (b.updatedAt ?? 0) - (a.updatedAt ?? 0)).slice(0, MAX_SESSIONS));
}

export function forgetSession(id) {
  write(SESSIONS_KEY, listSessions().filter((s) => s.id !== id));
  if (currentSession() === id) setCurrentSession(null);
}

export function currentSession() {
  return read(CURRENT_KEY, null);
}

export function setCurrentSession(id) {
  if (id) write(CURRENT_KEY, id);
  else localStorage.removeItem(CURRENT_KEY);
}

export const DEFAULT_SETTINGS = {
  temperature: "",
  max_tokens: "",
  top_p: "",
  top_k: "",
  seed: "",
  api_key: "",
};

export function loadSettings() {
  return { ...DEFAULT_SETTINGS, ...read(SETTINGS_KEY, {}) };
}

export function saveSettings(settings) {
  write(SETTINGS_KEY, settings);
}

/** GenerationParams for a frame: empty fields are left to the server's defaults. */
export function paramsFrom(settings) {
  const params = {};
  const number = (name, parse) => {
    const raw = String(settings[name] ?? "").trim();
    if (raw === "") return;
    const value = parse(raw);
    if (Number.isFinite(value)) params[name] = value;
  };
  number("temperature", parseFloat);
  number("max_tokens", (v) => parseInt(v, 10));
  number("top_p", parseFloat);
  number("top_k", (v) => parseInt(v, 10));
  number("seed", (v) => parseInt(v, 10));
  return Object.keys(params).length ? params : undefined;
}
