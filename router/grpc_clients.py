"""`TargetClient` / `DraftClient` over gRPC: one long-lived bidirectional Step stream each
(`specmesh.router.step_stream`); a release is a batch nobody waits for, written in order behind
the work it undoes.

Lifecycle. The service frees everything a stream created when the stream ends, so a broken
stream needs no cleanup: the next call opens a fresh stream (starting with the target
handshake) on the same channel, which reconnects by itself once the service is back.

Failures. A broken stream, UNAVAILABLE, DEADLINE_EXCEEDED or a target step past its deadline
raise `ServiceDownError` (the core then replays on another target, or drops speculation). Any
other status raises the matching `runtime.errors` exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

import grpc

from specmesh.protocol.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RowBlock,
    join_rows,
    join_state_rows,
    split_state_rows,
)
from specmesh.protocol.constraints import Constraint
from specmesh.protocol.errors import ServiceDownError
from specmesh.protocol.features import FeatureSpec
from specmesh.protocol.shared_rows import RegionMaps
from specmesh.protocol.steps import (
    DraftInfo,
    DraftStepResult,
    ExtendInput,
    Logprob,
    PrefillInput,
    StepOutput,
    TargetInfo,
    VerifyInput,
)
from specmesh.protocol.trees import DraftTree
from specmesh.router.metrics import STEP_BYTES_RECEIVED, STEP_BYTES_SENT
from specmesh.router.step_stream import CountingChannel, StepStream
from specmesh.rpc.grpc_options import channel_options
from specmesh.rpc.tokenizer_files import TokenizerFiles
from specmesh.rpc.wire import (
    constraint_to_pb,
    error_from_rpc,
    error_from_status,
    logprobs_from_pb,
    needs_from_pb,
    needs_to_pb,
    sampling_to_pb,
)
from specmesh.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    generation_pb2,
    target_pb2,
    target_pb2_grpc,
)

log = logging.getLogger(__name__)


class _GrpcClient:
    """Channel, GetInfo at connect, in-band release; the Step stream lives in ``self.stream``."""

    stub_type: type
    request_type: type  # TargetStepRequest / DraftStepRequest

    def __init__(
        self,
        address: str,
        name: str | None,
        step_timeout_s: float | None,
        credentials: grpc.ChannelCredentials | None = None,
        id_prefix: str = "",
    ) -> None:
        self.address, self.name = address, name or address
        # Prepended to every request id this client sends, stripped from every id it reads:
        # routers sharing a service (a rolling update) each pass their own, so clients' ids
        # never collide there (the services key their state by id).
        self.id_prefix = id_prefix
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=channel_options())
        else:  # TLS: verify the service with the CA, present the router's client certificate
            self.channel = grpc.aio.secure_channel(address, credentials, options=channel_options())
        # Step bytes on the wire, counted where the stub's serializers make and read them.
        counting = CountingChannel(
            self.channel,
            STEP_BYTES_SENT.labels(self.name).inc,
            STEP_BYTES_RECEIVED.labels(self.name).inc,
        )
        self.stub = self.stub_type(counting)
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

    def wire_id(self, rid: str) -> str:
        """The id the service keys ``rid`` by."""
        return self.id_prefix + rid

    def router_id(self, wire_id: str) -> str:
        """The router's id of the service's ``wire_id``."""
        return wire_id.removeprefix(self.id_prefix)

    async def release(self, rids: list[str]) -> None:
        release = common_pb2.ReleaseBatch(request_ids=[self.wire_id(r) for r in rids])
        with contextlib.suppress(ServiceDownError):  # a dead stream's state is freed with it
            await self.stream.send([self.request_type(release=release)])

    async def prepare(self, constraints: list[Constraint]) -> None:
        """A PrepareBatch, its answer dropped: the draft compiles while the target does."""
        batch = draft_pb2.PrepareBatch(constraints=[constraint_to_pb(c) for c in constraints])
        with contextlib.suppress(ServiceDownError):  # the extend meets the fault, if it lasts
            await self.stream.send([self.request_type(prepare=batch)], open_stream=True)

    async def _answer(self, messages: list) -> list:
        return await self._checked(await self.stream.submit(messages))

    async def _checked(self, answer: Awaitable[list]) -> list:
        chunks = await answer
        if chunks[0].status.code:
            raise error_from_status(
                chunks[0].status.code, f"{self.name}: {chunks[0].status.message}"
            )
        return chunks

    async def close(self) -> None:
        await self.stream.close()
        await self.channel.close()


class GrpcTargetClient(_GrpcClient):
    stub_type = target_pb2_grpc.TargetStub
    request_type = target_pb2.TargetStepRequest
    remote = True

    def __init__(
        self,
        address: str,
        name: str | None = None,
        step_timeout_s: float = 120.0,
        credentials: grpc.ChannelCredentials | None = None,
        id_prefix: str = "",
        shared_memory: bool = False,
    ) -> None:
        super().__init__(address, name, step_timeout_s, credentials, id_prefix)
        # The target's shared rows as this router maps them (`protocol.shared_rows`), if asked
        self.regions = RegionMaps(limit=1, populate=False) if shared_memory else None
        self.info_pb: target_pb2.TargetInfo | None = None
        self.info: TargetInfo | None = None

    async def connect(self, timeout_s: float = 60.0) -> None:
        self.info_pb = pb = await self.get_info(timeout_s)
        self.info = TargetInfo(
            pb.model_path,
            pb.vocab_size,
            pb.max_context_len,
            tuple(pb.eos_token_ids),
            pb.hidden_size,
            pb.max_batch_size,
        )

    async def get_tokenizer(self, timeout_s: float = 60.0) -> TokenizerFiles | None:
        """The target's tokenizer files, their digest checked (`TokenizerFiles.from_pb`); None
        when it has none (NOT_FOUND) or predates GetTokenizer (UNIMPLEMENTED). Any other status
        (a tokenizer over the message limit of either end, a target gone) is a ValueError with
        the target's reason: the router does not start."""
        try:
            msg = await self.stub.GetTokenizer(target_pb2.TokenizerRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            reason = f"{e.code().name}: {e.details() or ''}"
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
                log.info("%s serves no tokenizer (%s)", self.name, reason)
                return None
            raise ValueError(
                f"{self.name}: GetTokenizer failed ({reason}); give the router --tokenizer DIR"
            ) from None
        return TokenizerFiles.from_pb(msg, self.name)

    async def close(self) -> None:
        await super().close()
        if self.regions is not None:
            self.regions.close()

    async def configure(self, needs: FeatureSpec) -> None:
        """The handshake, answered now (a refusal raises with the target's reason) and sent
        again first on every stream opened later."""
        hello = lambda: target_pb2.TargetStepRequest(
            open=target_pb2.StreamOpen(
                **needs_to_pb(needs), rows_in_shared_memory=self.regions is not None
            )
        )
        self.stream.handshake = None
        await self._answer([hello()])
        self.stream.handshake = hello

    async def prefill(self, inputs: list[PrefillInput]) -> StepOutput:
        batch = target_pb2.PrefillBatch(
            requests=[
                target_pb2.PrefillRequest(
                    request_id=self.wire_id(i.rid),
                    input_ids=i.input_ids,
                    # A later piece of an input continues with the first piece's sampling.
                    sampling=None if i.input_start else sampling_to_pb(i.params),
                    sample_offset=i.sample_offset,
                    images=i.images,
                    input_start=i.input_start,
                    more_input=i.more_input,
                )
                for i in inputs
            ]
        )
        mm = any(i.images for i in inputs)
        return await self._step(
            target_pb2.TargetStepRequest(prefill=batch, return_mm_input_embeds=mm)
        )

    async def send_verify(
        self, inputs: list[VerifyInput], rows: bool = True
    ) -> Awaitable[StepOutput]:
        """`verify`, written now (in order before anything sent later); await what it returns
        for the answer."""
        requests = [
            target_pb2.VerifyRequest(
                request_id=self.wire_id(i.rid),
                tree=common_pb2.DraftTree(tokens=i.tree.tokens, parents=i.tree.parents),
            )
            for i in inputs
        ]
        req = target_pb2.TargetStepRequest(
            verify=target_pb2.VerifyBatch(requests=requests), skip_features=not rows
        )
        return await self._send(req)

    async def verify(self, inputs: list[VerifyInput], rows: bool = True) -> StepOutput:
        return await (await self.send_verify(inputs, rows))

    async def _step(self, req: target_pb2.TargetStepRequest) -> StepOutput:
        return await (await self._send(req))

    async def _send(self, req: target_pb2.TargetStepRequest) -> Awaitable[StepOutput]:
        """Write ``req`` now; await what it returns for the decoded answer."""
        return self._output(await self.stream.submit([req]))

    async def _output(self, answer: Awaitable[list]) -> StepOutput:
        """A step's answer, decoded (a failed batch raises its status)."""
        chunks = await self._checked(answer)
        head = chunks[0]
        # Feature rows stay wire bytes: sliced per request and forwarded to the draft as is.
        row_counts, blocks = join_state_rows([c.states for c in chunks], self.regions)
        out = StepOutput(
            features=blocks.get("aux_hidden", blocks.get("hidden")),
            mm_input_embeds=blocks.get("mm_input_embeds"),
        )
        for result, rows in zip(head.results, row_counts or [0] * len(head.results), strict=True):
            rid = self.router_id(result.request_id)
            if result.status.code:
                out.errors[rid] = error_from_status(result.status.code, result.status.message)
            else:
                out.tokens[rid], out.row_counts[rid] = list(result.token_ids), rows
                if result.prompt_ids:
                    out.prompt_ids[rid] = list(result.prompt_ids)
                if result.logprobs:
                    out.logprobs[rid] = logprobs_from_pb(result.logprobs, Logprob)
                if result.prompt_logprobs:
                    out.prompt_logprobs[rid] = logprobs_from_pb(result.prompt_logprobs, Logprob)
                if result.cached_tokens:
                    out.cached_tokens[rid] = result.cached_tokens
        return out


class GrpcDraftClient(_GrpcClient):
    stub_type = draft_pb2_grpc.DraftStub
    request_type = draft_pb2.DraftStepRequest

    def __init__(
        self,
        address: str,
        name: str | None = None,
        chunk_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        credentials: grpc.ChannelCredentials | None = None,
        id_prefix: str = "",
    ) -> None:
        super().__init__(
            address, name, None, credentials, id_prefix
        )  # the round holds the draft deadline
        self.chunk_bytes = chunk_bytes
        self.info_pb: draft_pb2.DraftInfo | None = None
        self.info: DraftInfo | None = None

    async def connect(self, timeout_s: float = 60.0) -> None:
        self.info_pb = pb = await self.get_info(timeout_s)
        self.info = DraftInfo(
            pb.draft_kind, needs_from_pb(pb), pb.num_steps, pb.topk, pb.num_draft_tokens,
            pb.max_batch_size,
        )  # fmt: skip

    async def step(self, extends: list[ExtendInput], propose: bool = True) -> DraftStepResult:
        requests = [
            draft_pb2.ExtendRequest(
                request_id=self.wire_id(e.rid),
                token_ids=e.committed_ids,
                next_token_id=e.next_token,
                starts_request=e.new,
                multimodal=e.is_multimodal and e.new,
                constraint=constraint_to_pb(e.constraint if e.new else None),
                output_start=e.output_start if e.new else 0,
                exclude_from_learning=not e.learn,
            )
            for e in extends
        ]
        states = split_state_rows(
            [len(e.committed_ids) for e in extends], self._rows(extends), self.chunk_bytes
        )
        first = draft_pb2.ExtendBatch(requests=requests, states=states[0], propose_after=propose)
        rest = [draft_pb2.ExtendBatch(states=s) for s in states[1:]]
        chunks = await self._answer([draft_pb2.DraftStepRequest(extend=b) for b in [first, *rest]])
        out = DraftStepResult()
        for result in chunks[0].results:
            rid = self.router_id(result.request_id)
            if result.status.code:
                out.errors[rid] = error_from_status(result.status.code, result.status.message)
            elif result.HasField("tree"):
                out.trees[rid] = DraftTree.of(result.tree.tokens, result.tree.parents)
                if result.predrafted:
                    out.predrafted.add(rid)
                if result.HasField("weight_version"):
                    out.versions[rid] = result.weight_version
        return out

    def _rows(self, extends: list[ExtendInput]) -> dict[str, RowBlock | None]:
        """The batch's rows, joined from the target's bytes (a window, when the batch follows
        the target's order)."""
        field = self.info.needs.feature.wire_field
        mm = join_rows([e.mm_input_embeds for e in extends])
        return {
            **({field: join_rows([e.features for e in extends])} if field else {}),
            "mm_input_embeds": mm,
        }
