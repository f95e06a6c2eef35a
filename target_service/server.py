"""The target service: `specmesh.v1.Target` around one `TargetRuntime`.

Step answers each batch once, in arrival order (the shared loop is `ModelServicer`). A bad
request fails alone (a Status in its TargetResult, and the target drops its state); a bad batch
fails with TargetStepResponse.status; the stream itself fails only on broken framing.

Per request the service keeps what the wire does not repeat on every verify: the sampling
parameters and the offset of the next sampled token (prefill's sample_offset + tokens since).
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh import __version__
from specmesh.router.service_common import ModelServicer, ServiceHost
from specmesh.router.wire import sampling_from_pb, status_pb
from specmesh.runtime.codec import DEFAULT_MAX_MESSAGE_BYTES, DTYPE_NAMES, split_hidden_states
from specmesh.runtime.errors import InvalidRequestError, SpecmeshError, UnknownRequestError
from specmesh.runtime.sampling import SamplingParams
from specmesh.runtime.tree import Tree
from specmesh.target_service.runtime import TargetRuntime
from specmesh.target_service.steps import PrefillInput, StepOutput, VerifyInput
from specmesh.v1 import target_pb2, target_pb2_grpc

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["Target"].full_name
MAX_DRAFT_TOKENS = 64  # largest tree verify accepts (TargetInfo.max_draft_tokens)
WARMUP_RID = "__warmup__"


@dataclass
class Session:
    params: SamplingParams
    next_offset: int  # output index of the next sampled token (seeded sampling)


class TargetServicer(ModelServicer, target_pb2_grpc.TargetServicer):
    response_type = target_pb2.TargetStepResponse

    def __init__(self, host: ServiceHost, chunk_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        super().__init__(host)
        self.chunk_bytes = chunk_bytes
        self.sessions: dict[str, Session] = {}

    # -- hooks (worker thread, under the lock) ---------------------------------------------------
    def run_batch(self, runtime: TargetRuntime, chunks: list) -> list:
        req = chunks[0]  # target requests carry no tensors: one chunk
        work = req.WhichOneof("work")
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
        runtime.set_feature(_feature(req))
        if work == "prefill":
            out = self._prefill(runtime, requests)
        else:
            out = self._verify(runtime, requests, decode=work == "decode")
        return self._response(req, rids, out)

    def release_one(self, runtime: TargetRuntime, rid: str) -> bool:
        self.sessions.pop(rid, None)
        try:
            runtime.release(rid)
        except KeyError:
            return False
        return True

    def info(self, runtime: TargetRuntime) -> target_pb2.TargetInfo:
        mc, cfg = runtime.model_config, runtime.cfg
        return target_pb2.TargetInfo(
            model_path=cfg.model_dir,
            architecture=mc.architecture,
            dtype=DTYPE_NAMES[mc.dtype],
            vocab_size=mc.vocab_size,
            hidden_size=mc.hidden_size,
            num_layers=mc.num_layers,
            aux_layer_ids=runtime.aux_layers.capture_points(mc.num_layers),
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
        )

    # -- work ------------------------------------------------------------------------------------
    def _prefill(self, runtime: TargetRuntime, requests) -> StepOutput:
        inputs, errors = [], {}
        for r in requests:
            try:
                params = sampling_from_pb(r.sampling, default_max_new=1)
            except SpecmeshError as e:
                errors[r.request_id] = e
                continue
            inputs.append(
                PrefillInput(
                    r.request_id, list(r.input_ids), params, r.sample_offset, images=list(r.images)
                )
            )
        out = runtime.prefill(inputs) if inputs else StepOutput()
        out.errors.update(errors)
        for inp in inputs:
            if inp.rid not in out.errors:
                self.sessions[inp.rid] = Session(inp.params, inp.sample_offset + 1)
        return out

    def _verify(self, runtime: TargetRuntime, requests, *, decode: bool) -> StepOutput:
        inputs, errors = [], {}
        for r in requests:
            try:
                tree = (
                    Tree.chain([r.token_id])
                    if decode
                    else Tree.from_parents(list(r.tree.tokens), list(r.tree.parents))
                )
                inputs.append(self._verify_input(runtime, r.request_id, tree))
            except SpecmeshError as e:
                errors[r.request_id] = e
                self.release_one(runtime, r.request_id)  # a failed request loses its state
        out = runtime.verify(inputs) if inputs else StepOutput()
        out.errors.update(errors)
        for inp in inputs:
            self.sessions[inp.rid].next_offset += len(out.tokens[inp.rid])
        return out

    def _verify_input(self, runtime: TargetRuntime, rid: str, tree: Tree) -> VerifyInput:
        """Check one tree against the request's state, so that a bad one fails alone."""
        session = self.sessions.get(rid)
        if session is None:
            raise UnknownRequestError(f"unknown request id {rid!r}")
        if tree.num_nodes > MAX_DRAFT_TOKENS:
            raise InvalidRequestError(
                f"request {rid!r}: tree of {tree.num_nodes} nodes exceeds {MAX_DRAFT_TOKENS}"
            )
        runtime.check_ids(rid, tree.tokens.tolist(), what="draft tree")
        pending = runtime.pending[rid]
        if int(tree.tokens[0]) != pending:
            raise InvalidRequestError(
                f"request {rid!r}: tree root {int(tree.tokens[0])} is not the pending token {pending}"
            )
        return VerifyInput(rid, tree, session.params, session.next_offset)

    def _response(self, req, rids: list[str], out: StepOutput) -> list:
        results, row_counts = [], []
        for rid in rids:
            error = out.errors.get(rid)
            if error is not None:
                results.append(target_pb2.TargetResult(request_id=rid, status=status_pb(error)))
            else:
                results.append(
                    target_pb2.TargetResult(
                        request_id=rid,
                        token_ids=out.tokens[rid],
                        prompt_ids=out.prompt_ids.get(rid, []),
                    )
                )
            row_counts.append(0 if error is not None else out.row_counts[rid])
        tensors = {
            "aux_hidden" if req.return_aux_hidden else "hidden": out.features,
            "mm_input_embeds": out.mm_input_embeds if req.return_mm_input_embeds else None,
        }
        states = split_hidden_states(row_counts, tensors, self.chunk_bytes)
        first = target_pb2.TargetStepResponse(results=results, states=states[0])
        return [first, *(target_pb2.TargetStepResponse(states=s) for s in states[1:])]


def _feature(req) -> str:
    """The runtime feature a batch's return_* flags ask for (TargetRuntime.set_feature)."""
    if req.return_aux_hidden and req.return_hidden:
        raise InvalidRequestError("return_aux_hidden and return_hidden are exclusive")
    if req.return_hidden:
        return "hidden_pre_norm" if req.hidden_pre_norm else "hidden"
    return "aux" if req.return_aux_hidden else "none"


def warm_up(runtime: TargetRuntime) -> None:
    """One real prefill + decode, then release: the first user request pays no first-call cost."""
    params = SamplingParams(max_new_tokens=1)
    out = runtime.prefill([PrefillInput(WARMUP_RID, [0, 1], params)])
    if out.errors:
        raise out.errors[WARMUP_RID]
    runtime.decode([WARMUP_RID], [params], [1])
    runtime.release(WARMUP_RID)


def make_servicer(address: str, max_message_bytes: int) -> TargetServicer:
    host = ServiceHost(SERVICE_NAME, address, max_message_bytes)
    return TargetServicer(host, chunk_bytes=min(DEFAULT_MAX_MESSAGE_BYTES, max_message_bytes // 2))
