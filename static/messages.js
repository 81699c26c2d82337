// Rendering of one conversation message: its body, its actions, the edit form,
// and the usage line that says where a reply's context came from.
//
// User text is shown as typed (textContent, pre-wrap); assistant text goes
// through the safe Markdown renderer. Nothing here assigns HTML strings.

import { h } from "./dom.js";
import { formatClock, formatCount, formatMs } from "./format.js";
import { renderMarkdown } from "./markdown.js";

const ROLE_LABELS = { user: "You", assistant: "chatd", system: "System prompt" };

const TIER_HELP = {
  device: "The context was already in the KV cache in memory",
  host: "The context was in the KV cache in host memory",
  disk: "The context was restored from a snapshot on disk",
  none: "Nothing was cached: the whole prompt was computed",
};

/**
 * Build the element of one message.
 *
 * options:
 *   meta       {usage, finishReason} of a reply generated in this page, or null
 *   note       {invalidatedFrom} of an edit made in this page, or null
 *   editing    true to show the edit form instead of the body
 *   canEdit    whether edit buttons are usable now (no reply running, connected)
 *   onEdit(message), onSave(message, content), onCancel(), onCopy(message, button)
 */
export function renderMessage(message, options = {}) {
  const { meta = null, note = null, editing = false, canEdit = true } = options;
  const role = message.role;
  const number = message.index + 1;
  const article = h("article", {
    class: `msg msg-${role}${message.pending ? " pending" : ""}`,
    "data-testid": "message",
    "aria-label": `${ROLE_LABELS[role] ?? role}, message ${number}`,
    dataset: { role, index: message.index },
  });

  const actions = h("div", { class: "msg-actions" });
  if (!editing) {
    actions.append(h("button", {
      type: "button",
      class: "ghost small",
      "data-testid": "edit",
      disabled: !canEdit || message.pending,
      title: role === "user" ? "Edit this message and generate a new reply from here" : "Edit this message",
      "aria-label": `Edit message ${number}`,
      onclick: () => options.onEdit?.(message),
    }, "Edit"));
    if (role !== "system") {
      actions.append(h("button", {
        type: "button",
        class: "ghost small",
        "data-testid": "copy",
        "aria-label": `Copy message ${number}`,
        onclick: (event) => options.onCopy?.(message, event.currentTarget),
      }, "Copy"));
    }
  }
  const time = message.created_at
    ? h("time", { datetime: message.created_at, title: new Date(message.created_at).toLocaleString() },
      formatClock(message.created_at))
    : null;
  article.append(h("header", { class: "msg-head" },
    h("span", { class: "msg-role" }, ROLE_LABELS[role] ?? role), time, actions));

  if (editing) {
    article.append(editForm(message, options));
  } else {
    article.append(messageBody(role, message.content));
  }
  if (meta && role === "assistant") article.append(usageLine(meta.usage, meta.finishReason));
  else if (note) article.append(editNote(note.invalidatedFrom));
  return article;
}

function messageBody(role, content) {
  const body = h("div", { class: role === "assistant" ? "msg-body md" : "msg-body plain", "data-testid": "message-body" });
  if (role === "assistant") body.append(renderMarkdown(content));
  else body.textContent = content;
  if (role === "assistant" && content.trim() === "") {
    // Replies of only whitespace would otherwise look like a missing message.
    body.append(h("span", { class: "muted empty-reply" }, "(empty reply)"));
  }
  return body;
}

/** The reply being streamed; `update(text)` renders the text received so far. */
export function streamingMessage(index) {
  const body = h("div", { class: "msg-body md", "data-testid": "message-body", "aria-busy": "true" });
  const typing = h("span", { class: "typing", role: "img", "aria-label": "chatd is writing" },
    h("span"), h("span"), h("span"));
  const article = h("article", {
    class: "msg msg-assistant streaming",
    "data-testid": "message",
    "aria-label": "chatd, reply in progress",
    dataset: { role: "assistant", index, streaming: "true" },
  },
  h("header", { class: "msg-head" }, h("span", { class: "msg-role" }, ROLE_LABELS.assistant),
    h("span", { class: "muted" }, "writing…")),
  body);
  let shown = null;
  article.update = (text) => {
    if (text === shown) return;
    shown = text;
    body.replaceChildren(renderMarkdown(text));
    if (text.trim() === "") body.append(typing);
  };
  article.update("");
  return article;
}

function editForm(message, options) {
  const id = `edit-${message.index}`;
  const textarea = h("textarea", {
    id,
    class: "edit-input",
    "data-testid": "edit-input",
    rows: Math.min(12, Math.max(2, message.content.split("\n").length + 1)),
  });
  textarea.value = message.content;
  const save = () => options.onSave?.(message, textarea.value);
  textarea.addEventListener("keydown", (event) => {
    if (event.key === "Escape") {
      event.preventDefault();
      options.onCancel?.();
    } else if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      save();
    }
  });
  const isUser = message.role === "user";
  return h("form", {
    class: "edit-form",
    "data-testid": "edit-form",
    onsubmit: (event) => {
      event.preventDefault();
      save();
    },
  },
  h("label", { for: id, class: "visually-hidden" }, `Edit message ${message.index + 1}`),
  textarea,
  h("div", { class: "edit-actions" },
    h("span", { class: "hint" }, "Enter saves · Shift+Enter new line · Esc cancels"),
    h("button", { type: "button", class: "ghost", onclick: () => options.onCancel?.() }, "Cancel"),
    h("button", { type: "submit", class: "primary", "data-testid": "edit-save" },
      isUser ? "Save and regenerate" : "Save")));
}

/** The line under a reply: cached / prefilled tokens, tier, restore time, speed, invalidation. */
export function usageLine(usage, finishReason) {
  const parts = [];
  const tier = usage.cache_tier;
  parts.push(h("span", { class: `tier tier-${tier}`, "data-testid": "tier", title: TIER_HELP[tier] ?? "" }, tier));
  parts.push(h("span", {
    title: `${formatCount(usage.input_tokens)} prompt tokens: ${formatCount(usage.cached_tokens)} read from the ` +
      `KV cache, ${formatCount(usage.prefill_tokens)} computed for this turn`,
  }, `${formatCount(usage.cached_tokens)} cached / ${formatCount(usage.prefill_tokens)} prefilled`));
  if (usage.restore_ms !== null && usage.restore_ms !== undefined) {
    parts.push(h("span", { "data-testid": "restore", title: "Time to load the snapshot from disk" },
      `restored in ${formatMs(usage.restore_ms)}`));
  }
  if (usage.invalidated_from !== null && usage.invalidated_from !== undefined) {
    parts.push(h("span", {
      class: "invalidated",
      "data-testid": "invalidated",
      title: "The edit changed the conversation from this token on; the cache before it was kept",
    }, `invalidated from token ${formatCount(usage.invalidated_from)}`));
  }
  parts.push(h("span", { title: "Time to first token" }, `first token ${formatMs(usage.ttft_ms)}`));
  parts.push(h("span", { title: `${formatCount(usage.output_tokens)} tokens generated` },
    `${usage.decode_tokens_per_s.toFixed(1)} tok/s`));
  if (finishReason === "cancelled") parts.push(h("span", { class: "finish" }, "stopped"));
  else if (finishReason === "length") parts.push(h("span", { class: "finish" }, "hit max tokens"));
  return h("div", {
    class: "usage",
    "data-testid": "usage",
    dataset: {
      tier,
      cached: usage.cached_tokens,
      prefilled: usage.prefill_tokens,
      input: usage.input_tokens,
      output: usage.output_tokens,
      restoreMs: usage.restore_ms,
      invalidatedFrom: usage.invalidated_from,
      ttftMs: usage.ttft_ms,
      tps: usage.decode_tokens_per_s,
      finishReason,
    },
  }, parts);
}

/** Shown under a system or assistant message edited here (no reply is generated for those). */
export function editNote(invalidatedFrom) {
  const known = invalidatedFrom !== null && invalidatedFrom !== undefined;
  return h("div", {
    class: "usage",
    "data-testid": "edit-note",
    dataset: { invalidatedFrom: known ? invalidatedFrom : null },
  },
  h("span", { class: "tier tier-none" }, "edited"),
  known ? h("span", { class: "invalidated" }, `invalidated from token ${formatCount(invalidatedFrom)}`) : null);
}
