// Formatting of numbers, sizes and times for people (not for tests: tests read data attributes).

const numberFormat = new Intl.NumberFormat();

export function formatCount(n) {
  return numberFormat.format(n);
}

export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined) return "–";
  if (bytes < 1024) return `${bytes} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let value = bytes / 1024;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value >= 100 ? value.toFixed(0) : value.toFixed(1)} ${units[unit]}`;
}

export function formatMs(ms) {
  if (ms === null || ms === undefined) return "–";
  if (ms < 10) return `${ms.toFixed(1)} ms`;
  if (ms < 1000) return `${Math.round(ms)} ms`;
  return `${(ms / 1000).toFixed(2)} s`;
}

export function formatPercent(ratio) {
  return `${(ratio * 100).toFixed(1)}%`;
}

const relative = new Intl.RelativeTimeFormat(undefined, { numeric: "auto" });

/** "3 minutes ago" style text for an ISO timestamp or epoch milliseconds. */
export function formatRelative(when, now = Date.now()) {
  const t = typeof when === "number" ? when : Date.parse(when);
  if (Number.isNaN(t)) return "";
  const seconds = Math.round((t - now) / 1000);
  const steps = [
    [60, "second"],
    [60, "minute"],
    [24, "hour"],
    [7, "day"],
    [4.35, "week"],
    [12, "month"],
    [Infinity, "year"],
  ];
  let value = seconds;
  for (const [size, unit] of steps) {
    if (Math.abs(value) < size) return relative.format(Math.round(value), unit);
    value /= size;
  }
  return "";
}

export function formatClock(when) {
  const d = new Date(when);
  if (Number.isNaN(d.getTime())) return "";
  return d.toLocaleTimeString(undefined, { hour: "2-digit", minute: "2-digit" });
}

/** Same rule as the server's title: whitespace collapsed, first 60 characters. */
export function titleFrom(text) {
  return text.split(/\s+/).filter(Boolean).join(" ").slice(0, 60);
}
