"""Engine basics of the packaged model: load time (first start and later starts), prefill and decode
tokens/s, and how many tokens each turn of a greedy conversation prefills.

    python -m benchmarks.engine_basics [--threads N]

Prints a Markdown table. The first load converts the GGUF in a fresh data folder; a later load is
timed in a fresh process, as a server restart would see it.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import open_chatd
from chatd import config
from chatd.config import ModelSettings
from chatd.engine.model.runner import ModelRunner
from chatd.service.types import GenerationOptions, TurnResult

QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which one is bigger?"]
_LATER_LOAD = """
import sys, time
from pathlib import Path
from chatd.config import ModelSettings
from chatd.engine.model.runner import ModelRunner
started = time.monotonic()
ModelRunner.load(ModelSettings(threads=int(sys.argv[2])), Path(sys.argv[1]))
print(time.monotonic() - started)
"""


def _prefill_and_decode(runner: ModelRunner, context: int, decode_tokens: int = 32) -> tuple[float, float]:
    ids = [1000 + i % 40000 for i in range(context)]
    cache = runner.new_cache()
    cache.reserve(context + decode_tokens)
    started = time.monotonic()
    for start in range(0, context, 256):
        logits = runner.prefill(cache, ids[start:start + 256])
    prefill_s = time.monotonic() - started
    token = int(logits.argmax())
    started = time.monotonic()
    for _ in range(decode_tokens):
        token = int(runner.decode([cache], [token])[0].argmax())
    return context / prefill_s, decode_tokens / (time.monotonic() - started)


async def _turns(runner: ModelRunner, data_dir: Path) -> list[TurnResult]:
    settings = config.load(env={}, overrides={"data_dir": str(data_dir)})
    results = []
    async with open_chatd(settings, runner) as core:
        session = await core.sessions.create()
        for question in QUESTIONS:
            result = await core.sessions.send(session.session_id, question,
                                              GenerationOptions(temperature=0, max_tokens=48)).wait()
            assert isinstance(result, TurnResult)
            results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        started = time.monotonic()
        runner = ModelRunner.load(ModelSettings(threads=args.threads), data)
        first = time.monotonic() - started
        later = float(subprocess.run([sys.executable, "-c", _LATER_LOAD, str(data), str(args.threads)],
                                     check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        rows = [("model load, first start (GGUF conversion)", f"{first:.1f} s"),
                ("model load, later start (fresh process)", f"{later:.1f} s")]
        for context in (512, 2048):
            prefill, decode = _prefill_and_decode(runner, context)
            rows.append((f"prefill at {context} tokens", f"{prefill:.0f} tok/s"))
            rows.append((f"decode at {context} context", f"{decode:.1f} tok/s"))
        for n, result in enumerate(asyncio.run(_turns(runner, Path(tmp) / "turns")), start=1):
            u = result.usage
            rows.append((f"turn {n}: prefilled / cached / input tokens",
                         f"{u.prefill_tokens} / {u.cached_tokens} / {u.input_tokens}"))
    print(f"{runner.info.name}, {runner.info.dtype_name} on {runner.info.device}, "
          f"torch threads {torch.get_num_threads()}\n")
    print("| measure | value |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
