"""`TargetClient` / `DraftClient` over gRPC: one long-lived bidirectional Step stream each.

Every batch gets a stream-unique ``batch_id``; its chunks are written back to back (a write
lock keeps batches from interleaving) and a reader task matches each reassembled answer to the
waiting caller by id, so several micro-batches can be in flight on one stream.

Failures. A broken stream, UNAVAILABLE, DEADLINE_EXCEEDED or a step past its deadline raise
`ServiceDownError` (the core then replays on another target, or drops speculation); the next
call opens a fresh stream on the same channel, which reconnects by itself once the service is
back (a restarted draft is used again after the core's circuit breaker cools down). Any other
status raises the matching `runtime.errors` exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import grpc
import torch

from specmesh.draft_service.feature_drafter import ExtendInput
from specmesh.router.clients import DraftInfo, DraftStepResult, TargetInfo
from specmesh.router.faults import ServiceDownError
from specmesh.router.service_common import channel_options
from specmesh.router.wire import (
    FramingError,
    Reassembler,
    error_from_rpc,
    error_from_status,
    frame,
    sampling_to_pb,
)
from specmesh.runtime.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    join_hidden_states,
    split_hidden_states,
)
from specmesh.runtime.tree import Tree
from specmesh.target_service.steps import PrefillInput, StepOutput, VerifyInput
from specmesh.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    generation_pb2,
    target_pb2,
    target_pb2_grpc,
)

log = logging.getLogger(__name__)

FEATURE_FIELD = {"aux": "aux_hidden", "hidden": "hidden", "hidden_pre_norm": "hidden"}


class StepStream:
    """One bidi Step stream: `request` sends a batch's chunks and returns its answer's chunks."""

    def __init__(self, open_call, peer: str, timeout_s: float) -> None:
        self.open_call, self.peer, self.timeout_s = open_call, peer, timeout_s
        self.call = None
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count(1)
        self.write_lock = asyncio.Lock()
        self.reader: asyncio.Task | None = None

    async def request(self, messages: list) -> list:
        batch_id = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.pending[batch_id] = future
        try:
            async with self.write_lock:
                call = self._open()
                for msg in frame(messages, batch_id):
                    await call.write(msg)
            return await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            self._break(ServiceDownError(f"{self.peer}: no answer within {self.timeout_s:.0f} s"))
            raise ServiceDownError(f"{self.peer}: step timed out") from None
        except grpc.RpcError as e:
            raise self._break(error_from_rpc(e, self.peer)) from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError, RuntimeError) as e:
            raise self._break(ServiceDownError(f"{self.peer}: stream broken: {e}")) from None
        finally:
            self.pending.pop(batch_id, None)
            if future.done() and not future.cancelled():
                future.exception()  # mark retrieved: a failed write already raised the error

    def _open(self):
        if self.call is None:
            self.call = self.open_call()
            self.reader = asyncio.create_task(self._read(self.call))
        return self.call

    async def _read(self, call) -> None:
        reassembler = Reassembler()
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    raise ServiceDownError(f"{self.peer}: the service closed the stream")
                chunks = reassembler.add(msg)
                future = self.pending.get(chunks[0].batch_id) if chunks else None
                if future is not None and not future.done():
                    future.set_result(chunks)
        except asyncio.CancelledError:
            raise
        except grpc.RpcError as e:
            self._break(error_from_rpc(e, self.peer), call)
        except (ServiceDownError, FramingError) as e:
            self._break(ServiceDownError(str(e)), call)

    def _break(self, error: Exception, call=None) -> Exception:
        """Fail every waiting batch and forget the stream; the next request opens a new one."""
        if call is not None and call is not self.call:
            return error  # an old stream's reader, already replaced
        if self.call is not None:
            self.call.cancel()
        self.call = None
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        return error

    async def close(self) -> None:
        self._break(ServiceDownError(f"{self.peer}: client closed"))
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader


class _GrpcClient:
    """Channel, GetInfo at connect, Release; the Step stream lives in ``self.stream``."""

    stub_type: type

    def __init__(self, address: str, name: str | None, step_timeout_s: float) -> None:
        self.address, self.name = address, name or address
        self.channel = grpc.aio.insecure_channel(address, options=channel_options())
        self.stub = self.stub_type(self.channel)
        self.stream = StepStream(self.stub.Step, self.name, step_timeout_s)

    async def get_info(self, timeout_s: float):
        """GetInfo, waiting up to ``timeout_s`` for the service to come up and load."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                return await self.stub.GetInfo(
                    generation_pb2.InfoRequest(), timeout=5.0, wait_for_ready=True
                )
            except grpc.RpcError as e:
                if asyncio.get_running_loop().time() > deadline:
                    raise error_from_rpc(e, self.name) from None
                await asyncio.sleep(0.2)  # UNAVAILABLE while the service is loading

    async def release(self, rids: list[str]) -> None:
        try:
            await self.stub.Release(common_pb2.ReleaseRequest(request_ids=rids), timeout=10.0)
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.name) from None

    async def close(self) -> None:
        await self.stream.close()
        await self.channel.close()


class GrpcTargetClient(_GrpcClient):
    stub_type = target_pb2_grpc.TargetStub

    def __init__(
        self, address: str, name: str | None = None, step_timeout_s: float = 120.0
    ) -> None:
        super().__init__(address, name, step_timeout_s)
        self.info_pb: target_pb2.TargetInfo | None = None
        self.info: TargetInfo | None = None
        self.flags: dict[str, bool] = {}

    async def connect(self, timeout_s: float = 60.0) -> None:
        self.info_pb = pb = await self.get_info(timeout_s)
        self.info = TargetInfo(
            pb.model_path,
            pb.vocab_size,
            pb.max_context_len,
            tuple(pb.eos_token_ids),
            pb.hidden_size,
        )

    async def configure(self, draft: DraftInfo | None) -> None:
        """Ask every step for the features the draft consumes (the return_* flags)."""
        feature = draft.feature if draft is not None else "none"
        if feature == "aux" and tuple(draft.aux_layer_ids) != tuple(self.info_pb.aux_layer_ids):
            raise ValueError(
                f"{self.name}: the draft reads aux layers {list(draft.aux_layer_ids)} but the "
                f"target captures {list(self.info_pb.aux_layer_ids)} (both in input numbering)"
            )
        self.flags = {
            "return_aux_hidden": feature == "aux",
            "return_hidden": feature in ("hidden", "hidden_pre_norm"),
            "hidden_pre_norm": feature == "hidden_pre_norm",
        }

    async def prefill(self, inputs: list[PrefillInput]) -> StepOutput:
        batch = target_pb2.PrefillBatch(
            requests=[
                target_pb2.PrefillRequest(
                    request_id=i.rid,
                    input_ids=i.input_ids,
                    sampling=sampling_to_pb(i.params),
                    sample_offset=i.sample_offset,
                    images=i.images,
                )
                for i in inputs
            ]
        )
        mm = any(i.images for i in inputs)
        out = await self._step(
            target_pb2.TargetStepRequest(prefill=batch, return_mm_input_embeds=mm)
        )
        return out

    async def verify(self, inputs: list[VerifyInput]) -> StepOutput:
        batch = target_pb2.VerifyBatch(
            requests=[
                target_pb2.VerifyRequest(
                    request_id=i.rid,
                    tree=common_pb2.DraftTree(
                        tokens=i.tree.tokens.tolist(), parents=i.tree.parents.tolist()
                    ),
                )
                for i in inputs
            ]
        )
        return await self._step(target_pb2.TargetStepRequest(verify=batch))

    async def _step(self, req: target_pb2.TargetStepRequest) -> StepOutput:
        for flag, value in self.flags.items():
            setattr(req, flag, value)
        chunks = await self.stream.request([req])
        head = chunks[0]
        if head.status.code:
            raise error_from_status(head.status.code, f"{self.name}: {head.status.message}")
        row_counts, tensors = join_hidden_states([c.states for c in chunks])
        out = StepOutput(
            features=tensors.get("aux_hidden", tensors.get("hidden")),
            mm_input_embeds=tensors.get("mm_input_embeds"),
        )
        for result, rows in zip(head.results, row_counts or [0] * len(head.results), strict=True):
            rid = result.request_id
            if result.status.code:
                out.errors[rid] = error_from_status(result.status.code, result.status.message)
            else:
                out.tokens[rid], out.row_counts[rid] = list(result.token_ids), rows
                if result.prompt_ids:
                    out.prompt_ids[rid] = list(result.prompt_ids)
        return out


class GrpcDraftClient(_GrpcClient):
    stub_type = draft_pb2_grpc.DraftStub

    def __init__(
        self,
        address: str,
        name: str | None = None,
        step_timeout_s: float = 30.0,
        chunk_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        super().__init__(address, name, step_timeout_s)
        self.chunk_bytes = chunk_bytes
        self.info_pb: draft_pb2.DraftInfo | None = None
        self.info: DraftInfo | None = None
        self.committed: dict[str, int] = {}  # rows the draft holds per request (start_position)

    async def connect(self, timeout_s: float = 60.0) -> None:
        self.info_pb = pb = await self.get_info(timeout_s)
        feature = "aux" if pb.needs_aux_hidden else "hidden" if pb.needs_hidden else "none"
        if pb.needs_hidden_pre_norm:
            feature = "hidden_pre_norm"
        self.info = DraftInfo(
            pb.draft_kind, feature, tuple(pb.aux_layer_ids), "input", pb.num_steps, pb.topk,
            pb.num_draft_tokens,
        )  # fmt: skip

    async def step(self, extends: list[ExtendInput], propose: bool = True) -> DraftStepResult:
        requests = [
            draft_pb2.ExtendRequest(
                request_id=e.rid,
                token_ids=[*e.committed_ids[1:], e.next_token],  # rotated by one (draft.proto)
                starts_request=e.new,
                start_position=0 if e.new else self.committed.get(e.rid, 0),
                first_token_id=e.committed_ids[0] if e.new else 0,
            )
            for e in extends
        ]
        states = split_hidden_states(
            [len(e.committed_ids) for e in extends], self._tensors(extends), self.chunk_bytes
        )
        first = draft_pb2.DraftStepRequest(
            extend=draft_pb2.ExtendBatch(requests=requests, states=states[0], propose_after=propose)
        )
        rest = [
            draft_pb2.DraftStepRequest(extend=draft_pb2.ExtendBatch(states=s)) for s in states[1:]
        ]
        try:
            chunks = await self.stream.request([first, *rest])
        except ServiceDownError:
            self.committed.clear()  # a restarted draft holds nothing
            raise
        head = chunks[0]
        if head.status.code:
            raise error_from_status(head.status.code, f"{self.name}: {head.status.message}")
        out = DraftStepResult()
        for result in head.results:
            rid = result.request_id
            if result.status.code:
                out.errors[rid] = error_from_status(result.status.code, result.status.message)
                continue
            self.committed[rid] = result.committed_len
            if result.HasField("tree"):
                out.trees[rid] = Tree.from_parents(
                    list(result.tree.tokens), list(result.tree.parents)
                )
        return out

    def _tensors(self, extends: list[ExtendInput]) -> dict[str, torch.Tensor | None]:
        field = FEATURE_FIELD.get(self.info.feature)
        feats = [e.features for e in extends]
        mm = [e.mm_input_embeds for e in extends]
        return {
            **({field: torch.cat(feats)} if field and all(f is not None for f in feats) else {}),
            "mm_input_embeds": torch.cat(mm) if all(m is not None for m in mm) and mm else None,
        }

    async def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.committed.pop(rid, None)
        await super().release(rids)
