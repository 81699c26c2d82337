// Small DOM helpers. Every string child becomes a text node, so no text that
// passes through here is ever parsed as HTML.

/**
 * Create an element. `attrs` keys: `class`, `text` (textContent), `dataset`
 * (object), `on<event>` (listener), anything else is set as an attribute
 * (true -> empty attribute, null/false/undefined -> left out).
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = value;
    else if (key === "dataset") {
      for (const [name, v] of Object.entries(value)) {
        if (v !== null && v !== undefined) el.dataset[name] = String(v);
      }
    } else if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

/** Append children: nodes, strings (as text), arrays of either; null is skipped. */
export function append(parent, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    parent.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return parent;
}

/** Replace all children of `parent`. */
export function replaceChildren(parent, ...children) {
  parent.replaceChildren();
  return append(parent, children);
}

export const $ = (selector, root = document) => root.querySelector(selector);
