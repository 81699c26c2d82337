// A small, safe Markdown renderer for chat replies.
//
// It builds DOM nodes directly (createElement + text nodes) and never assigns
// HTML strings, so markup typed by a user or produced by the model shows as
// text. Only a fixed set of elements is created, and links are kept only for
// http(s) URLs. It also copes with half-written input, because replies are
// rendered again on every streamed token: an unclosed code fence simply runs
// to the end of the text.
//
// Supported: paragraphs (single newlines kept as line breaks), ``` and ~~~
// fenced code, headings, block quotes, bullet and numbered lists (nested by
// indentation), horizontal rules, `code`, **bold**, *italic*, ~~strike~~,
// [links](https://...), bare https:// URLs and backslash escapes. Images
// (![alt](url)) become links, so no text makes the browser fetch anything.

const FENCE = /^ {0,3}(`{3,}|~{3,})[ \t]*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const LIST_ITEM = /^( {0,12})([-*+]|\d{1,9}[.)])(?:[ \t]+(.*))?$/;
const ESCAPABLE = "\\`*_{}[]()#+-.!~>|<\"'";

/** Render Markdown `text` into a DocumentFragment. */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
  for (const node of parseBlocks(lines)) fragment.append(node);
  return fragment;
}

/** True when `href` is an absolute http(s) URL; returns the normalised URL or null. */
export function safeHref(href) {
  try {
    const url = new URL(href);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}

// ----------------------------------------------------------------------------- blocks

function parseBlocks(lines) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (line.trim() === "") {
      i += 1;
      continue;
    }
    const fence = FENCE.exec(line);
    if (fence) {
      i = parseFence(lines, i, fence, out);
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      // Level 1 in a reply becomes <h3>: the page itself owns h1 and h2.
      const level = Math.min(heading[1].length + 2, 6);
      out.push(el(`h${level}`, parseInline(heading[2] ?? "")));
      i += 1;
      continue;
    }
    if (RULE.test(line)) {
      out.push(document.createElement("hr"));
      i += 1;
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) {
        quoted.push(QUOTE.exec(lines[i])[1]);
        i += 1;
      }
      out.push(el("blockquote", parseBlocks(quoted)));
      continue;
    }
    const item = listItem(line);
    if (item && item.indent <= 3) {
      i = parseList(lines, i, item, out);
      continue;
    }
    i = parseParagraph(lines, i, out);
  }
  return out;
}

function parseFence(lines, start, match, out) {
  const marker = match[1];
  const language = match[2];
  const body = [];
  let i = start + 1;
  const closing = new RegExp(`^ {0,3}${marker[0] === "`" ? "`" : "~"}{${marker.length},}[ \\t]*$`);
  while (i < lines.length && !closing.test(lines[i])) {
    body.push(lines[i]);
    i += 1;
  }
  const code = document.createElement("code");
  code.textContent = body.join("\n");
  const pre = document.createElement("pre");
  if (language) {
    // A class name from the text is harmless, but keep it to a plain word anyway.
    const clean = language.replace(/[^\w+#.-]/g, "").slice(0, 32);
    if (clean) {
      code.className = `language-${clean}`;
      pre.dataset.language = clean;
    }
  }
  pre.append(code);
  out.push(pre);
  return i + 1; // past the closing fence (or past the end when it is still being written)
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) ||
    (listItem(line)?.indent ?? 99) <= 3;
}

function parseParagraph(lines, start, out) {
  const body = [lines[start]];
  let i = start + 1;
  while (i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i])) {
    body.push(lines[i]);
    i += 1;
  }
  out.push(el("p", parseInline(body.map((l) => l.trim()).join("\n"))));
  return i;
}

function listItem(line) {
  const m = LIST_ITEM.exec(line);
  if (!m) return null;
  // "-" alone or "1." alone only count as items when followed by text or at a line end.
  const ordered = /\d/.test(m[2]);
  const text = m[3] ?? "";
  return {
    indent: m[1].length,
    ordered,
    number: ordered ? parseInt(m[2], 10) : null,
    text,
    // Where the item's content starts: continuation lines are indented to here.
    contentIndent: m[1].length + m[2].length + 1,
  };
}

function indentOf(line) {
  return line.length - line.trimStart().length;
}

function parseList(lines, start, first, out) {
  const list = document.createElement(first.ordered ? "ol" : "ul");
  if (first.ordered && first.number !== 1) list.start = first.number;
  const items = [];
  let current = null;
  let loose = false;
  let i = start;
  while (i < lines.length) {
    const line = lines[i];
    const item = listItem(line);
    if (item && item.ordered === first.ordered && item.indent < first.contentIndent) {
      current = { lines: [item.text], contentIndent: item.contentIndent };
      items.push(current);
      i += 1;
      continue;
    }
    if (line.trim() === "") {
      // A blank line ends the list unless the next text continues an item.
      let j = i + 1;
      while (j < lines.length && lines[j].trim() === "") j += 1;
      if (j >= lines.length) break;
      const next = listItem(lines[j]);
      const continues = indentOf(lines[j]) >= current.contentIndent;
      const sibling = next && next.ordered === first.ordered && next.indent < first.contentIndent;
      if (!continues && !sibling) break;
      loose = true;
      for (let k = i; k < j; k += 1) current.lines.push("");
      i = j;
      continue;
    }
    if (indentOf(line) >= Math.min(current.contentIndent, first.indent + 2)) {
      current.lines.push(line.slice(Math.min(indentOf(line), current.contentIndent)));
      i += 1;
      continue;
    }
    if (!startsBlock(line) && current.lines[current.lines.length - 1] !== "") {
      current.lines.push(line.trim()); // a lazy continuation of the item's paragraph
      i += 1;
      continue;
    }
    break;
  }
  for (const { lines: body } of items) {
    const li = document.createElement("li");
    const blocks = parseBlocks(body);
    for (const block of blocks) {
      // Tight lists put the text straight into <li>, without a paragraph around it.
      if (!loose && block.tagName === "P") li.append(...block.childNodes);
      else li.append(block);
    }
    list.append(li);
  }
  out.push(list);
  return i;
}

// ----------------------------------------------------------------------------- inline

function el(tag, children) {
  const node = document.createElement(tag);
  for (const child of children) node.append(child);
  return node;
}

/** Parse inline Markdown into an array of nodes. */
export function parseInline(text, { links = true } = {}) {
  const out = [];
  let buffer = "";
  const flush = () => {
    if (!buffer) return;
    // Newlines inside a paragraph are kept as line breaks: chat text is written that way.
    const parts = buffer.split("\n");
    parts.forEach((part, n) => {
      if (n > 0) out.push(document.createElement("br"));
      if (part) out.push(document.createTextNode(part));
    });
    buffer = "";
  };
  let i = 0;
  while (i < text.length) {
    const ch = text[i];
    if (ch === "\\" && i + 1 < text.length && ESCAPABLE.includes(text[i + 1])) {
      buffer += text[i + 1];
      i += 2;
      continue;
    }
    if (ch === "`") {
      const span = codeSpan(text, i);
      if (span) {
        flush();
        const code = document.createElement("code");
        code.textContent = span.content;
        out.push(code);
        i = span.end;
        continue;
      }
      const run = runLength(text, i, "`");
      buffer += text.slice(i, i + run);
      i += run;
      continue;
    }
    // ![alt](url) is shown as a link to the image: nothing is loaded from the text.
    const isImage = ch === "!" && text[i + 1] === "[";
    if (links && (ch === "[" || isImage)) {
      const link = linkAt(text, isImage ? i + 1 : i);
      if (link) {
        flush();
        const href = safeHref(link.href);
        const label = parseInline(link.label, { links: false });
        if (href) {
          const a = el("a", label);
          a.href = href;
          a.rel = "noopener noreferrer";
          a.target = "_blank";
          out.push(a);
        } else {
          // Not an http(s) link (javascript:, data:, relative...): keep only its text.
          out.push(el("span", label));
        }
        i = link.end;
        continue;
      }
    }
    if (links && (ch === "h" || ch === "H") && /^https?:\/\//i.test(text.slice(i, i + 8)) &&
        (i === 0 || !/[\w/]/.test(text[i - 1]))) {
      const url = bareUrl(text, i);
      const href = url && safeHref(url);
      if (href) {
        flush();
        const a = document.createElement("a");
        a.href = href;
        a.rel = "noopener noreferrer";
        a.target = "_blank";
        a.textContent = url;
        out.push(a);
        i += url.length;
        continue;
      }
    }
    if (ch === "*" || ch === "_" || ch === "~") {
      const emphasis = emphasisAt(text, i);
      if (emphasis) {
        flush();
        out.push(emphasis.node);
        i = emphasis.end;
        continue;
      }
      const run = runLength(text, i, ch);
      buffer += text.slice(i, i + run);
      i += run;
      continue;
    }
    buffer += ch;
    i += 1;
  }
  flush();
  return out;
}

function runLength(text, i, ch) {
  let n = 0;
  while (text[i + n] === ch) n += 1;
  return n;
}

function codeSpan(text, start) {
  const ticks = runLength(text, start, "`");
  let j = start + ticks;
  while (j < text.length) {
    const k = text.indexOf("`", j);
    if (k < 0) return null;
    const run = runLength(text, k, "`");
    if (run === ticks) {
      let content = text.slice(start + ticks, k).replace(/\n/g, " ");
      if (content.length > 2 && content.startsWith(" ") && content.endsWith(" ")) content = content.slice(1, -1);
      return { content, end: k + run };
    }
    j = k + run;
  }
  return null;
}

function linkAt(text, start) {
  // [label](href "optional title"); labels may contain `code` but not other brackets.
  let depth = 0;
  let j = start;
  for (; j < text.length; j += 1) {
    const c = text[j];
    if (c === "\\") j += 1;
    else if (c === "[") depth += 1;
    else if (c === "]") {
      depth -= 1;
      if (depth === 0) break;
    } else if (c === "\n" && text[j + 1] === "\n") return null;
  }
  if (j >= text.length || text[j + 1] !== "(") return null;
  const rest = /^\(\s*<?([^\s<>()]+(?:\([^\s()]*\)[^\s<>()]*)*)>?(?:\s+"[^"\n]*")?\s*\)/.exec(text.slice(j + 1));
  if (!rest) return null;
  return { label: text.slice(start + 1, j), href: rest[1], end: j + 1 + rest[0].length };
}

function bareUrl(text, start) {
  const m = /^https?:\/\/[^\s<>"'`]+/i.exec(text.slice(start));
  if (!m) return null;
  let url = m[0];
  // Trailing punctuation belongs to the sentence, and a ")" only to a URL that opened one.
  while (/[.,;:!?*_~]$/.test(url) || (url.endsWith(")") && count(url, "(") < count(url, ")"))) {
    url = url.slice(0, -1);
  }
  return url.length > "https://".length ? url : null;
}

function count(s, ch) {
  return s.split(ch).length - 1;
}

function emphasisAt(text, start) {
  const ch = text[start];
  const run = runLength(text, start, ch);
  const after = text[start + run];
  const before = start > 0 ? text[start - 1] : " ";
  if (after === undefined || /\s/.test(after)) return null; // an opener must touch its text
  if (ch === "_" && /\w/.test(before)) return null; // snake_case stays as it is
  if (ch === "~" && run !== 2) return null;
  const width = ch === "~" ? 2 : Math.min(run, 3);
  if (run !== width) return null;
  const close = findCloser(text, start + width, ch, width);
  if (close < 0) return null;
  const inner = parseInline(text.slice(start + width, close));
  let node;
  if (ch === "~") node = el("del", inner);
  else if (width === 1) node = el("em", inner);
  else if (width === 2) node = el("strong", inner);
  else node = el("strong", [el("em", inner)]);
  return { node, end: close + width };
}

function findCloser(text, from, ch, width) {
  let j = from;
  while (j < text.length) {
    const c = text[j];
    if (c === "\\") {
      j += 2;
      continue;
    }
    if (c === "`") {
      const span = codeSpan(text, j);
      j = span ? span.end : j + runLength(text, j, "`");
      continue;
    }
    if (c === "\n" && text[j + 1] === "\n") return -1;
    if (c === ch) {
      const run = runLength(text, j, ch);
      const afterClose = text[j + run];
      if (run === width && !/\s/.test(text[j - 1]) && j > from &&
          !(ch === "_" && afterClose !== undefined && /\w/.test(afterClose))) {
        return j;
      }
      j += run;
      continue;
    }
    j += 1;
  }
  return -1;
}
