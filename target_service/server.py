"""The target service: `specmesh.v1.Target` around one `TargetRuntime`, as a codec.

Step answers each batch once, in arrival order (the shared loop, request ownership and stream
cleanup are `ModelServicer`'s). The stream's handshake (`StreamOpen`) names the feature its
answers carry; the target configures itself for it or ends the stream with a precise status.
A bad request fails alone (a Status in its TargetResult, and the target drops its state); a bad
batch fails with TargetStepResponse.status. Per-request state (sampling parameters, sample
offset, pending token) is the runtime's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from specmesh import __version__
from specmesh.protocol.codec import DEFAULT_MAX_MESSAGE_BYTES
from specmesh.protocol.errors import InvalidRequestError, SpecmeshError
from specmesh.protocol.features import Feature, FeatureSpec
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.shared_rows import RowRing
from specmesh.protocol.steps import PrefillInput, StepOutput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.rpc.held_batches import Hold
from specmesh.rpc.ownership import StreamOwner
from specmesh.rpc.security import model_name
from specmesh.rpc.service_common import (
    HandshakeInvalidError,
    ModelServicer,
    ServiceHost,
    StreamRefusedError,
)
from specmesh.rpc.tokenizer_files import MESSAGE_HEADROOM, TokenizerFiles, read_tokenizer_files
from specmesh.rpc.wire import (
    abort_with,
    logprobs_to_pb,
    needs_from_pb,
    readable_constraints,
    sampling_from_pb,
    status_pb,
)
from specmesh.runtime.codec import DTYPE_NAMES, split_hidden_states
from specmesh.target_service.runtime import TargetRuntime
from specmesh.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name
MAX_DRAFT_TOKENS = 64  # largest tree verify accepts (TargetInfo.max_draft_tokens)
WARMUP_RID = "__warmup__"


@dataclass
class _Batch:
    """One decoded batch: its request ids in order and the runtime's answer."""

    rids: list[str]
    out: StepOutput


class TargetServicer(ModelServicer, target_pb2_grpc.TargetServicer):
    response_type = target_pb2.TargetStepResponse
    result_type = target_pb2.TargetResult

    def __init__(
        self,
        host: ServiceHost,
        chunk_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        inline_step_ms: float | None = None,
    ) -> None:
        super().__init__(host, inline_step_ms)
        self.chunk_bytes = chunk_bytes
        self.needs: dict[int, FeatureSpec] = {}  # per open stream: what its drafts read
        # Per stream: the plain requests its last verify answered, to run ahead (`run_ahead`),
        # and the feature that verify returned.
        self.plain: dict[int, tuple[list[str], Feature]] = {}
        # GetTokenizer's answer, read from the checkpoint at the first call and kept: every
        # router of this target gets the same files and digest.
        self.tokenizer_files: TokenizerFiles | None = None

    async def GetTokenizer(self, request, context) -> target_pb2.TokenizerFiles:
        runtime = await self._ready(context)
        if self.tokenizer_files is None:
            max_bytes = self.host.max_message_bytes - MESSAGE_HEADROOM
            try:
                self.tokenizer_files = await asyncio.to_thread(
                    read_tokenizer_files, runtime.cfg.model_dir, max_bytes
                )
            except (SpecmeshError, OSError) as e:  # NOT_FOUND, RESOURCE_EXHAUSTED, unreadable
                await abort_with(context, e)
        return self.tokenizer_files.to_pb()

    # -- hooks (worker thread) -----------------------------------------------------------------
    def run_batch(self, runtime: TargetRuntime, stream: StreamOwner, chunks: list) -> list:
        req = chunks[0]  # target requests carry no tensors: one chunk
        work = req.WhichOneof("work")
        if work == "open":
            self._open(runtime, stream, needs_from_pb(req.open))
            if req.open.rows_in_shared_memory and stream.shared is None:
                stream.shared = _ring()
            return [target_pb2.TargetStepResponse()]
        if work is None:
            raise InvalidRequestError("TargetStepRequest has no work (prefill, decode or verify)")
        requests = getattr(req, work).requests
        rids = [r.request_id for r in requests]
        if len(set(rids)) != len(rids):
            raise InvalidRequestError(f"batch lists a request id twice: {rids}")
        if len(rids) > runtime.cfg.max_requests:
            raise InvalidRequestError(
                f"batch of {len(rids)} requests exceeds max_batch_size {runtime.cfg.max_requests}"
            )
        feature = self.needs.get(stream.id, FeatureSpec()).feature
        if req.skip_features and work != "prefill":  # no draft reads this batch's rows
            feature = Feature.NONE
        errors, run = {}, []
        for r in requests:
            new = work == "prefill" and not r.input_start  # a later piece continues its request
            error = self.owners.check(stream, r.request_id, new=new, release=runtime.release)
            if error is None:
                run.append(r)
            else:
                errors[r.request_id] = error
        out = self._run(runtime, work, run, feature)
        out.errors.update(errors)
        self.owners.settle(stream, [r.request_id for r in run], runtime.holds)
        if work != "prefill" and runtime.cfg.run_ahead:
            plain = [r.request_id for r in run if work == "decode" or len(r.tree.tokens) == 1]
            live = {sid: p for sid, p in self.plain.items() if sid in self.owners.streams}
            self.plain = {**live, stream.id: ([rid for rid in plain if rid in out.tokens], feature)}
        return self._response(req, _Batch(rids, out), feature, stream.shared)

    def _run(self, runtime: TargetRuntime, work: str, requests: list, feature: Feature):
        if work == "prefill":
            return self._prefill(runtime, requests, feature)
        if work == "decode":
            return runtime.decode([r.request_id for r in requests], feature)
        trees = [
            VerifyInput(r.request_id, DraftTree.of(r.tree.tokens, r.tree.parents))
            for r in requests
            if len(r.tree.tokens) <= MAX_DRAFT_TOKENS  # checked before any mask is built
        ]
        out = runtime.verify(trees, feature)
        for r in requests:
            if len(r.tree.tokens) > MAX_DRAFT_TOKENS:
                runtime.release(r.request_id)
                out.errors[r.request_id] = InvalidRequestError(
                    f"request {r.request_id!r}: tree of {len(r.tree.tokens)} nodes exceeds "
                    f"{MAX_DRAFT_TOKENS}"
                )
        return out

    def hold(self, runtime: TargetRuntime, chunks: list) -> Hold | None:
        """A prefill waits, off the step thread, until the grammars its requests ask for have
        compiled (`Grammars.compiling`), at most `COMPILE_TIMEOUT_S`; None when none is compiling.
        The batches behind it run meanwhile (`specmesh.rpc.held_batches`)."""
        req = chunks[0]
        if req.WhichOneof("work") != "prefill":
            return None
        requests = req.prefill.requests
        constraints = [r.sampling.constraint for r in requests if r.sampling.HasField("constraint")]
        ready = (
            runtime.grammars.compiling(readable_constraints(constraints)) if constraints else None
        )
        return None if ready is None else Hold([r.request_id for r in requests], ready)

    def follow_up(self, runtime: TargetRuntime, stream: StreamOwner) -> Callable[[], None] | None:
        """A verify of one-node trees was answered: decide those requests' next step now,
        while the router handles this one (`target_service.run_ahead`)."""
        plain, feature = self.plain.pop(stream.id, ([], Feature.NONE))
        if not plain:
            return None
        # with the feature that batch returned: the next one likely asks the same
        return functools.partial(self.run_soon, runtime.ahead.run, runtime, plain, feature)

    def _open(self, runtime: TargetRuntime, stream: StreamOwner, needs: FeatureSpec) -> None:
        """The handshake: serve ``needs`` unless its aux layers do not fit the model
        (INVALID_ARGUMENT) or another open stream reads different ones (FAILED_PRECONDITION:
        graphs bake one set in). Either refusal ends this stream alone."""
        try:
            aux = runtime.resolve_aux(needs)  # None unless the drafts read aux states
        except ValueError as e:
            raise HandshakeInvalidError(f"cannot serve {needs.describe()}: {e}") from None
        needs = FeatureSpec(needs.feature, aux)  # stored resolved: clashes compare real layers
        num_layers = runtime.model_config.num_layers
        points = lambda n: None if n.aux is None else n.aux.capture_points(num_layers)
        live = {sid: n for sid, n in self.needs.items() if sid in self.owners.streams}
        mine = points(needs)
        clash = [
            n for sid, n in live.items() if sid != stream.id and None not in (points(n), mine)
            and points(n) != mine
        ]  # fmt: skip
        if clash:
            raise StreamRefusedError(
                f"this target serves {clash[0].describe()} to another router stream; it cannot "
                f"also serve {needs.describe()} (one set of aux layers per target)"
            )
        runtime.configure(needs)
        self.needs = {**live, stream.id: needs}

    def info(self, runtime: TargetRuntime) -> target_pb2.TargetInfo:
        mc, cfg = runtime.model_config, runtime.cfg
        info = target_pb2.TargetInfo(
            model_path=model_name(cfg.model_dir),  # a name: never where the host keeps files
            architecture=mc.architecture,
            dtype=DTYPE_NAMES[mc.dtype],
            vocab_size=mc.vocab_size,
            hidden_size=mc.hidden_size,
            num_layers=mc.num_layers,
            aux_layer_ids=runtime.aux_points,  # empty until its config or a handshake names them
            max_context_len=cfg.max_context,
            max_batch_size=cfg.max_requests,
            max_tokens_per_batch=cfg.max_prefill_tokens,
            max_draft_tokens=MAX_DRAFT_TOKENS,
            eos_token_ids=mc.eos_token_ids,
            supports_images=runtime.mm is not None,
            image_token_id=runtime.mm.image_token_id if runtime.mm is not None else 0,
            attention_backend=cfg.attention_backend,
            device=cfg.device,
            max_message_bytes=self.host.max_message_bytes,
            chunk_bytes=self.chunk_bytes,
            version=__version__,
            tensor_parallel_size=cfg.tensor_parallel_size,
            occupancy=self.occupancy(runtime, runtime.num_requests, runtime.kv_slots()),
        )
        info.occupancy.prefix_cached_tokens = runtime.prefixes.num_tokens
        return info

    # -- codec -------------------------------------------------------------------------------------
    def _prefill(self, runtime: TargetRuntime, requests, feature: Feature) -> StepOutput:
        inputs, errors = [], {}
        for r in requests:
            try:
                params = sampling_from_pb(r.sampling, default_max_new=1)
            except SpecmeshError as e:
                errors[r.request_id] = e
                continue
            inp = PrefillInput(
                r.request_id, list(r.input_ids), params, r.sample_offset, images=list(r.images)
            )
            inp.input_start, inp.more_input = r.input_start, r.more_input  # a piece of an input
            inputs.append(inp)
        out = runtime.prefill(inputs, feature)
        out.errors.update(errors)
        return out

    def _response(self, req, batch: _Batch, feature: Feature, ring: RowRing | None) -> list:
        out, results, row_counts = batch.out, [], []
        for rid in batch.rids:
            error = out.errors.get(rid)
            if error is not None:
                results.append(target_pb2.TargetResult(request_id=rid, status=status_pb(error)))
            else:
                results.append(
                    target_pb2.TargetResult(
                        request_id=rid,
                        token_ids=out.tokens[rid],
                        prompt_ids=out.prompt_ids.get(rid, []),
                        logprobs=logprobs_to_pb(out.logprobs.get(rid, [])),
                        prompt_logprobs=logprobs_to_pb(out.prompt_logprobs.get(rid, [])),
                        cached_tokens=out.cached_tokens.get(rid, 0),
                    )
                )
            row_counts.append(0 if error is not None else out.row_counts[rid])
        tensors = {
            feature.wire_field or "hidden": out.features,
            "mm_input_embeds": out.mm_input_embeds if req.return_mm_input_embeds else None,
        }
        states = split_hidden_states(row_counts, tensors, self.chunk_bytes, ring)
        first = target_pb2.TargetStepResponse(results=results, states=states[0])
        return [first, *(target_pb2.TargetStepResponse(states=s) for s in states[1:])]


def _ring() -> RowRing | None:
    """A stream's shared-memory ring, or None (its rows then come inline, which the router
    reads as well) where the host cannot hold one: no /dev/shm, or too little room there (a
    container's default is 64 MiB)."""
    try:
        return RowRing()
    except OSError as e:
        log.warning("rows of this stream go on the wire: no shared-memory ring here (%s)", e)
        return None


def warm_up(runtime: TargetRuntime) -> None:
    """One real prefill + decode, then release: the first user request pays no first-call cost."""
    params = SamplingParams(max_new_tokens=1)
    out = runtime.prefill([PrefillInput(WARMUP_RID, [0, 1], params)])
    if out.errors:
        raise out.errors[WARMUP_RID]
    runtime.decode([WARMUP_RID])
    runtime.release(WARMUP_RID)


def make_servicer(
    address: str, max_message_bytes: int, inline_step_ms: float | None = None
) -> TargetServicer:
    host = ServiceHost(SERVICE_NAME, address, max_message_bytes)
    chunk_bytes = min(DEFAULT_MAX_MESSAGE_BYTES, max_message_bytes // 2)
    return TargetServicer(host, chunk_bytes=chunk_bytes, inline_step_ms=inline_step_ms)
