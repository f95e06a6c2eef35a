"""SMG's smg.worker.v1 messages to and from the router's own: translation only, no I/O.

    generation_request(msg, eos_ids)   an smg GenerateRequest as the specmesh.v1 GenerateRequest
                                       that means the same; the router then builds and checks it
                                       as any Generation request (`GenerationServicer`)
    Completion.answer(chunk)           one core `Chunk` as the smg responses it makes: a
                                       GenerateStreamChunk of the new tokens (streaming only),
                                       then, on the last chunk, one GenerateComplete
    Liveness.state()                   the WorkerHealthState of the router's readiness,
                                       draining and live replicas

SMG's chunks are deltas with running totals, and its GenerateComplete repeats the whole output
(ids and logprobs), so a Completion keeps what it has sent. What each field maps to and what is
refused: docs/smg.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.protocol.errors import InvalidRequestError, SpecmeshError
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import Logprob
from specmesh.router.request import Chunk
from specmesh.smg import worker_control_pb2 as control_pb2
from specmesh.smg import worker_inference_pb2 as smg_pb2
from specmesh.v1 import generation_pb2

# smg SamplingParams.constraint -> specmesh Constraint.kind (ebnf_grammar, structural_tag: none)
CONSTRAINT_KINDS = {"regex": "regex", "json_schema": "json_schema"}
# engine_parameters keys specmesh reads (each a bool): GenerateRequest fields of its own API
ENGINE_PARAMETERS = ("disable_speculation",)
States = control_pb2.WorkerHealthState


class UnsupportedError(SpecmeshError):
    """A field specmesh cannot serve, set: refused rather than ignored."""

    grpc_code = "UNIMPLEMENTED"


def generation_request(
    msg: smg_pb2.GenerateRequest, eos_token_ids: tuple[int, ...]
) -> generation_pb2.GenerateRequest:
    """The specmesh.v1 request meaning ``msg``. SMG's unset optionals are its engines' defaults
    (temperature 1, top_p 1, no top_k); specmesh's zero values mean the same except temperature
    (0 = greedy), so temperature is always written out."""
    _refuse_unsupported(msg)
    sp = msg.sampling_params
    if msg.return_logprob and msg.top_logprobs_num < 0:
        raise InvalidRequestError(f"top_logprobs_num must be >= 0, got {msg.top_logprobs_num}")
    stop_ids = list(sp.stop_token_ids)
    eos = sp.eos_token_id if sp.HasField("eos_token_id") else None
    if eos is not None and eos not in eos_token_ids and not sp.ignore_eos:
        stop_ids.append(eos)  # the gateway's EOS, which the target does not end on by itself
    constraint = sp.WhichOneof("constraint")
    sampling = generation_pb2.SamplingParams(
        max_new_tokens=sp.max_new_tokens,  # unset or 0: the router's default
        temperature=sp.temperature if sp.HasField("temperature") else 1.0,
        top_p=sp.top_p,
        top_k=sp.top_k,
        seed=sp.sampling_seed if sp.HasField("sampling_seed") else None,
        stop=sp.stop,
        stop_token_ids=stop_ids,
        ignore_eos=sp.ignore_eos,
        min_p=sp.min_p,
        repetition_penalty=sp.repetition_penalty,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        logit_bias=_logit_bias(sp.logit_bias),
        min_tokens=sp.min_new_tokens,
        logprobs=msg.top_logprobs_num if msg.return_logprob else None,
        constraint=generation_pb2.Constraint(
            kind=CONSTRAINT_KINDS[constraint], text=getattr(sp, constraint)
        )
        if constraint
        else None,
    )
    ids = list(msg.tokenized.input_ids)
    return generation_pb2.GenerateRequest(
        request_id=msg.request_id,
        prompt="" if ids else msg.tokenized.original_text,  # ids win; text only without them
        prompt_token_ids=ids,
        sampling=sampling,
        disable_speculation=_engine_parameters(sp).get("disable_speculation", False),
    )


def _refuse_unsupported(msg: smg_pb2.GenerateRequest) -> None:
    if not msg.HasField("tokenized"):  # an empty prompt would be refused later, less clearly
        raise InvalidRequestError("GenerateRequest.tokenized is required (the prompt)")
    if msg.return_logprob and msg.HasField("logprob_start_len") and msg.logprob_start_len >= 0:
        raise UnsupportedError("prompt logprobs (logprob_start_len >= 0): v1 cannot carry them")
    sp = msg.sampling_params
    if sp.n > 1:
        raise UnsupportedError(f"n={sp.n}: this worker runs one completion per request")
    if msg.HasField("data_parallel_rank"):
        raise UnsupportedError("data_parallel_rank: this worker has no attention-DP ranks")
    if msg.token_ids_logprob:
        raise UnsupportedError("token_ids_logprob is not supported (top_logprobs_num is)")
    constraint = sp.WhichOneof("constraint")
    if constraint is not None and constraint not in CONSTRAINT_KINDS:
        raise UnsupportedError(f"{constraint} constraints are not supported (regex, json_schema)")


def _logit_bias(bias) -> dict[int, float]:
    """Keys are token ids as decimal text; the values' ranges are checked with the rest."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) < 2**32):
            raise InvalidRequestError(f"logit_bias key {key!r} is not a token id")
        out[int(key)] = value
    return out


def _engine_parameters(sp: smg_pb2.SamplingParams) -> dict[str, bool]:
    if not sp.HasField("engine_parameters"):
        return {}
    params = dict(sp.engine_parameters.items())
    unknown = sorted(set(params) - set(ENGINE_PARAMETERS))
    if unknown:
        raise UnsupportedError(
            f"engine_parameters {unknown}: specmesh reads only {list(ENGINE_PARAMETERS)}"
        )
    bad = [k for k, v in params.items() if not isinstance(v, bool)]
    if bad:
        raise InvalidRequestError(f"engine_parameters {bad} must be booleans")
    return params


def matched_stop(
    output_ids: list[int], params: SamplingParams, eos_ids: tuple[int, ...], text: str | None
) -> dict:
    """GenerateComplete's ``matched_stop`` of a "stop" finish, as keyword arguments: the stop
    string found in ``text`` (the output decoded; None when there was no need to decode), else
    the last token when it is a stop token; ``{}`` when neither tells."""
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    found = [(i, s) for s in params.stop if text is not None and (i := text.find(s)) >= 0]
    if found:
        return {"matched_stop_str": min(found)[1]}
    last = output_ids[-1] if output_ids else None
    if last in stop_ids:
        return {"matched_token_id": last}
    if len(params.stop) == 1:  # a stop finish on no stop token: the one stop string
        return {"matched_stop_str": params.stop[0]}
    return {}


def output_logprobs(entries: list[Logprob]) -> smg_pb2.OutputLogProbs:
    return smg_pb2.OutputLogProbs(
        token_logprobs=[e.logprob for e in entries],
        token_ids=[e.token_id for e in entries],
        top_logprobs=[
            smg_pb2.TopLogProbs(values=[v for _, v in e.top], token_ids=[t for t, _ in e.top])
            for e in entries
        ],
    )


@dataclass
class Completion:
    """One request's answers on the smg stream (index 0: one completion per request)."""

    request_id: str
    prompt_tokens: int
    stream: bool  # False: only the GenerateComplete
    output_ids: list[int] = field(default_factory=list)  # sent so far
    logprobs: list[Logprob] | None = None  # sent so far, when asked for

    def answer(
        self, chunk: Chunk, cached_tokens: int, stop: dict | None = None
    ) -> list[smg_pb2.GenerateResponse]:
        """``stop``: `matched_stop` of a "stop" finish."""
        self.output_ids += chunk.token_ids
        if chunk.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *chunk.logprobs]
        counts = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": cached_tokens,
        }
        out = []
        if self.stream and chunk.token_ids:
            new = smg_pb2.GenerateStreamChunk(token_ids=chunk.token_ids, **counts)
            if chunk.logprobs is not None:
                new.output_logprobs.CopyFrom(output_logprobs(chunk.logprobs))
            out.append(smg_pb2.GenerateResponse(request_id=self.request_id, chunk=new))
        if chunk.finish_reason is not None:
            done = smg_pb2.GenerateComplete(
                output_ids=self.output_ids,
                finish_reason=chunk.finish_reason,
                **counts,
                **(stop or {}),
            )
            if self.logprobs is not None:
                done.output_logprobs.CopyFrom(output_logprobs(self.logprobs))
            out.append(smg_pb2.GenerateResponse(request_id=self.request_id, complete=done))
        return out


@dataclass(frozen=True)
class Liveness:
    """What the router's state says about serving (`WorkerControl.GetHealth`)."""

    ready: bool  # every target and draft answered at start; the core runs
    draining: bool  # SIGTERM or stop: new requests are refused, running ones finish
    live_targets: int  # replicas whose circuit breaker lets requests be placed
    num_targets: int
    live_drafts: int
    num_drafts: int

    def state(self) -> tuple[int, str]:
        """(WorkerHealthState, message). DEGRADED: a target replica is down but another serves,
        or a draft is down (its requests run on without speculation, slower)."""
        if self.draining:
            return States.WORKER_HEALTH_STATE_DRAINING, "shutting down: running requests finish"
        if not self.ready:
            return States.WORKER_HEALTH_STATE_STARTING, "connecting to its targets and drafts"
        if not self.live_targets:
            return States.WORKER_HEALTH_STATE_NOT_SERVING, "no target replica is serving"
        down = [
            f"{total - live} of {total} {kind}s down"
            for kind, live, total in (
                ("target", self.live_targets, self.num_targets),
                ("draft", self.live_drafts, self.num_drafts),
            )
            if live < total
        ]
        if down:
            return States.WORKER_HEALTH_STATE_DEGRADED, "; ".join(down)
        return States.WORKER_HEALTH_STATE_SERVING, "serving"
