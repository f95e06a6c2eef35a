"""Command-line flags shared by the service commands (`cmd_serve`, `cmd_generate`): listening,
runtime, tensor parallelism, speculation, HTTP and per-request limits. Every default is read
from the services' frozen config dataclasses."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from specmesh.device_defaults import RuntimeChoice, RuntimeFlags, choose_runtime
from specmesh.protocol.codec import GRPC_MAX_MESSAGE_BYTES
from specmesh.protocol.config import DraftConfig, TargetConfig
from specmesh.router.policy import MODES as SPECULATION_MODES
from specmesh.rpc.security import add_tls_args

BACKENDS = ("torch", "triton", "flashinfer")
PORTS = {"router": 50051, "target": 50052, "draft": 50053}


def config_default(cls: type, name: str):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def add_listen_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: loopback only; 0.0.0.0 = every interface)",
    )
    p.add_argument("--port", type=int, default=port)
    add_tls_args(p)
    p.add_argument(
        "--max-message-mb",
        type=int,
        default=GRPC_MAX_MESSAGE_BYTES >> 20,
        help="gRPC max send/receive message size",
    )
    p.add_argument(
        "--grace", type=float, default=10.0, help="seconds to drain in-flight work on SIGTERM"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads for this process (0 = torch's default)",
    )


def prepare_process(args: argparse.Namespace) -> None:
    """A service's process before it loads anything: its heap keeps freed message buffers
    (`specmesh.rpc.heap`), and several services on one CPU must not each start a thread per
    core."""
    from specmesh.rpc.heap import keep_freed_memory

    keep_freed_memory()
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)


def add_model_arg(
    p: argparse.ArgumentParser, flag: str, help_text: str, required: bool = False
) -> None:
    """``--X-model`` (or ``--model``) and its ``--X-revision``: a local checkpoint directory or
    a Hugging Face id, resolved by `specmesh.hub.resolve_model`."""
    p.add_argument(flag, required=required, metavar="DIR|ORG/NAME", help=help_text)
    revision = flag.replace("model", "revision")
    p.add_argument(
        revision,
        metavar="REV",
        help=f"branch, tag or commit of a Hugging Face id given to {flag} (default: main)",
    )


def resolved(args: argparse.Namespace, flag: str) -> str | None:
    """The local directory of ``flag``'s value (None when not given), downloaded if need be."""
    from specmesh.hub import resolve_model

    name = flag.lstrip("-").replace("-", "_")
    value = getattr(args, name)
    revision = getattr(args, name.replace("model", "revision"))
    return None if value is None else resolve_model(value, revision, flag)


def add_runtime_args(p: argparse.ArgumentParser, cls: type) -> None:
    p.add_argument(
        "--attention-backend",
        choices=BACKENDS,
        default=None,
        help=f"default: {config_default(cls, 'attention_backend')} on a CPU; with CUDA "
        "flashinfer where installed and the model allows it, else triton (CUDA graphs)",
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="default: fp32 on a CPU (faster there than bf16), the checkpoint's on CUDA",
    )
    p.add_argument(
        "--device",
        default=None,
        help=f"default: cuda where CUDA is present, else {config_default(cls, 'device')}",
    )
    p.add_argument(
        "--max-context",
        type=int,
        default=config_default(cls, "max_context"),
        help="tokens per request (default: the model's max_position_embeddings; a larger value "
        "is served with a warning)",
    )
    p.add_argument(
        "--num-kv-slots",
        type=int,
        default=None,
        help=f"KV cache size in tokens (default {config_default(cls, 'num_kv_slots')} on a "
        "CPU; with CUDA the default --kv-cache-memory sizes it)",
    )
    p.add_argument(
        "--kv-cache-memory",
        metavar="SIZE",
        default=None,
        help="KV cache size as memory instead (overrides --num-kv-slots): 4GiB, 512MiB, 2GB, or "
        "on CUDA a fraction of the device memory free after loading (0.85; the default there: "
        "0.8 for a target, 0.1 for a draft); the slots are what it buys at this model's bytes "
        "per token (MLA: its latent vector)",
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=config_default(cls, "max_requests"),
        help="requests held at once",
    )
    p.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="run decode / verify / draft steps eagerly (graphs are only ever used on CUDA)",
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=config_default(cls, "cuda_graph_max_bs"),
        help="largest batch captured in CUDA graphs; bigger batches run eagerly",
    )


def choose_runtime_from_args(
    args: argparse.Namespace, role: str, model_dir: str | None, dtype_dir: str | None = None
) -> RuntimeChoice:
    """The "auto" runtime values resolved (`specmesh.device_defaults`) from this machine and
    ``model_dir``'s checkpoint (``dtype_dir``: whose dtype it runs); printed to stderr."""
    from specmesh.device_defaults import checkpoint_facts, machine_facts

    flags = RuntimeFlags(
        device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
        num_kv_slots=getattr(args, "num_kv_slots", None),
        kv_cache_memory=getattr(args, "kv_cache_memory", None),
        cuda_graph=not args.disable_cuda_graph,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1) if role == "target" else 1,
    )  # fmt: skip
    choice = choose_runtime(flags, checkpoint_facts(machine_facts(), model_dir, dtype_dir), role)
    command = getattr(args, "command", None) or "service"
    who = command if command in ("target", "draft") else f"{command} ({role})"
    print(choice.line(who), file=sys.stderr, flush=True)
    return choice


HTTP_PORT = 8000  # `specmesh up`'s OpenAI-compatible HTTP API (a free port when it is taken)


def add_predraft_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--predraft",
        type=int,
        default=config_default(DraftConfig, "predraft"),
        metavar="N",
        help="while the target verifies a tree, draft the next tree for its N likeliest "
        "outcomes (accepted path, bonus token), so a matching extend is answered at once; "
        "0 = off. Pays when the draft has a device (core) of its own",
    )
    p.add_argument(
        "--predraft-steps",
        type=int,
        default=config_default(DraftConfig, "predraft_steps"),
        metavar="D",
        help="search depth of a pre-drafted tree (at most --num-steps): shallower trees cost "
        "the draft less time per round",
    )


def add_prefix_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=config_default(TargetConfig, "prefix_cache_tokens"),
        metavar="N",
        help="prompt tokens the prefix cache keeps at most (0 = off): prompts that start like "
        "an earlier one reuse its KV and draft feature rows; unreferenced entries are given back "
        "whenever requests need KV slots",
    )
    p.add_argument(
        "--prefix-block-size",
        type=int,
        default=config_default(TargetConfig, "prefix_block_size"),
        metavar="N",
        help="tokens per prefix-cache block (a multiple of the KV page size)",
    )


def add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=config_default(TargetConfig, "tensor_parallel_size"),
        metavar="N",
        help="split the target over N ranks (processes started by the target, one device each: "
        "--device cuda uses cuda:0..N-1 with NCCL, cpu uses gloo); rank 0 serves. Attention "
        "and KV heads must split over N (or N be a multiple of the KV heads); CUDA graphs run "
        "only at 1",
    )


def add_speculation_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculation",
        choices=SPECULATION_MODES,
        default="adaptive",
        help="adaptive (default): per round and micro-batch, speculate (and with how many tree "
        "nodes) only where the measured draft and verify costs and the requests' acceptance say "
        "it yields more tokens per second; always: verify the draft's full trees every round; "
        "never: decode without the draft. Output is the same in every mode",
    )


def add_http_args(p: argparse.ArgumentParser, default_port: int | None) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=default_port,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) on "
        "this port of --host (0: any free port; same TLS files and API key as gRPC)"
        + ("" if default_port is None else f"; default {default_port}, or a free port if taken"),
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template for /v1/chat/completions (default: the tokenizer's own)",
    )


def add_served_name_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in GetInfo, /v1/models, the requests' \"model\" field and the "
        "metrics (default: the target's: a Hugging Face id, or its directory's name)",
    )


# Per-request limits (docs/limits-and-errors.md): field -> help; each is a flag --max-..., its default the
# config dataclass's.
IMAGE_LIMITS = {
    "max_images_per_request": "images in one request (INVALID_ARGUMENT beyond)",
    "max_image_bytes": "encoded bytes of one image (INVALID_ARGUMENT beyond)",
    "max_image_pixels": "width x height of one image, read from its header before decoding "
    "(INVALID_ARGUMENT beyond)",
}
ROUTER_LIMITS = {
    "max_prompt_bytes": "UTF-8 bytes of a text prompt, checked before tokenizing "
    "(INVALID_ARGUMENT beyond)",
    "max_stop_strings": "stop strings per request (INVALID_ARGUMENT beyond)",
    "max_stop_string_len": "characters of one stop string (INVALID_ARGUMENT beyond)",
    "max_stop_token_ids": "stop_token_ids per request (INVALID_ARGUMENT beyond)",
    "max_request_id_len": "characters of a request_id (INVALID_ARGUMENT beyond)",
    "max_images_per_request": "images in one request, checked before forwarding "
    "(INVALID_ARGUMENT beyond; the target checks its own limit too)",
    "max_image_bytes": "encoded bytes of one image, checked before forwarding "
    "(INVALID_ARGUMENT beyond)",
    "max_queued_prompts": "text prompts being tokenized or waiting to be "
    "(RESOURCE_EXHAUSTED beyond)",
    "tokenizer_threads": "threads tokenizing text prompts (off the event loop)",
}


def add_limit_args(p: argparse.ArgumentParser, cls: type, limits: dict[str, str]) -> None:
    for name, help_text in limits.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=int, default=config_default(cls, name), help=help_text)


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...], got {text!r}") from None
