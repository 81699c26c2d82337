"""A session resuming after eviction, ~2,400 tokens of history, the packaged model in process: time to
first token of its next turn when it comes back from its own blocks still in the KV pool (an idle
eviction, nothing read) vs from its snapshot on disk (an operator's eviction), vs a turn whose cache
was never evicted. Greedy, the median of a few sessions.

    python -m benchmarks.resume [--sessions 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile

from chatd import config
from chatd.service.core import Chatd
from chatd.service.types import GenerationOptions, TurnResult
from devtools.models import ROOT


async def _turn(core: Chatd, session_id: str, text: str) -> TurnResult:
    result = await core.sessions.send(session_id, text, GenerationOptions(temperature=0, max_tokens=4)).wait()
    assert isinstance(result, TurnResult), result
    return result


async def _evict_as_idle(core: Chatd, session_id: str) -> None:
    # Idle eviction on demand: a moment's idle limit for one tick of the background work.
    kept = core.kv.settings
    core.kv.settings = kept.model_copy(update={"idle_evict_s": 0.01})
    try:
        await asyncio.sleep(0.05)
        await core.kv.tick()
    finally:
        core.kv.settings = kept
    assert not core.kv.is_resident(session_id), "the session was not evicted"


async def run(num_sessions: int) -> dict[str, list[float]]:
    words = " ".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))).split()
    ttft: dict[str, list[float]] = {"never evicted": [], "from the pool": [], "from disk": []}
    with tempfile.TemporaryDirectory() as scratch:
        settings = config.load(env={}, overrides={
            "data_dir": scratch, "cache": {"persist_idle_s": 0, "idle_evict_s": 0, "restore_min_tokens": 0}})
        async with Chatd.open(settings, background=False) as core:
            for i in range(num_sessions):
                sid = (await core.sessions.create()).session_id
                await _turn(core, sid, " ".join(words[i * 50:i * 50 + 1400]) + " Summarise.")
                ttft["never evicted"].append((await _turn(core, sid, "Again, shorter.")).usage.ttft_ms)
                await _evict_as_idle(core, sid)
                back = await _turn(core, sid, "And once more.")
                assert back.usage.cache_tier == "device", back.usage
                ttft["from the pool"].append(back.usage.ttft_ms)
                assert await core.sessions.evict(sid)
                disk = await _turn(core, sid, "One last time.")
                assert disk.usage.cache_tier == "disk", disk.usage
                ttft["from disk"].append(disk.usage.ttft_ms)
            assert core.counters.num_resumes_from_pool == num_sessions
    return ttft


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    args = parser.parse_args(argv)
    ttft = asyncio.run(run(args.sessions))
    print(f"TTFT of the next turn, ~2,400 history tokens, median of {args.sessions} sessions")
    print("| the session's cache | TTFT ms |")
    print("| --- | --- |")
    for name, values in ttft.items():
        print(f"| {name} | {statistics.median(values):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
