"""The draft service: `specmesh.v1.Draft` around one `DraftRuntime`.

The wire sends each extend as *rotated* ids (``committed[1:] + [pending]``, one per feature row,
draft.proto); the runtime takes ``committed`` and ``pending`` apart. The service keeps, per
request, its committed length and pending token (`Position`), which gives back ``committed[0]``
of every later extend (the previous pending token) and checks ``start_position``. Only the first
prompt token of a request never reaches the draft; it is taken to be the target's BOS id,
which is what tokenizers put there (feature drafters never read it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh import __version__
from specmesh.draft_service.feature_drafter import ExtendInput
from specmesh.draft_service.runtime import DraftRuntime
from specmesh.router.clients import DraftStepResult
from specmesh.router.service_common import ModelServicer, ServiceHost
from specmesh.router.wire import status_pb
from specmesh.runtime.codec import DTYPE_NAMES, TensorError, join_hidden_states
from specmesh.runtime.config import parse_dtype
from specmesh.runtime.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    SpecmeshError,
    UnknownRequestError,
)
from specmesh.runtime.models.causal_lm import AuxLayers
from specmesh.runtime.tree import Tree
from specmesh.target_service.llava import target_model_config
from specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name
WARMUP_RID = "__warmup__"
FEATURE_FIELDS = {"aux": "aux_hidden", "hidden": "hidden", "hidden_pre_norm": "hidden"}


class PreconditionError(SpecmeshError):
    grpc_code = "FAILED_PRECONDITION"


@dataclass
class Position:
    committed_len: int  # draft rows committed (start_position of the next extend)
    pending: int  # the last extended token: the next tree's root


class DraftServicer(ModelServicer, draft_pb2_grpc.DraftServicer):
    response_type = draft_pb2.DraftStepResponse

    def __init__(self, host: ServiceHost) -> None:
        super().__init__(host)
        self.positions: dict[str, Position] = {}

    async def attach(self, runtime: DraftRuntime, warm_up=None) -> None:
        target = target_model_config(runtime.cfg.target_dir)  # plain or LLaVA checkpoint
        info = runtime.info()
        self.feature = info.feature
        self.hidden_size = target.hidden_size
        self.aux_layer_ids = (
            AuxLayers(info.aux_layer_ids, info.aux_convention).capture_points(target.num_layers)
            if info.aux_layer_ids
            else ()
        )  # in the target's "input" numbering, comparable with TargetInfo.aux_layer_ids
        dtype = parse_dtype(runtime.cfg.dtype) if runtime.cfg.dtype else target.dtype
        self.feature_dtype = target.dtype  # the target sends features in its own dtype
        self.feature_width = target.hidden_size * max(1, len(self.aux_layer_ids))
        self.info_pb = draft_pb2.DraftInfo(
            draft_kind=runtime.cfg.kind,
            model_path=runtime.cfg.draft_dir or "",
            dtype=DTYPE_NAMES[dtype],
            vocab_size=target.vocab_size,
            draft_vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            aux_layer_ids=self.aux_layer_ids,
            needs_aux_hidden=info.feature == "aux",
            needs_hidden=info.feature in ("hidden", "hidden_pre_norm"),
            needs_hidden_pre_norm=info.feature == "hidden_pre_norm",
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
        field = FEATURE_FIELDS.get(self.feature)
        dev = runtime.cfg.device
        feats = (
            torch.zeros(2, self.feature_width, dtype=self.feature_dtype, device=dev)
            if field
            else None
        )
        res = runtime.step([ExtendInput(WARMUP_RID, [0, 1], 1, feats, new=True)], propose=True)
        runtime.release(WARMUP_RID)
        if WARMUP_RID in res.errors:
            raise res.errors[WARMUP_RID]

    # -- hooks (worker thread, under the lock) ---------------------------------------------------
    def info(self, runtime: DraftRuntime) -> draft_pb2.DraftInfo:
        return self.info_pb

    def release_one(self, runtime: DraftRuntime, rid: str) -> bool:
        if self.positions.pop(rid, None) is None:
            return False
        runtime.release(rid)
        return True

    def run_batch(self, runtime: DraftRuntime, chunks: list) -> list:
        req = chunks[0]
        work = req.WhichOneof("work")
        if work == "extend":
            results = self._extend(runtime, req.extend, [c.extend.states for c in chunks])
        elif work == "propose":
            self._check_params(req.propose.params)
            results = self._propose(runtime, req.propose.requests)
        else:
            raise InvalidRequestError("DraftStepRequest has no work (extend or propose)")
        return [draft_pb2.DraftStepResponse(results=results)]

    # -- work ------------------------------------------------------------------------------------
    def _extend(self, runtime: DraftRuntime, batch, states: list) -> list:
        if batch.propose_after:
            self._check_params(batch.propose_params)
        rows = [len(r.token_ids) for r in batch.requests]
        features, mm = self._decode_states(runtime, states, rows)
        inputs, errors, start = [], {}, 0
        for r, n in zip(batch.requests, rows, strict=True):
            cut = lambda t: None if t is None else t[start : start + n]  # noqa: B023
            try:
                inputs.append(self._extend_input(r, cut(features), cut(mm)))
            except SpecmeshError as e:
                errors[r.request_id] = e
            start += n
        res = runtime.step(inputs, batch.propose_after) if inputs else DraftStepResult()
        for inp in inputs:
            if inp.rid not in res.errors:
                pos = self.positions.setdefault(inp.rid, Position(0, inp.next_token))
                pos.committed_len += len(inp.committed_ids)
                pos.pending = inp.next_token
        errors.update(res.errors)
        return [
            self._result(r.request_id, errors.get(r.request_id), res.trees.get(r.request_id))
            for r in batch.requests
        ]

    def _extend_input(self, r, features, mm) -> ExtendInput:
        rid, ids = r.request_id, list(r.token_ids)
        if not ids:
            raise InvalidRequestError(f"request {rid!r}: extend with no tokens")
        pos = self.positions.get(rid)
        if r.starts_request:
            if pos is not None:
                raise DuplicateRequestError(f"request {rid!r} already has draft state")
            first = r.first_token_id
        else:
            if pos is None:
                raise UnknownRequestError(f"unknown request id {rid!r}")
            if r.start_position != pos.committed_len:
                raise PreconditionError(
                    f"request {rid!r}: start_position {r.start_position} but the draft holds "
                    f"{pos.committed_len} rows"
                )
            first = pos.pending
        committed = [first, *ids[:-1]]
        return ExtendInput(rid, committed, ids[-1], features, mm, mm is not None, r.starts_request)

    def _decode_states(self, runtime: DraftRuntime, states: list, rows: list[int]):
        """The batch's feature rows and multimodal embeddings, checked against the requests."""
        if not any(s.ByteSize() for s in states):
            return None, None
        row_counts, tensors = join_hidden_states(states)
        if row_counts != rows:
            raise InvalidRequestError(
                f"states.row_counts {row_counts} do not match the requests' token counts {rows}"
            )
        field = FEATURE_FIELDS.get(self.feature)
        features, mm = tensors.get(field) if field else None, tensors.get("mm_input_embeds")
        _check_rows(field, features, self.feature_width)
        _check_rows("mm_input_embeds", mm, self.hidden_size)
        dev = runtime.cfg.device  # decoded on the host; the drafter runs on its device
        return tuple(None if t is None else t.to(dev) for t in (features, mm))

    def _propose(self, runtime: DraftRuntime, requests) -> list:
        ok, errors = [], {}
        for r in requests:
            pos = self.positions.get(r.request_id)
            if pos is None:
                errors[r.request_id] = UnknownRequestError(f"unknown request id {r.request_id!r}")
            elif r.root_token_id != pos.pending:
                errors[r.request_id] = PreconditionError(
                    f"request {r.request_id!r}: root {r.root_token_id} is not the last extended "
                    f"token {pos.pending}"
                )
            else:
                ok.append(r)
        rids, roots = [r.request_id for r in ok], [r.root_token_id for r in ok]
        trees = runtime.drafter.propose(rids, roots) if ok else []
        by_rid = {r.request_id: t for r, t in zip(ok, trees, strict=True)}
        return [
            self._result(r.request_id, errors.get(r.request_id), by_rid.get(r.request_id))
            for r in requests
        ]

    def _result(
        self, rid: str, error: Exception | None, tree: Tree | None
    ) -> draft_pb2.DraftResult:
        if error is not None:
            return draft_pb2.DraftResult(request_id=rid, status=status_pb(error))
        result = draft_pb2.DraftResult(
            request_id=rid, committed_len=self.positions[rid].committed_len
        )
        if tree is not None:
            result.tree.CopyFrom(
                common_pb2.DraftTree(tokens=tree.tokens.tolist(), parents=tree.parents.tolist())
            )
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


def _check_rows(name: str | None, t: torch.Tensor | None, width: int) -> None:
    if t is not None and (t.dim() != 2 or t.shape[1] != width):
        raise TensorError(f"tensor '{name}': shape {list(t.shape)}, expected [rows, {width}]")


def make_servicer(address: str, max_message_bytes: int) -> DraftServicer:
    return DraftServicer(ServiceHost(SERVICE_NAME, address, max_message_bytes))
