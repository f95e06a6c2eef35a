"""`Engine`: the whole system in one process (target + optional draft + router loop).

engine = Engine("models/demo/target", draft_model="models/demo/draft", draft_kind="eagle3")
results = engine.generate(["def fib(n):"], SamplingParams(max_new_tokens=32))

Either model may be a Hugging Face id instead (`specmesh.hub.resolve_model`: its cached snapshot,
downloaded when online; a revision other than main: resolve it first and pass the path).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from specmesh.draft_service.runtime import load_draft
from specmesh.hub import resolve_model
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import Logprob
from specmesh.router.core import RouterCore
from specmesh.router.detokenizer import Detokenizer
from specmesh.router.in_process import InProcessDraft, InProcessTarget
from specmesh.router.policy import SpeculationPolicy
from specmesh.router.request import Request
from specmesh.router.router_config import RouterConfig
from specmesh.router.tokenizer import load_tokenizer, resolve_seed
from specmesh.target_service.runtime import TargetRuntime


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    accept_lens: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # draft tree nodes verified, roots excluded
    num_predraft_hits: int = 0  # rounds whose tree was pre-drafted (`DraftConfig.predraft`)
    draft_wait_s: float = 0.0  # time the rounds waited on the draft for their trees
    # Set when the request asked for them (`SamplingParams.logprobs` / ``prompt_logprobs``), as
    # the core streamed them: one per token_ids entry; one per prompt token (None for the first).
    logprobs: list[Logprob] | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    # A learning draft's weight versions the trees came from, in the order first used
    # (`draft_service.online`); empty when the draft does not learn
    draft_weight_versions: list[int] = field(default_factory=list)

    @property
    def mean_accept_len(self) -> float:
        return sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else 0.0


class Engine:
    def __init__(
        self,
        target_model: str | Path,
        *,
        draft_model: str | Path | None = None,
        draft_kind: str | None = None,
        spec: SpecParams = SpecParams(),
        target_config: dict | None = None,
        draft_config: dict | None = None,
        router_config: RouterConfig = RouterConfig(),
    ) -> None:
        # A local directory or a Hugging Face id (its cached snapshot; downloaded when online)
        target_model = resolve_model(target_model, what="target model")
        if draft_model is not None:
            draft_model = resolve_model(draft_model, what="draft model")
        tcfg = {"cuda_graph_tree_sizes": (spec.num_draft_tokens,), **(target_config or {})}
        self.target = TargetRuntime(TargetConfig(model_dir=target_model, **tcfg))
        self.tokenizer = load_tokenizer(target_model)
        self.draft = None
        if draft_kind is not None:
            dcfg = DraftConfig(
                kind=draft_kind,
                draft_dir=draft_model,
                target_dir=target_model,
                spec=spec,
                **(draft_config or {}),
            )
            self.draft = load_draft(dcfg, target_model=self.target.model)
            self.draft.share_grammars(self.target.grammars)  # compiled once, by the target
        self.router_config = router_config
        # What the speculation policy measured, kept from one `generate` to the next.
        self.policy = SpeculationPolicy(router_config.speculation)

    def generate(
        self,
        prompts: list[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] = SamplingParams(),
        *,
        disable_speculation: bool = False,
        images: list[list[bytes]] | None = None,
        exclude_from_learning: bool = False,
    ) -> list[GenerationResult]:
        """Run every prompt to completion (continuous batching); results in prompt order.
        ``images[i]`` are the encoded images of prompt i (multimodal targets);
        ``exclude_from_learning`` keeps the prompts out of the draft's online learning."""
        n = len(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        reqs = [
            self.make_request(p, sp, not disable_speculation, imgs, not exclude_from_learning)
            for p, sp, imgs in zip(prompts, params, images or [[]] * n, strict=True)
        ]
        return asyncio.run(self._generate_all(reqs))

    async def _generate_all(self, reqs: list[Request]) -> list[GenerationResult]:
        threaded = self.router_config.micro_batches(remote=False) > 1  # see `in_process`
        drafts = [InProcessDraft(self.draft, threaded=threaded)] if self.draft else []
        target = InProcessTarget(self.target, threaded=threaded)
        core = RouterCore([target], drafts, self.router_config, self.policy)
        await core.start()
        try:
            return list(await asyncio.gather(*(self._collect(core, r) for r in reqs)))
        finally:
            await core.stop()

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        speculate: bool = True,
        images: list[bytes] | None = None,
        learn: bool = True,
    ) -> Request:
        if isinstance(prompt, list):
            ids = list(prompt)
        else:
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        return Request(
            uuid.uuid4().hex,
            ids,
            replace(params, seed=resolve_seed(params.seed)),
            self.target.model_config.eos_token_ids,
            speculate and self.draft is not None,
            learn,
            images=list(images or []),
            detok=Detokenizer(self.tokenizer, ids),
        )

    @staticmethod
    async def _collect(core: RouterCore, req: Request) -> GenerationResult:
        logprobs = [] if req.params.logprobs is not None else None
        prompt_logprobs = None
        async for chunk in core.generate(req):
            if logprobs is not None:
                logprobs += chunk.logprobs or []
            if chunk.prompt_logprobs is not None:
                prompt_logprobs = chunk.prompt_logprobs
        return GenerationResult(
            req.rid,
            req.prompt_ids,
            req.output_ids,
            req.text,
            req.finish_reason or "abort",
            req.accept_lens,
            req.num_draft_tokens,
            req.num_predraft_hits,
            req.draft_wait_s,
            logprobs,
            prompt_logprobs,
            req.draft_weight_versions,
        )
