// The admin view: sessions on the server with their cache tier and sizes,
// evict / restore / delete, and the server's cache statistics.
//
// The admin token is typed by the operator and kept in memory, or in this
// tab's sessionStorage when they ask for it; it never goes into the page or
// into localStorage. Every request sends it as `Authorization: Bearer`.

import { $, h, replaceChildren } from "./dom.js";
import { formatBytes, formatCount, formatMs, formatPercent, formatRelative } from "./format.js";

const TOKEN_KEY = "chatd.adminToken";
const PAGE_SIZE = 25;
const DELETE_CONFIRM_MS = 4000;

class AdminError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

function describe(err) {
  if (err.status === 401) {
    return `The server did not accept the admin token (401 ${err.code}: ${err.message}).`;
  }
  if (err.status) return `${err.status} ${err.code}: ${err.message}`;
  return `Cannot reach the server: ${err.message}`;
}

/**
 * Wire the admin section `root` (markup in index.html). Returns {show()}, called whenever the
 * view becomes visible. `onSessionDeleted(id)` lets the chat forget a session deleted here.
 */
export function mountAdmin(root, { onSessionDeleted } = {}) {
  const el = {
    login: $("#admin-login", root),
    token: $("#admin-token", root),
    remember: $("#admin-remember", root),
    tools: $("#admin-tools", root),
    tier: $("#admin-tier", root),
    refresh: $("#admin-refresh", root),
    lock: $("#admin-lock", root),
    error: $("#admin-error", root),
    status: $("#admin-status", root),
    panel: $("#admin-panel", root),
    model: $("#admin-model", root),
    stats: $("#admin-stats", root),
    rows: $("#admin-rows", root),
    prev: $("#admin-prev", root),
    next: $("#admin-next", root),
    page: $("#admin-page", root),
  };
  let token = readStoredToken();
  let offset = 0;
  let loading = null;

  function readStoredToken() {
    try {
      return sessionStorage.getItem(TOKEN_KEY);
    } catch {
      return null;
    }
  }

  async function api(method, path) {
    let response;
    try {
      response = await fetch(path, {
        method,
        headers: { Authorization: `Bearer ${token}`, Accept: "application/json" },
        cache: "no-store",
      });
    } catch (err) {
      throw new AdminError(0, "network", err.message);
    }
    if (response.status === 204) return null;
    let body = null;
    try {
      body = await response.json();
    } catch {
      // An answer that is not JSON (a proxy's error page, say) is reported by its status alone.
    }
    if (!response.ok) {
      const error = body?.error ?? {};
      throw new AdminError(response.status, error.code ?? `http_${response.status}`,
        error.message ?? (response.statusText || "request failed"));
    }
    return body;
  }

  function showError(err) {
    el.error.hidden = false;
    el.error.dataset.status = err.status ?? "";
    el.error.dataset.code = err.code ?? "";
    replaceChildren(el.error, h("strong", { class: "alert-title" }, err.status === 401 ? "Not authorized" : "Error"),
      h("span", { class: "alert-text" }, describe(err)));
    if (err.status === 401) lock({ keepError: true });
  }

  function clearError() {
    el.error.hidden = true;
    el.error.replaceChildren();
  }

  function setStatus(text) {
    el.status.textContent = text;
  }

  function lock({ keepError = false } = {}) {
    token = null;
    try {
      sessionStorage.removeItem(TOKEN_KEY);
    } catch {
      // nothing stored
    }
    el.login.hidden = false;
    el.tools.hidden = true;
    el.panel.hidden = true;
    if (!keepError) clearError();
    setStatus("");
    el.token.value = "";
    if (!root.hidden) el.token.focus();
  }

  function unlocked() {
    el.login.hidden = true;
    el.tools.hidden = false;
    el.panel.hidden = false;
  }

  async function refresh() {
    if (!token) return;
    // One refresh at a time; a click during one waits for it and then runs again.
    if (loading) await loading.catch(() => {});
    const tier = el.tier.value;
    const query = new URLSearchParams({ limit: String(PAGE_SIZE), offset: String(offset) });
    if (tier) query.set("tier", tier);
    el.refresh.disabled = true;
    root.setAttribute("aria-busy", "true");
    loading = Promise.all([api("GET", "/admin/stats"), api("GET", `/admin/sessions?${query}`)]);
    try {
      const [stats, page] = await loading;
      clearError();
      unlocked();
      renderStats(stats);
      renderSessions(page);
      setStatus(`Updated ${new Date().toLocaleTimeString()}`);
    } catch (err) {
      showError(err);
    } finally {
      loading = null;
      el.refresh.disabled = false;
      root.removeAttribute("aria-busy");
    }
  }

  function statCard(testid, title, value, detail, meter = null) {
    return h("section", { class: "stat card", "data-testid": testid, dataset: meter?.data ?? {} },
      h("h3", { class: "stat-title" }, title),
      h("p", { class: "stat-value" }, value),
      meter ? h("div", {
        class: "meter",
        role: "meter",
        "aria-valuemin": 0,
        "aria-valuemax": meter.max || 1,
        "aria-valuenow": meter.value,
        "aria-label": `${title} use`,
      }, meterFill(meter)) : null,
      h("p", { class: "stat-detail muted" }, detail));
  }

  /** The filled part of a meter. Its width is set through the CSSOM, not a style attribute: the server's
   * Content-Security-Policy allows no inline styles. */
  function meterFill(meter) {
    const fill = h("span");
    fill.style.width = `${meter.max ? Math.min(100, (100 * meter.value) / meter.max) : 0}%`;
    return fill;
  }

  function renderStats(stats) {
    const { model, tiers, sessions } = stats;
    el.model.textContent = `${model.name} · ${model.dtype} on ${model.device} · context ${formatCount(model.max_context)} ` +
      `tokens · ${formatBytes(model.kv_bytes_per_token)} of KV cache per token`;
    const cards = [];
    for (const [name, label] of [["device", "Device cache"], ["host", "Host memory"], ["disk", "Disk snapshots"]]) {
      const tier = tiers[name];
      if (!tier) continue;
      const value = [formatBytes(tier.used_bytes), h("span", { class: "stat-of" }, ` of ${formatBytes(tier.budget_bytes)}`)];
      cards.push(statCard(`stat-${name}`, label, value,
        `${formatCount(tier.sessions)} session${tier.sessions === 1 ? "" : "s"} ${name === "disk" ? "evicted to disk" : "resident"}`,
        { value: tier.used_bytes, max: tier.budget_bytes, data: { used: tier.used_bytes, budget: tier.budget_bytes } }));
    }
    cards.push(statCard("stat-ratio", "Cached-token ratio", formatPercent(stats.cached_token_ratio),
      `${formatCount(stats.cached_tokens)} prompt tokens from cache, ${formatCount(stats.prefilled_tokens)} ` +
      `prefilled, over ${formatCount(stats.turns)} turn${stats.turns === 1 ? "" : "s"}`,
      { value: stats.cached_token_ratio, max: 1, data: { ratio: stats.cached_token_ratio } }));
    cards.push(statCard("stat-sessions", "Sessions", formatCount(sessions.total),
      `${formatCount(sessions.resident)} resident · ${formatCount(sessions.evicted)} on disk · ` +
      `${formatCount(sessions.generating)} generating`));
    cards.push(statCard("stat-restores", "Restores", formatCount(stats.restores),
      `mean ${formatMs(stats.restore_ms_mean)} · ${formatCount(stats.restore_failures)} failed`));
    cards.push(statCard("stat-evictions", "Evictions", formatCount(stats.evictions),
      `${formatCount(stats.evictions_idle)} idle · ${formatCount(stats.evictions_for_room)} for room · ` +
      `${formatCount(stats.snapshot_writes)} snapshots written` +
      (stats.snapshot_write_failures ? `, ${formatCount(stats.snapshot_write_failures)} failed` : "")));
    replaceChildren(el.stats, cards);
  }

  function renderSessions(page) {
    const rows = page.sessions.map(sessionRow);
    if (rows.length === 0) {
      rows.push(h("tr", {}, h("td", { colspan: 8, class: "muted empty-row" },
        el.tier.value ? `No sessions in tier “${el.tier.value}”.` : "No sessions yet.")));
    }
    replaceChildren(el.rows, rows);
    const first = page.total === 0 ? 0 : page.offset + 1;
    const last = page.offset + page.sessions.length;
    el.page.textContent = `${formatCount(first)}–${formatCount(last)} of ${formatCount(page.total)}`;
    el.prev.disabled = page.offset === 0;
    el.next.disabled = last >= page.total;
  }

  function sessionRow(s) {
    const title = s.title || "Untitled conversation";
    const resident = s.tier === "device" || s.tier === "host";
    return h("tr", { "data-testid": "admin-row", dataset: { sessionId: s.session_id, tier: s.tier } },
      h("th", { scope: "row", class: "session-cell" },
        h("a", { href: `#session/${encodeURIComponent(s.session_id)}`, title: "Open in the chat" }, title),
        h("code", { class: "muted session-code", title: s.session_id }, s.session_id)),
      h("td", {},
        h("span", { class: `tier tier-${s.tier}`, "data-testid": "admin-tier-cell" }, s.tier),
        s.generating ? h("span", { class: "tier tier-live" }, "generating") : null),
      h("td", { class: "num" }, formatCount(s.message_count)),
      h("td", { class: "num" }, formatCount(s.token_count)),
      h("td", { class: "num", dataset: { bytes: s.kv_bytes } }, s.kv_bytes ? formatBytes(s.kv_bytes) : "–"),
      h("td", { class: "num", dataset: { bytes: s.snapshot_bytes } }, s.snapshot_bytes ? formatBytes(s.snapshot_bytes) : "–"),
      h("td", {}, h("time", { datetime: s.last_active, title: new Date(s.last_active).toLocaleString() },
        formatRelative(s.last_active))),
      h("td", {}, h("div", { class: "actions" },
        actionButton("evict", "Evict", s, !resident || s.generating, "Snapshot to disk and free its memory"),
        actionButton("restore", "Restore", s, resident, "Load its cache back into memory"),
        deleteButton(s))));
  }

  function actionButton(action, label, s, disabled, help) {
    return h("button", {
      type: "button",
      class: "small",
      "data-action": action,
      disabled,
      title: help,
      "aria-label": `${label} “${s.title || s.session_id}”`,
      onclick: (event) => act(event.currentTarget, action, s),
    }, label);
  }

  function deleteButton(s) {
    let armed = null;
    const button = h("button", {
      type: "button",
      class: "small danger-outline",
      "data-action": "delete",
      title: "Delete the session, its messages and snapshot",
      "aria-label": `Delete “${s.title || s.session_id}”`,
      onclick: () => {
        // Two clicks: a modal confirm() would block the page; this keeps the operator in flow.
        if (!armed) {
          button.textContent = "Confirm delete";
          button.classList.add("armed");
          armed = setTimeout(() => {
            armed = null;
            button.textContent = "Delete";
            button.classList.remove("armed");
          }, DELETE_CONFIRM_MS);
          return;
        }
        clearTimeout(armed);
        act(button, "delete", s);
      },
    }, "Delete");
    return button;
  }

  async function act(button, action, s) {
    const name = s.title ? `“${s.title}”` : s.session_id.slice(0, 8);
    button.disabled = true;
    try {
      if (action === "delete") {
        await api("DELETE", `/admin/sessions/${encodeURIComponent(s.session_id)}`);
        setStatus(`Deleted ${name}.`);
        onSessionDeleted?.(s.session_id);
      } else {
        const result = await api("POST", `/admin/sessions/${encodeURIComponent(s.session_id)}/${action}`);
        const verb = action === "evict" ? "Evicted" : "Restored";
        setStatus(result.done ? `${verb} ${name}: now in tier ${result.tier}.`
          : `${name} was not ${action === "evict" ? "evicted" : "restored"}; it is in tier ${result.tier}.`);
      }
      clearError();
    } catch (err) {
      showError(err);
      return;
    }
    const status = el.status.textContent;
    await refresh();
    setStatus(status); // keep the action's result visible rather than "Updated ..."
  }

  el.login.addEventListener("submit", (event) => {
    event.preventDefault();
    const typed = el.token.value.trim();
    if (!typed) return;
    token = typed;
    el.token.value = "";
    try {
      if (el.remember.checked) sessionStorage.setItem(TOKEN_KEY, token);
      else sessionStorage.removeItem(TOKEN_KEY);
    } catch {
      // sessionStorage unavailable: the token lives in memory only
    }
    offset = 0;
    refresh();
  });
  el.refresh.addEventListener("click", () => refresh());
  el.lock.addEventListener("click", () => lock());
  el.tier.addEventListener("change", () => {
    offset = 0;
    refresh();
  });
  el.prev.addEventListener("click", () => {
    offset = Math.max(0, offset - PAGE_SIZE);
    refresh();
  });
  el.next.addEventListener("click", () => {
    offset += PAGE_SIZE;
    refresh();
  });

  return {
    show() {
      if (token) refresh();
      else {
        el.login.hidden = false;
        el.token.focus();
      }
    },
  };
}
