"""A small typed client for the router's public API.

    from specmesh.client import GenerationClient
    from specmesh.protocol.sampling import SamplingParams

    with GenerationClient("localhost:50051") as client:
        for response in client.generate(prompt="def fib(n):", sampling=SamplingParams(max_new_tokens=32)):
            print(response.text, end="", flush=True)

Over TLS pass ``tls=TlsFiles(ca_file="ca.pem")`` (the CA that signed the router's certificate;
add ``cert_file`` / ``key_file`` to present a client certificate); a router started with
``--api-key`` needs ``api_key=`` (sent as ``authorization: Bearer <key>``; without TLS it travels
in the clear, so only do that on loopback).

``generate`` returns the call's response iterator (`specmesh.v1.GenerateResponse` messages); the
last one has ``finish_reason`` and ``stats``. ``call.cancel()`` (or dropping it) aborts the
request on the router. Errors raise ``grpc.RpcError`` with the router's status.
"""

from __future__ import annotations

from collections.abc import Sequence

from specmesh.protocol.sampling import SamplingParams
from specmesh.rpc.grpc_options import channel_options
from specmesh.rpc.security import TlsFiles, client_channel
from specmesh.rpc.wire import sampling_to_pb
from specmesh.v1 import generation_pb2, generation_pb2_grpc


class GenerationClient:
    def __init__(
        self, address: str, *, api_key: str | None = None, tls: TlsFiles | None = None
    ) -> None:
        self.address = address
        self.channel = client_channel(address, tls, api_key, channel_options())
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def info(self, timeout: float = 10.0) -> generation_pb2.InfoResponse:
        return self.stub.GetInfo(generation_pb2.InfoRequest(), timeout=timeout)

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | generation_pb2.SamplingParams | None = None,
        disable_speculation: bool = False,
        images: Sequence[bytes] = (),
        request_id: str = "",
        timeout: float | None = None,
        exclude_from_learning: bool = False,
    ):  # -> grpc call, an iterator of GenerateResponse
        if isinstance(sampling, SamplingParams):
            sampling = sampling_to_pb(sampling)
        request = generation_pb2.GenerateRequest(
            request_id=request_id,
            prompt=prompt or "",
            prompt_token_ids=list(prompt_token_ids or []),
            sampling=sampling,
            disable_speculation=disable_speculation,
            images=list(images),
            exclude_from_learning=exclude_from_learning,
        )
        return self.stub.Generate(request, timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
