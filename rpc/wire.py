"""The wire conventions every service and client shares: exceptions <-> gRPC statuses (both
directions, so the router handles a remote failure exactly like an in-process one), Step
framing (a logical batch travels as consecutive chunks: chunk_index 0, 1, ...; more_chunks on
all but the last), and sampling parameters and draft features between the wire messages and
the runtime dataclasses.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Sequence

import grpc

from specmesh.protocol.constraints import Constraint
from specmesh.protocol.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    KVCacheFullError,
    ServiceDownError,
    SpecmeshError,
    UnknownRequestError,
)
from specmesh.protocol.features import AuxLayers, Feature, FeatureSpec
from specmesh.protocol.sampling import SamplingParams
from specmesh.v1 import common_pb2, generation_pb2

log = logging.getLogger(__name__)

# A failed RPC with these codes means "the replica is gone or unreachable", not "bad request".
DOWN_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)
_ERROR_BY_CODE: dict[grpc.StatusCode, type[SpecmeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: UnknownRequestError,
    grpc.StatusCode.ALREADY_EXISTS: DuplicateRequestError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: KVCacheFullError,
    **dict.fromkeys(DOWN_CODES, ServiceDownError),
}


# -- errors ------------------------------------------------------------------------------------
def status_code(exc: BaseException) -> grpc.StatusCode:
    """The status an exception travels as: its ``grpc_code``, INVALID_ARGUMENT for any other
    ``ValueError`` (codec and config errors), else INTERNAL."""
    if isinstance(exc, SpecmeshError):
        return grpc.StatusCode[exc.grpc_code]
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def status_pb(exc: BaseException) -> common_pb2.Status:
    return common_pb2.Status(code=status_code(exc).value[0], message=str(exc))


def error_from_status(code: int | grpc.StatusCode, message: str) -> SpecmeshError:
    """The exception a status stands for; a code without its own class keeps its name in the
    instance's ``grpc_code`` so the router passes it on unchanged."""
    if isinstance(code, int):
        code = next(c for c in grpc.StatusCode if c.value[0] == code)
    err = _ERROR_BY_CODE.get(code, SpecmeshError)(message)
    err.grpc_code = code.name
    return err


def error_from_rpc(e: grpc.RpcError, peer: str) -> SpecmeshError:
    return error_from_status(e.code(), f"{peer}: {e.details() or e.code().name}")


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the exception's status (raises, like ``context.abort``)."""
    code = status_code(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("internal error", exc_info=exc)
    await context.abort(code, str(exc))


# -- Step framing ------------------------------------------------------------------------------
class FramingError(ValueError):
    """Chunks out of order or interleaved across batches: the stream itself is broken."""


def frame(messages: Sequence, batch_id: int) -> list:
    """Stamp one batch's chunks with its id, their index and the more_chunks flag."""
    for i, msg in enumerate(messages):
        msg.batch_id, msg.chunk_index, msg.more_chunks = batch_id, i, i + 1 < len(messages)
    return list(messages)


class Reassembler:
    """Collects the chunks of the batch in progress; `add` returns them all on the last."""

    def __init__(self) -> None:
        self.chunks: list = []

    def add(self, msg) -> list | None:
        expected = len(self.chunks)
        if msg.chunk_index != expected or (self.chunks and msg.batch_id != self.chunks[0].batch_id):
            head = self.chunks[0].batch_id if self.chunks else msg.batch_id
            raise FramingError(
                f"chunk {msg.chunk_index} of batch {msg.batch_id} arrived while chunk "
                f"{expected} of batch {head} was expected"
            )
        self.chunks.append(msg)
        if msg.more_chunks:
            return None
        done, self.chunks = self.chunks, []
        return done


async def step_batches(request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator[list]:
    """Server side of a Step stream: yield each batch's chunks once complete; broken framing
    ends the stream with INVALID_ARGUMENT."""
    reassembler = Reassembler()
    async for msg in request_iterator:
        try:
            chunks = reassembler.add(msg)
        except FramingError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if chunks is not None:
            yield chunks


# -- sampling ----------------------------------------------------------------------------------
def sampling_from_pb(msg: generation_pb2.SamplingParams, default_max_new: int) -> SamplingParams:
    """Wire -> `SamplingParams`, applying the wire's zero defaults; its construction range-checks
    every field (`InvalidRequestError`)."""
    if msg.top_k < -1:
        raise InvalidRequestError(f"top_k must be >= -1, got {msg.top_k}")
    params = SamplingParams(
        max_new_tokens=msg.max_new_tokens or default_max_new,
        temperature=msg.temperature,
        top_p=msg.top_p or 1.0,
        top_k=max(msg.top_k, 0),
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty or 1.0,
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        min_tokens=msg.min_tokens,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        constraint=constraint_from_pb(msg.constraint) if msg.HasField("constraint") else None,
    )  # range-checked as it is made
    return params


def sampling_to_pb(params: SamplingParams) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(
        max_new_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        constraint=constraint_to_pb(params.constraint),
    )


def constraint_from_pb(msg: generation_pb2.Constraint) -> Constraint:
    """Wire -> `Constraint`, checked as it is made (`InvalidRequestError`)."""
    return Constraint(msg.kind, msg.text)


def readable_constraints(messages: Iterable[generation_pb2.Constraint]) -> list[Constraint]:
    """The constraints of ``messages`` that read; one that does not is refused where its batch
    runs, with the others' answers."""
    out = []
    for msg in messages:
        with contextlib.suppress(SpecmeshError):
            out.append(constraint_from_pb(msg))
    return out


def constraint_to_pb(constraint: Constraint | None) -> generation_pb2.Constraint | None:
    if constraint is None:
        return None
    return generation_pb2.Constraint(kind=constraint.kind, text=constraint.text)


def logprobs_to_pb(entries) -> list[generation_pb2.TokenLogprob]:
    """Any objects with ``token_id``, ``logprob`` and ``top`` ((id, logprob) pairs) -> wire."""
    return [
        generation_pb2.TokenLogprob(
            token_id=e.token_id,
            logprob=e.logprob,
            top=[generation_pb2.TopLogprob(token_id=t, logprob=v) for t, v in e.top],
        )
        for e in entries
    ]


def logprobs_from_pb(msgs, make) -> list:
    """Wire -> ``make(token_id, logprob, top)`` per entry (the caller's dataclass)."""
    return [
        make(m.token_id, m.logprob, tuple((t.token_id, t.logprob) for t in m.top)) for m in msgs
    ]


# -- features ----------------------------------------------------------------------------------
def needs_to_pb(needs: FeatureSpec) -> dict:
    """The ``feature``, ``aux_layer_ids`` and ``aux_numbering`` fields of a `DraftInfo` or a
    `StreamOpen` for ``needs``."""
    aux = needs.aux
    return {
        "feature": common_pb2.Feature.Value(f"FEATURE_{needs.feature.name}"),
        "aux_layer_ids": list(aux.layer_ids) if aux else [],
        "aux_numbering": common_pb2.AuxNumbering.Value(
            f"AUX_NUMBERING_{(aux.convention if aux else 'input').upper()}"
        ),
    }


def needs_from_pb(msg) -> FeatureSpec:
    """The `FeatureSpec` a `DraftInfo` or `StreamOpen` names (inverse of `needs_to_pb`)."""
    feature = Feature[common_pb2.Feature.Name(msg.feature).removeprefix("FEATURE_")]
    numbering = common_pb2.AuxNumbering.Name(msg.aux_numbering).removeprefix("AUX_NUMBERING_")
    aux = AuxLayers(tuple(msg.aux_layer_ids), numbering.lower()) if msg.aux_layer_ids else None
    return FeatureSpec(feature, aux if feature is Feature.AUX_HIDDEN else None)
