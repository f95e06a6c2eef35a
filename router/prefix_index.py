"""What each target replica's prefix cache probably holds, as the router saw it: the prompt
blocks it sent there (`protocol.prefix_keys`), least recently used forgotten first. It is a
guess (a replica evicts on its own), which is all placement needs: a wrong guess costs a cache
miss, never a wrong token.

Cache-aware placement (`router.placement`, ``--placement cache-aware``, SGLang's ``cache_aware``
router in spirit): among the replicas with room whose load is within ``slack`` of the least
loaded, the one whose index matches the longest prefix of the prompt; ties go to the less
loaded; a prefix no replica matches goes to the one remembering the fewest blocks, so distinct
prefixes spread evenly. Requests sharing a system prompt then gather where its KV is, and a
replica's cache holds fewer distinct prefixes.
"""

from __future__ import annotations

from collections import OrderedDict

from specmesh.protocol.prefix_keys import prefix_keys

BLOCK_TOKENS = 16  # the services' default --prefix-block-size
MAX_BLOCKS = 1 << 16  # per replica: 1 M prompt tokens remembered


class PrefixIndex:
    def __init__(self, max_blocks: int = MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def match(self, keys: list[bytes]) -> int:
        """How many leading blocks of ``keys`` the replica was sent."""
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def add(self, keys: list[bytes]) -> None:
        for key in keys:
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


def prompt_keys(prompt_ids: list[int]) -> list[bytes]:
    """Keys of the prompt's blocks a replica could reuse (its last token is always computed)."""
    return prefix_keys(prompt_ids, BLOCK_TOKENS, (len(prompt_ids) - 1) // BLOCK_TOKENS)
