"""A draft's prefix cache of its own KV rows (`runtime.prefix_cache` keyed for the draft kind).

A draft row may depend on tokens after its own position: an EAGLE row t pairs the target's
feature at t with token t + 1, and an MTP draft's layer l row t reads token t + l + 1. So
blocks are keyed by their tokens and the ``lookahead`` tokens after them (1 for EAGLE / EAGLE-3,
the layers a round runs for MTP, 0 for a standalone LM, whose row t is token t alone), and a
block joins the cache only once those tokens are committed: the shifted pairing is exact by
construction, and a row that holds a guess (MTP's later layers at the end of an extend) is
never cached. Prompts with images are not cached (their rows hold image embeddings).
"""

from __future__ import annotations

from specmesh.protocol.steps import ExtendInput
from specmesh.runtime.prefix_cache import PrefixCache


class DraftPrefixes(PrefixCache):
    def start(self, inp: ExtendInput, ids: list[int]) -> None:
        """A starting extend over ``ids``: its new row begins with the cached rows of their
        longest cached prefix (the request is in the KV cache, nothing reserved)."""
        if inp.is_multimodal:
            return
        match = self.match(ids, None)
        if match.num_tokens:
            self.attach(inp.rid, match)

    def keep(self, inp: ExtendInput, ids: list[int]) -> None:
        """After a starting extend committed the rows of ``ids``: their full blocks join."""
        if inp.new and not inp.is_multimodal:
            self.insert(inp.rid, ids, None, None)
