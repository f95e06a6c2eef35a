"""A small typed client for the router's public API, and ``specmesh generate --router``.

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

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import grpc

from specmesh.protocol.sampling import SamplingParams
from specmesh.rpc.security import TlsFiles, api_key_from_args, client_channel, tls_from_args
from specmesh.rpc.service_common import channel_options
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
        )
        return self.stub.Generate(request, timeout=timeout)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def generate_via_router(args: argparse.Namespace) -> dict[str, Any]:
    """``specmesh generate --router HOST:PORT``: the same ``--json`` dict as in process."""
    from specmesh.cmd_generate import parse_prompt, result_dict, sampling_from_args

    prompt = parse_prompt(args)
    images = [open(f, "rb").read() for f in args.image]  # noqa: SIM115
    kw = {"prompt_token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    token_ids: list[int] = []
    text, finish, stats = "", "abort", generation_pb2.RequestStats()
    client = GenerationClient(args.router, api_key=api_key_from_args(args), tls=tls_from_args(args))
    with client:
        try:
            for response in client.generate(
                **kw,
                sampling=sampling_from_args(args),
                disable_speculation=args.disable_speculation,
                images=images,
                timeout=args.timeout,
            ):
                token_ids += response.token_ids
                text += response.text
                if response.finish_reason:
                    finish, stats = response.finish_reason, response.stats
        except grpc.RpcError as e:
            raise SystemExit(f"specmesh generate: {e.code().name}: {e.details()}") from None
    if not args.json:
        print(
            f"[{finish}, {len(token_ids)} tokens, mean accept {stats.mean_accept_len:.2f}]",
            file=sys.stderr,
        )
    accept_lens = list(stats.accept_lens)
    return result_dict(
        token_ids, text, finish, accept_lens, stats.prompt_tokens, stats.num_draft_tokens
    )
