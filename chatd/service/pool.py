"""Which cache a stateless request (the OpenAI API) runs in: the pool of ephemeral caches.

A stateless caller resends the whole conversation with every request. Each request runs in an ephemeral
cache of the KV manager (no stored session behind it, never snapshotted, freed when evicted), chosen here:

* **Take over**: when an idle pool cache of the same caller holds a conversation that the new prompt
  continues (the prompt starts with the whole prompt of the request that last ran there; only that
  request's reply may differ, as a resent reply need not tokenise back to the generated ids), the request
  runs in that cache, in place: the usual "resend with one more turn" costs no copy and leaves one cache
  per conversation, not one per request. Another conversation of the same caller that shares only a
  system prompt does not qualify, so it never cuts this one.
* **Otherwise a new pool cache**: the KV manager then starts it from the longest prefix of the prompt
  already in the KV pool (``[cache] share_prefixes``, at least ``share_min_tokens``): a shared system
  prompt, a conversation that forks or regenerates its last reply. The new cache references those blocks
  (a partly filled last one is copied); the cache they came from stays intact for whoever owns it.

Pool caches live as long as the KV manager keeps them resident (LRU under the same budget as every
session); an evicted one is forgotten here on the next look-up.

Callers are told apart by a partition key (the API key and the request's ``user``): only the caller's own
caches are taken over, so no request can cut another caller's cache. Reuse across callers happens only
through the KV manager's prefix sharing, which ``share_prefixes = false`` turns off; a reply reveals it only
as a count (``cached_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from chatd.domain import new_session_id
from chatd.kv.manager import KVManager
from chatd.kv.prefix import agrees_at, common_prefix_len


class PrefixPool:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self._owners: dict[str, tuple[str, int]] = {}
        """Pool cache id -> (the partition key of the caller it belongs to, the prompt length of the request
        that last ran in it)."""

    def __len__(self) -> int:
        return len(self._owners)

    def choose(self, prompt_ids: Sequence[int], partition: str, *, busy: Callable[[str], bool]) -> str:
        """The cache id to run ``prompt_ids`` in: an idle pool cache of ``partition`` whose last prompt the
        prompt continues (the one sharing the longest prefix), else a new id. ``busy`` says whether a cache
        is running a turn.

        The caller must claim the id before awaiting anything, so that no other request takes it over."""
        for cache_id in [c for c in self._owners if not self.kv.is_resident(c) and not busy(c)]:
            del self._owners[cache_id]
        best, best_len = None, 0
        for cache_id, (owner, last_prompt_len) in self._owners.items():
            if owner != partition or busy(cache_id):
                continue
            # It must share the whole last prompt, and more than the best so far: ``need`` ids. Where it
            # differs from the prompt at the last of them it cannot, and its ids are not compared whole (a
            # caller with many conversations would otherwise pay for all of them at every request).
            need = max(last_prompt_len, best_len + 1)
            ids = self.kv.cached_ids_view(cache_id)
            if ids is None or not agrees_at(ids, prompt_ids, need):
                continue
            shared = common_prefix_len(ids, prompt_ids)
            if shared >= need:
                best, best_len = cache_id, shared
        cache_id = best if best is not None else new_session_id()
        self._owners[cache_id] = (partition, len(prompt_ids))
        return cache_id

    def owns(self, cache_id: str) -> bool:
        return cache_id in self._owners
