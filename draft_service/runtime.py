"""The draft service's runtime: one drafter of a configured kind, behind `step` and `release`.

Draft kinds (``--draft-kind``): ``eagle3`` (SpecForge / SGLang EAGLE-3), ``eagle`` (EAGLE-1/2),
``mtp`` (multi-layer EAGLE: one layer and one KV pool per step), ``standalone`` (a small causal LM
with the target's tokenizer) and ``ngram`` (prompt lookup, no model).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from specmesh.draft_service.drafter import SpecParams, TreeDrafter
from specmesh.draft_service.feature_drafter import ExtendInput
from specmesh.runtime.errors import SpecmeshError
from specmesh.runtime.graph_runner import graphs_enabled
from specmesh.runtime.tree import Tree

if TYPE_CHECKING:
    from specmesh.router.clients import DraftInfo, DraftStepResult

DRAFT_KINDS = ("eagle3", "eagle", "mtp", "standalone", "ngram")


class Drafter(Protocol):
    feature: str
    spec: SpecParams

    def extend(self, inputs: list[ExtendInput]) -> None:
        """Validate every input, then forward them as one batch (state changes only after)."""

    def propose(self, rids: list[str], roots: list[int]) -> list[Tree]: ...
    def release(self, rid: str) -> None: ...


@dataclass(frozen=True)
class DraftConfig:
    kind: str
    draft_dir: str | None  # None for ngram
    target_dir: str  # embeddings / LM head / tokenizer come from the target checkpoint
    spec: SpecParams = SpecParams()
    dtype: str | None = None
    device: str = "cpu"
    attention_backend: str = "torch"
    num_kv_slots: int = 65536
    max_requests: int = 256
    max_context: int = 4096
    aux_convention: str = "output"  # how the checkpoint numbers eagle_aux_hidden_state_layer_ids
    cuda_graph: bool = True  # draft decode steps in CUDA graphs (CUDA + triton/flashinfer only)
    cuda_graph_max_bs: int = 32  # largest captured batch; bigger batches run eagerly


class DraftRuntime:
    def __init__(self, cfg: DraftConfig, drafter: Drafter) -> None:
        self.cfg, self.drafter = cfg, drafter

    def info(self) -> DraftInfo:
        from specmesh.router.clients import DraftInfo

        aux = getattr(self.drafter, "aux_layers", None)
        s = self.cfg.spec
        return DraftInfo(
            kind=self.cfg.kind,
            feature=self.drafter.feature,
            aux_layer_ids=tuple(aux.layer_ids) if aux else (),
            aux_convention=aux.convention if aux else "input",
            num_steps=s.num_steps,
            topk=s.topk,
            num_draft_tokens=s.num_draft_tokens,
        )

    def step(self, extends: list[ExtendInput], propose: bool = True) -> DraftStepResult:
        """Extend every request over its newly committed tokens, then (optionally) propose the
        next tree for each. One bad request does not fail the others."""
        from specmesh.router.clients import DraftStepResult

        result = DraftStepResult()
        good = list(extends)
        try:
            self.drafter.extend(good)  # the batched fast path
        except SpecmeshError:
            good = self._extend_one_by_one(extends, result.errors)
        if propose and good:
            trees = self.drafter.propose([i.rid for i in good], [i.next_token for i in good])
            result.trees = {i.rid: t for i, t in zip(good, trees, strict=True)}
        return result

    def _extend_one_by_one(self, extends: list[ExtendInput], errors: dict) -> list[ExtendInput]:
        """Isolate the bad requests of a failed batch. Drafters validate before they forward, so
        a failed batch changed nothing but the rows it added for new requests: drop those."""
        for inp in extends:
            if inp.new:
                with contextlib.suppress(KeyError):
                    self.drafter.release(inp.rid)
        good = []
        for inp in extends:
            try:
                self.drafter.extend([inp])
                good.append(inp)
            except SpecmeshError as e:
                errors[inp.rid] = e
        return good

    def release(self, rid: str) -> None:
        self.drafter.release(rid)


def load_draft(cfg: DraftConfig, target_model: torch.nn.Module | None = None) -> DraftRuntime:
    """Build the drafter for ``cfg.kind``. ``target_model`` (in-process) shares the target's
    embedding and head; otherwise they are read from ``cfg.target_dir``."""
    from specmesh.draft_service import kinds

    if cfg.kind not in DRAFT_KINDS:
        raise ValueError(f"unknown draft kind {cfg.kind!r}; choose from {', '.join(DRAFT_KINDS)}")
    if cfg.kind != "ngram" and not (cfg.draft_dir and Path(cfg.draft_dir).is_dir()):
        raise ValueError(f"draft kind {cfg.kind!r} needs --draft-model DIR, got {cfg.draft_dir!r}")
    drafter = kinds.build_drafter(cfg, target_model)
    if isinstance(drafter, TreeDrafter) and graphs_enabled(
        cfg.cuda_graph, cfg.device, cfg.attention_backend
    ):
        drafter.enable_step_graphs("cuda-graph", cfg.cuda_graph_max_bs)
    return DraftRuntime(cfg, drafter)
