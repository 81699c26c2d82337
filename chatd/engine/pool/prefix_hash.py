"""The chain hash that names a full block of KV by everything before it: ``H(parent hash, its token ids, salt)``,
where the parent is the previous block's hash (:func:`root_hash` for the first block). Equal hashes mean the same
token ids from position 0 to the block's end under the same salt (the model fingerprint), hence the same K/V."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

HASH_BYTES = 16


def root_hash(salt: bytes, namespace: bytes = b"") -> bytes:
    """The parent hash of a sequence's first block under ``salt`` and ``namespace``."""
    digest = hashlib.blake2b(b"chatd-kv-root\0", digest_size=HASH_BYTES)
    digest.update(len(salt).to_bytes(8, "little"))
    digest.update(salt)
    digest.update(namespace)
    return digest.digest()


def chain_hash(parent: bytes, token_ids: Sequence[int], salt: bytes) -> bytes:
    """The hash of one full block: ``H(parent hash, its token ids, salt)`` (128-bit BLAKE2b).

    ``parent`` has a fixed length, so the parts cannot run into each other.
    """
    digest = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    digest.update(array("q", token_ids).tobytes())
    digest.update(salt)
    return digest.digest()
