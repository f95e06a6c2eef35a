"""Keys of prompt prefixes, shared by the services' prefix caches (`runtime.prefix_cache`) and the
router's cache-aware placement (`router.prefix_index`): a block of tokens is keyed by a hash
chained over it and every block before it, so one key names a whole prefix."""

from __future__ import annotations

import hashlib


def block_key(parent: bytes | None, tokens: tuple[int, ...] | list[int]) -> bytes:
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


def prefix_keys(ids: list[int], block_size: int, num_blocks: int) -> list[bytes]:
    """The keys of the first ``num_blocks`` whole blocks of ``ids``."""
    keys: list[bytes] = []
    for b in range(min(num_blocks, len(ids) // block_size)):
        keys.append(
            block_key(keys[-1] if keys else None, ids[b * block_size : (b + 1) * block_size])
        )
    return keys
