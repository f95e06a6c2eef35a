"""The draft service: `specmesh.v1.Draft` around one `DraftRuntime`, as a codec.

Extends travel with their committed ids unrotated and the target's pending token; the drafter
rotates them (DESIGN.md §2) and the runtime keeps every per-request number (committed length,
pending token). Request ownership by stream and the stream's cleanup are `ModelServicer`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from specmesh import __version__
from specmesh.draft_service.runtime import DraftRuntime
from specmesh.protocol.codec import CodecError
from specmesh.protocol.errors import InvalidRequestError
from specmesh.protocol.features import Feature
from specmesh.protocol.shared_rows import RegionMaps
from specmesh.protocol.steps import DraftStepResult, ExtendInput
from specmesh.protocol.trees import DraftTree
from specmesh.rpc.held_batches import Hold, batch_rids
from specmesh.rpc.ownership import StreamOwner
from specmesh.rpc.security import model_name
from specmesh.rpc.service_common import ModelServicer, ServiceHost, log_failure
from specmesh.rpc.wire import constraint_from_pb, needs_to_pb, readable_constraints, status_pb
from specmesh.runtime.codec import DTYPE_NAMES, DTYPES, all_finite, join_hidden_states
from specmesh.runtime.config import parse_dtype
from specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc

if TYPE_CHECKING:
    from specmesh.draft_service.online.learner import LearnerStats

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name
WARMUP_RID = "__warmup__"


class DraftServicer(ModelServicer, draft_pb2_grpc.DraftServicer):
    response_type = draft_pb2.DraftStepResponse
    result_type = draft_pb2.DraftResult

    async def attach(self, runtime: DraftRuntime, warm_up=None) -> None:
        target, info = runtime.target, runtime.info()
        self.feature = info.needs.feature
        aux = info.needs.aux
        self.feature_width = target.hidden_size * (len(aux.layer_ids) if aux else 1)
        dtype = parse_dtype(runtime.cfg.dtype) if runtime.cfg.dtype else target.dtype
        self.info_pb = draft_pb2.DraftInfo(
            draft_kind=runtime.cfg.kind,
            model_path=model_name(runtime.cfg.draft_dir or ""),  # a name, never a path
            dtype=DTYPE_NAMES[dtype],
            vocab_size=target.vocab_size,
            draft_vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            **needs_to_pb(info.needs),
            num_steps=info.num_steps,
            topk=info.topk,
            num_draft_tokens=info.num_draft_tokens,
            max_context_len=runtime.cfg.max_context,
            max_batch_size=runtime.cfg.max_requests,
            attention_backend="" if runtime.cfg.kind == "ngram" else runtime.cfg.attention_backend,
            device=runtime.cfg.device,
            max_message_bytes=self.host.max_message_bytes,
            version=__version__,
        )
        await super().attach(runtime, warm_up or self.warm_up)

    def warm_up(self, runtime: DraftRuntime) -> None:
        """One extend + propose of a throwaway request on zero features, then release."""
        feats = None
        if self.feature is not Feature.NONE:
            dtype, dev = runtime.target.dtype, runtime.cfg.device
            feats = torch.zeros(2, self.feature_width, dtype=dtype, device=dev)
        res = runtime.step([ExtendInput(WARMUP_RID, [0, 1], 1, feats, new=True)], propose=True)
        runtime.release(WARMUP_RID)
        if WARMUP_RID in res.errors:
            raise res.errors[WARMUP_RID]

    # -- hooks (worker thread) -----------------------------------------------------------------
    def info(self, runtime: DraftRuntime) -> draft_pb2.DraftInfo:
        info = draft_pb2.DraftInfo()
        info.CopyFrom(self.info_pb)
        info.occupancy.CopyFrom(self.occupancy(runtime, len(runtime.live), runtime.kv_slots()))
        if runtime.learner is not None:
            info.online_learning.CopyFrom(_online_learning(runtime.learner.stats()))
        return info

    def run_batch(self, runtime: DraftRuntime, stream: StreamOwner, chunks: list) -> list:
        req = chunks[0]
        work = req.WhichOneof("work")
        res = DraftStepResult()
        if work == "extend":
            batch = req.extend
            if batch.propose_after:
                self._check_params(batch.propose_params)
            states = [c.extend.states for c in chunks]
            inputs = self._extend_inputs(runtime, stream, batch, states, res.errors)
            self._drop_refused(runtime, stream, batch.requests, res.errors)
            requests, propose = batch.requests, batch.propose_after
        elif work == "propose":
            self._check_params(req.propose.params)
            inputs = [ExtendInput(r.request_id, [], r.root_token_id) for r in req.propose.requests]
            requests, propose = req.propose.requests, True
        elif work == "prepare":  # its compiles ran while it was held (`hold`): nothing to do
            _check_prepare(runtime, req.prepare)
            return [draft_pb2.DraftStepResponse()]
        else:
            raise InvalidRequestError("DraftStepRequest has no work (extend, propose or prepare)")
        rids = [r.request_id for r in requests]
        if len(set(rids)) != len(rids):
            raise InvalidRequestError(f"batch lists a request id twice: {rids}")
        run = []
        for inp in inputs:
            error = self.owners.check(stream, inp.rid, new=inp.new, release=runtime.release)
            if error is None:
                run.append(inp)
            else:
                res.errors[inp.rid] = error
        done = runtime.step(run, propose) if work == "extend" else runtime.propose(run)
        res.trees, res.errors = done.trees, {**res.errors, **done.errors}
        self.owners.settle(stream, [i.rid for i in run], runtime.holds)
        results = [self._result(rid, res.errors.get(rid), res.trees.get(rid)) for rid in rids]
        for r in results:
            r.predrafted = r.request_id in done.predrafted
            if r.request_id in done.versions:
                r.weight_version = done.versions[r.request_id]
        return [draft_pb2.DraftStepResponse(results=results)]

    def hold(self, runtime: DraftRuntime, chunks: list) -> Hold | None:
        """An extend that starts constrained requests, or a prepare, waits off the step thread
        until the grammars it names have compiled (`Grammars.compiling`), at most
        `COMPILE_TIMEOUT_S`: the step thread keeps drafting the other batches meanwhile
        (`specmesh.rpc.held_batches`). A prepare starts the compiles before the requests'
        extends arrive, while the target compiles the same grammars for their prefill."""
        req = chunks[0]
        work = req.WhichOneof("work")
        if work == "extend":
            constraints = [r.constraint for r in req.extend.requests if r.HasField("constraint")]
        elif work == "prepare" and not _too_many(runtime, req.prepare):
            constraints = list(req.prepare.constraints)
        else:  # a prepare past the limit is refused as it runs, having compiled nothing
            return None
        if not constraints:
            return None
        ready = runtime.grammars.grammars.compiling(readable_constraints(constraints))
        return None if ready is None else Hold(batch_rids(req), ready)

    def before_step(self, runtime: DraftRuntime) -> None:
        """A batch arrived: the pre-draft budget measures how long it waits behind one."""
        if runtime.ahead is not None:
            runtime.budget.arrived()

    def follow_up(self, runtime: DraftRuntime, stream: StreamOwner) -> Callable[[], None] | None:
        """What the step left for after its answer (pre-drafting) runs on the worker then, while
        the target verifies; the stream's next batch queues behind it."""
        if runtime.pending is None:
            return None
        return lambda: self._submit(runtime.after_step).add_done_callback(log_failure)

    # -- codec -------------------------------------------------------------------------------------
    def _extend_inputs(
        self, runtime: DraftRuntime, stream: StreamOwner, batch, states: list, errors: dict
    ) -> list[ExtendInput]:
        """The batch's extends; one whose constraint is unreadable goes to ``errors`` alone."""
        rows = [len(r.token_ids) for r in batch.requests]
        features, mm = self._decode_states(runtime, states, rows, stream)
        inputs, start = [], 0
        for r, n in zip(batch.requests, rows, strict=True):
            cut = lambda t: None if t is None else t[start : start + n]  # noqa: B023
            try:
                constraint = constraint_from_pb(r.constraint) if r.HasField("constraint") else None
            except InvalidRequestError as e:
                errors[r.request_id] = e
            else:
                inputs.append(
                    ExtendInput(
                        r.request_id, list(r.token_ids), r.next_token_id, cut(features), cut(mm),
                        is_multimodal=r.multimodal, new=r.starts_request, constraint=constraint,
                        output_start=r.output_start, learn=not r.exclude_from_learning,
                    )
                )  # fmt: skip
            start += n
        return inputs

    def _drop_refused(
        self, runtime: DraftRuntime, stream: StreamOwner, requests, refused: dict
    ) -> None:
        """A continuing request refused while decoding is freed, as any whose step fails."""
        for r in requests:
            held = r.request_id in refused and not r.starts_request
            if held and not self.owners.check(stream, r.request_id, new=False,
                                              release=runtime.release):  # fmt: skip
                runtime.release(r.request_id)
        self.owners.settle(stream, list(refused), runtime.holds)

    def _decode_states(
        self, runtime: DraftRuntime, states: list, rows: list[int], stream: StreamOwner
    ):
        """The batch's feature rows and multimodal embeddings, checked against the requests;
        rows in shared memory are read through the stream's own mappings."""
        if not any(s.ByteSize() for s in states):
            return None, None
        if stream.shared is None:
            stream.shared = RegionMaps()
        row_counts, tensors = join_hidden_states(states, stream.shared)
        if row_counts != rows:
            raise InvalidRequestError(
                f"states.row_counts {row_counts} do not match the requests' token counts {rows}"
            )
        field = self.feature.wire_field
        features, mm = tensors.get(field) if field else None, tensors.get("mm_input_embeds")
        # the target's activations: its checkpoint dtype, or this draft's own when it overrides
        dtypes = {runtime.target.dtype, DTYPES[self.info_pb.dtype]}
        for name, t, width in [
            (field, features, self.feature_width),
            ("mm_input_embeds", mm, runtime.target.hidden_size),
        ]:
            _check_rows(name, t, width, dtypes, rows)
        dev = runtime.cfg.device  # decoded on the host; the drafter runs on its device
        return tuple(None if t is None else t.to(dev) for t in (features, mm))

    def _result(
        self, rid: str, error: Exception | None, tree: DraftTree | None
    ) -> draft_pb2.DraftResult:
        if error is not None:
            return draft_pb2.DraftResult(request_id=rid, status=status_pb(error))
        result = draft_pb2.DraftResult(request_id=rid)
        if tree is not None:
            result.tree.CopyFrom(common_pb2.DraftTree(tokens=tree.tokens, parents=tree.parents))
        return result

    def _check_params(self, params: draft_pb2.ProposeParams) -> None:
        """Per-batch tree shapes are not served: 0 (the default) or this draft's own values."""
        own = self.info_pb
        asked = (params.num_steps, params.topk, params.num_draft_tokens)
        served = (own.num_steps, own.topk, own.num_draft_tokens)
        if any(a not in (0, s) for a, s in zip(asked, served, strict=True)):
            raise InvalidRequestError(
                f"tree shape (num_steps, topk, num_draft_tokens) {asked} differs from the served "
                f"{served}; send 0 for the default"
            )


def _check_rows(
    name: str | None,
    t: torch.Tensor | None,
    width: int,
    dtypes: set[torch.dtype],
    rows: list[int],
) -> None:
    """Shape, dtype (never cast silently) and finite values of a feature tensor ``[rows,
    width]``; non-finite rows are named by the requests they belong to (batch positions, rows
    grouped request by request)."""
    if t is None:
        return
    if t.dim() != 2 or t.shape[1] != width:
        raise CodecError(f"tensor '{name}': shape {list(t.shape)}, expected [rows, {width}]")
    if t.dtype not in dtypes:
        want = " or ".join(sorted(DTYPE_NAMES[d] for d in dtypes))
        raise CodecError(
            f"tensor '{name}': dtype {DTYPE_NAMES[t.dtype]}, expected the target's {want}"
        )
    if all_finite(t):  # one pass; else find the rows
        return
    bad_rows = (~torch.isfinite(t).all(dim=1)).nonzero().flatten()
    bounds = torch.tensor(rows).cumsum(0)
    positions = torch.searchsorted(bounds, bad_rows, right=True).unique().tolist()
    raise CodecError(
        f"tensor '{name}': {len(bad_rows)} of {t.shape[0]} rows hold NaN or Inf, in the "
        f"requests at batch positions {positions[:8]}"
    )


def _too_many(runtime: DraftRuntime, batch: draft_pb2.PrepareBatch) -> bool:
    """A prepare names at most as many constraints as a batch has requests."""
    return len(batch.constraints) > runtime.cfg.max_requests


def _check_prepare(runtime: DraftRuntime, batch: draft_pb2.PrepareBatch) -> None:
    if _too_many(runtime, batch):
        raise InvalidRequestError(
            f"PrepareBatch names {len(batch.constraints)} constraints; at most "
            f"{runtime.cfg.max_requests} (the draft's max_batch_size)"
        )


def make_servicer(
    address: str, max_message_bytes: int, inline_step_ms: float | None = None
) -> DraftServicer:
    return DraftServicer(ServiceHost(SERVICE_NAME, address, max_message_bytes), inline_step_ms)


def _online_learning(stats: LearnerStats) -> draft_pb2.OnlineLearning:
    """GetInfo's view of the learner: the figures its Prometheus series give."""
    return draft_pb2.OnlineLearning(
        weight_version=stats.version, updates=stats.num_updates,
        rollbacks=stats.num_rollbacks, resets=stats.num_resets,
        tokens_observed=stats.tokens_observed, train_tokens=stats.train_tokens,
        heldout_tokens=stats.heldout_tokens, heldout_accept_before=stats.heldout_before,
        heldout_accept_after=stats.heldout_after, heldout_accept_shipped=stats.heldout_shipped,
        last_loss=stats.last_loss, train_seconds=stats.train_seconds,
    )  # fmt: skip
