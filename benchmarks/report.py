"""The run's report: one JSON file (every raw number) and a Markdown rendering of it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.common import FIGURE_KEYS, Figure


def _cell(value: Any, fmt: str) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (int, float)):
        try:
            return fmt.format(value)
        except (ValueError, TypeError):
            return str(value)
    return str(value).replace("|", "\\|")


def table_markdown(fig: Figure) -> str:
    """The figure's rows as a Markdown table, in its column order and formats."""
    header = "| " + " | ".join(c.header for c in fig.columns) + " |"
    rule = "| " + " | ".join("---" for _ in fig.columns) + " |"
    body = ["| " + " | ".join(_cell(row.get(c.key, ""), c.fmt) for c in fig.columns) + " |" for row in fig.rows]
    return "\n".join([header, rule, *body])


def _context_lines(report: dict[str, Any]) -> list[str]:
    m, s, model, st = report["machine"], report["software"], report["model"], report["settings"]
    gpu = f", GPU {m['gpu']}" if m.get("gpu") else ""
    threads = st["threads"] or "torch default"
    return [
        f"- mode: **{report['mode']}** (plan `{report['plan']['name']}`), {report['started_at']}, "
        f"{report['duration_s']:.0f} s in all",
        f"- machine: {m['cpu_model']} ({m.get('cpu_features', 'features not recorded')}), {m['cpu_cores']} cores "
        f"({m['cpu_cores_usable']} usable), "
        f"{m['ram_bytes'] / 2**30:.1f} GiB RAM{gpu}; load average at start {m['load_average_1m']}",
        f"- software: Python {s['python']}, torch {s['torch']}, transformers {s['transformers']}, "
        f"numpy {s['numpy']}, zstandard {s['zstandard']}, chatd {s['chatd']} ({s['git_commit'][:12] or 'no git'})",
        f"- model: {model['name']} ({model['parameters'] / 1e6:.0f}M parameters), dtype {model['dtype']}, "
        f"device {model['device']}, KV {model['kv_bytes_per_token']} B/token",
        f"- threads: setting {threads} (torch.get_num_threads() = {st['torch_threads']}, "
        f"interop {st['torch_interop_threads']})",
    ]


def render_markdown(report: dict[str, Any], figures: dict[str, Figure], peer_text: str) -> str:
    lines = ["# chatd benchmark results", ""]
    lines += _context_lines(report)
    if report.get("note"):
        lines += ["", f"> {report['note']}"]
    lines += ["", "## Summary", "", "| figure | measure | value |", "| --- | --- | --- |"]
    for number, key in enumerate(FIGURE_KEYS, start=1):
        fig = figures.get(key)
        if fig is None:
            continue
        if fig.status != "ok":
            lines.append(f"| {number}. {fig.title} | {fig.status} | {fig.error.splitlines()[0] if fig.error else ''} |")
            continue
        for item in fig.headline:
            lines.append(f"| {number}. {fig.title} | {item['label']} | {_cell(item['value'], item['fmt'])} |")
    for number, key in enumerate(FIGURE_KEYS, start=1):
        fig = figures.get(key)
        if fig is None:
            continue
        lines += ["", f"## {number}. {fig.title}", "", fig.measures, ""]
        if fig.status != "ok":
            lines += [f"**{fig.status}**:", "", "```", fig.error.strip()[-2000:], "```"]
            continue
        lines.append(table_markdown(fig))
        for note in fig.notes:
            lines += ["", f"Note: {note}"]
        lines += ["", f"({fig.elapsed_s:.1f} s)"]
    lines += ["", "## Peer: llama.cpp llama-server", "", peer_text.rstrip()]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, report: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "results.json"
    md_path = out_dir / "results.md"
    # NaN/inf are written as such (not hidden): the completeness test rejects them.
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path
