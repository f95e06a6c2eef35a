"""``specmesh target | draft | router``: run one service (``up``: `cmd_up`).

Defaults come from the services' frozen config dataclasses (`TargetConfig`, `DraftConfig`,
`RouterConfig`, `RouterSettings`).
"""

from __future__ import annotations

import argparse
import asyncio

from specmesh.cli.cmd_generate import add_spec_args
from specmesh.cli.serve_args import (
    IMAGE_LIMITS,
    PORTS,
    ROUTER_LIMITS,
    add_http_args,
    add_limit_args,
    add_listen_args,
    add_model_arg,
    add_predraft_arg,
    add_prefix_cache_args,
    add_runtime_args,
    add_served_name_arg,
    add_speculation_arg,
    add_tensor_parallel_arg,
    choose_runtime_from_args,
    config_default,
    int_list,
    prepare_process,
    resolved,
)
from specmesh.protocol.config import DRAFT_KINDS, DraftConfig, TargetConfig
from specmesh.router.limits import RouterLimits
from specmesh.router.placement import PLACEMENTS
from specmesh.router.router_config import RouterConfig
from specmesh.rpc.inline_steps import add_inline_arg
from specmesh.rpc.metrics import add_metrics_port_arg
from specmesh.rpc.security import add_api_key_arg, api_key_from_args, tls_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("target", help="serve a target model (specmesh.v1.Target)")
    add_model_arg(p, "--model", "checkpoint dir or Hugging Face id", required=True)
    add_listen_args(p, PORTS["target"])
    add_runtime_args(p, TargetConfig)
    p.add_argument(
        "--cuda-graph-tree-sizes",
        type=int_list,
        default=config_default(TargetConfig, "cuda_graph_tree_sizes"),
        metavar="N[,N...]",
        help="verify tree sizes captured before ready: the drafts' --num-draft-tokens "
        "(other sizes run eagerly)",
    )
    add_tensor_parallel_arg(p)
    p.add_argument(
        "--no-run-ahead",
        dest="run_ahead",
        action="store_false",
        help="do not decide a plain request's next decode step while the router handles the "
        "step just answered (run-ahead hides the hop behind the forward; output is the same)",
    )
    p.add_argument(
        "--no-fused-kernels",
        dest="fused_kernels",
        action="store_false",
        help="on CUDA, run the decoder's norms, RoPE, KV store and SiLU as separate torch ops "
        "and q/k/v, gate/up as separate products (the fused Triton kernels are the default)",
    )
    p.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="on CUDA, report ready without first running a pseudo request (which compiles the "
        "kernels a first prefill or eager verify would, e.g. FlashInfer's JIT)",
    )
    add_prefix_cache_args(p)
    add_limit_args(p, TargetConfig, IMAGE_LIMITS)
    add_metrics_port_arg(p)
    add_inline_arg(p)
    p.set_defaults(run=run_target)

    p = sub.add_parser("draft", help="serve a draft model (specmesh.v1.Draft)")
    add_model_arg(p, "--model", "draft checkpoint dir or Hugging Face id (not for --kind ngram)")
    add_model_arg(
        p, "--target-model", "the target checkpoint (embeddings, tokenizer)", required=True
    )
    p.add_argument("--kind", required=True, choices=DRAFT_KINDS)
    add_spec_args(p)
    add_predraft_arg(p)
    add_prefix_cache_args(p)
    add_listen_args(p, PORTS["draft"])
    add_runtime_args(p, DraftConfig)
    add_metrics_port_arg(p)
    add_inline_arg(p)
    p.add_argument(
        "--online-learning",
        action="store_true",
        default=config_default(DraftConfig, "online_learning"),
        help="train the EAGLE-3 head on the traffic it serves, on a low-priority thread; an "
        "update is served only if it does not lower acceptance on held-out traffic (output never "
        "changes; docs/online-learning.md)",
    )
    p.add_argument(
        "--online-learning-dir",
        metavar="DIR",
        default=config_default(DraftConfig, "online_learning_dir"),
        help="keep the learned head's checkpoints here (EAGLE-3 format: --model DIR/latest "
        "serves one) and resume from the last one",
    )
    p.add_argument(
        "--online-learning-rate",
        type=float,
        metavar="LR",
        default=config_default(DraftConfig, "online_learning_rate"),
        help="the trainer's learning rate (default 5e-5, for traffic near what the draft was "
        "trained on; 2e-4 for a target fine-tuned away from its draft: docs/online-learning.md)",
    )
    p.set_defaults(run=run_draft)

    p = sub.add_parser("router", help="serve the public API (specmesh.v1.Generation)")
    p.add_argument(
        "--target", required=True, metavar="HOST:PORT[,HOST:PORT...]", help="target replicas"
    )
    p.add_argument(
        "--draft",
        default="",
        metavar="HOST:PORT[,HOST:PORT...]",
        help="draft replicas (none: no speculation)",
    )
    p.add_argument(
        "--tokenizer", metavar="DIR", help="default: the target's model path when it is a local dir"
    )
    p.add_argument(
        "--shared-memory",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the targets and drafts run on this host, as this user, sharing /dev/shm: feature "
        "rows go from target to draft through shared memory instead of through this router "
        "(docs/architecture.md; `specmesh up` turns it on where /dev/shm exists)",
    )
    add_served_name_arg(p)
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=config_default(RouterConfig, "max_batch_size"),
        help="requests per micro-batch",
    )
    p.add_argument(
        "--num-micro-batches",
        type=int,
        default=config_default(RouterConfig, "num_micro_batches"),
        help="micro-batches in flight, so the target verifies one while the draft works on "
        "another (default 2; set 1 where target and draft share one device)",
    )
    p.add_argument(
        "--draft-timeout-s",
        type=float,
        default=config_default(RouterConfig, "draft_timeout_s"),
        help="the longest a draft step may take; below it the deadline adapts to the draft's "
        "recent steps (see --draft-deadline-floor-s). A step past its deadline counts as a draft "
        "failure: its requests are released there and continue without speculation",
    )
    p.add_argument(
        "--draft-deadline-floor-s",
        type=float,
        default=config_default(RouterConfig, "draft_deadline_floor_s"),
        help="the adaptive draft deadline (4x the p99 of recent steady draft steps, scaled up for a "
        "step over more rows) is never shorter",
    )
    add_speculation_arg(p)
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=config_default(RouterConfig, "prefill_chunk_tokens"),
        metavar="N",
        help="prompt tokens a micro-batch sends its target per round: a longer prompt is prefilled "
        "over several rounds, the running requests' rounds between its pieces, so they wait "
        "at most one piece between tokens (0 = every prompt in one piece)",
    )
    p.add_argument(
        "--no-pipeline-decode",
        dest="pipeline_decode",
        action="store_false",
        help="send a request's next plain decode step only after emitting the last (by default "
        "it goes to the target before, so the router's work overlaps the target's; output is "
        "the same)",
    )
    p.add_argument(
        "--no-balance-micro-batches",
        dest="balance_micro_batches",
        action="store_false",
        help="let the first micro-batch that wakes admit every waiting request (by default each "
        "takes at most its share of the requests held, so the target verifies one micro-batch "
        "while the draft works on the other)",
    )
    p.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=config_default(RouterConfig, "placement"),
        help="which target replica a request goes to: the one it sent the longest prefix of the "
        "prompt to, among those near the least load (cache-aware), or the least loaded",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=256, help="default for requests that leave it 0"
    )
    p.add_argument(
        "--connect-timeout", type=float, default=300.0, help="seconds to wait for every service"
    )
    add_limit_args(p, RouterLimits, ROUTER_LIMITS)
    add_listen_args(p, PORTS["router"])
    add_api_key_arg(p, "clients of specmesh.v1.Generation must send 'authorization: Bearer KEY'")
    add_http_args(p, None)
    p.add_argument(
        "--per-request-spec-decode-metrics",
        choices=("none", "summary", "detailed"),
        default="none",  # RouterSettings.per_request_spec_decode_metrics
        help="vLLM's: speculative figures (metrics.speculative_decoding) in each OpenAI "
        "response; a request's spec_decode_metrics field overrides it (docs/openai.md)",
    )
    p.set_defaults(run=run_router)


def _address(args: argparse.Namespace) -> str:
    return f"{args.host}:{args.port}"


def _runtime_kwargs(
    args: argparse.Namespace,
    role: str = "target",
    model_dir: str | None = None,
    dtype_dir: str | None = None,
) -> dict:
    """The runtime fields of ``role``'s config, "auto" values resolved from this machine and
    ``model_dir``'s checkpoint (`choose_runtime_from_args`, which prints them)."""
    choice = choose_runtime_from_args(args, role, model_dir, dtype_dir)
    return {
        **choice.config_kwargs(), "max_context": args.max_context,
        "max_requests": args.max_requests, "cuda_graph": not args.disable_cuda_graph,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
    }  # fmt: skip


def run_target(args: argparse.Namespace) -> int:
    prepare_process(args)
    from specmesh.rpc.service_common import serve_model
    from specmesh.target_service import server
    from specmesh.target_service.runtime import TargetRuntime
    from specmesh.v1 import target_pb2_grpc

    credentials = _model_service_credentials(args)

    def load() -> TargetRuntime:
        model_dir = resolved(args, "--model")
        tree_sizes = {"cuda_graph_tree_sizes": args.cuda_graph_tree_sizes}
        images = {name: getattr(args, name) for name in IMAGE_LIMITS}
        tp = {"tensor_parallel_size": args.tensor_parallel_size, "run_ahead": args.run_ahead,
              "fused_kernels": args.fused_kernels, "warm_up": args.warm_up}  # fmt: skip
        prefix = {"prefix_cache_tokens": args.prefix_cache_tokens,
                  "prefix_block_size": args.prefix_block_size}  # fmt: skip
        return TargetRuntime(
            TargetConfig(
                model_dir=model_dir,
                **_runtime_kwargs(args, "target", model_dir),
                **tree_sizes,
                **images,
                **tp,
                **prefix,
            )
        )

    async def main() -> None:
        servicer = server.make_servicer(
            _address(args), args.max_message_mb << 20, args.inline_step_ms
        )
        servicer.metrics.serve(args.metrics_port or None, args.host)
        add = target_pb2_grpc.add_TargetServicer_to_server
        await serve_model(
            servicer, add, load, server.warm_up, grace_s=args.grace, credentials=credentials
        )

    asyncio.run(main())
    return 0


def run_draft(args: argparse.Namespace) -> int:
    prepare_process(args)
    from specmesh.draft_service import server
    from specmesh.draft_service.runtime import load_draft
    from specmesh.protocol.config import SpecParams
    from specmesh.rpc.service_common import serve_model
    from specmesh.v1 import draft_pb2_grpc

    spec = SpecParams(args.num_steps, args.topk, args.num_draft_tokens)
    spec.validate()
    _check_online_learning(args)
    credentials = _model_service_credentials(args)

    def load():
        draft_dir, target_dir = resolved(args, "--model"), resolved(args, "--target-model")
        runtime = _runtime_kwargs(args, "draft", draft_dir or target_dir, target_dir)
        cfg = DraftConfig(
            args.kind, draft_dir, target_dir, spec, predraft=args.predraft,
            predraft_steps=args.predraft_steps, prefix_cache_tokens=args.prefix_cache_tokens,
            prefix_block_size=args.prefix_block_size, online_learning=args.online_learning,
            online_learning_dir=args.online_learning_dir,
            online_learning_rate=args.online_learning_rate, **runtime,
        )  # fmt: skip
        return load_draft(cfg)

    async def main() -> None:
        servicer = server.make_servicer(
            _address(args), args.max_message_mb << 20, args.inline_step_ms
        )
        if args.online_learning:
            from specmesh.draft_service.online.metrics import OnlineCollector

            servicer.metrics.registry.register(OnlineCollector(servicer))
        servicer.metrics.serve(args.metrics_port or None, args.host)
        add = draft_pb2_grpc.add_DraftServicer_to_server
        await serve_model(servicer, add, load, None, grace_s=args.grace, credentials=credentials)

    asyncio.run(main())
    return 0


def _check_online_learning(args: argparse.Namespace) -> None:
    """Refuse, before listening, a draft kind that cannot learn and a directory without the
    switch."""
    for flag in ("online_learning_dir", "online_learning_rate"):
        if getattr(args, flag) is not None and not args.online_learning:
            raise ValueError(f"--{flag.replace('_', '-')} needs --online-learning")
    rate = args.online_learning_rate
    if rate is not None and not rate > 0.0:
        raise ValueError(f"--online-learning-rate must be > 0, got {rate}")
    if args.online_learning:
        from specmesh.draft_service.online.settings import refuse_kind

        refuse_kind(args.kind)


def _model_service_credentials(args: argparse.Namespace):
    """Target and draft: TLS with --tls-cert-file / --tls-key-file; with --tls-ca-file as well,
    only clients presenting a certificate signed by that CA (the router) get in."""
    tls = tls_from_args(args)
    return tls.server_credentials(require_client_auth=tls.ca_file is not None) if tls else None


def run_router(args: argparse.Namespace) -> int:
    prepare_process(args)
    from specmesh.router.server import RouterSettings, serve

    split = lambda s: tuple(a.strip() for a in s.split(",") if a.strip())
    settings = RouterSettings(
        targets=split(args.target),
        drafts=split(args.draft),
        address=_address(args),
        core=RouterConfig(
            max_batch_size=args.max_batch_size,
            num_micro_batches=args.num_micro_batches,
            draft_timeout_s=args.draft_timeout_s,
            draft_deadline_floor_s=args.draft_deadline_floor_s,
            speculation=args.speculation,
            prefill_chunk_tokens=args.prefill_chunk_tokens,
            placement=args.placement,
            pipeline_decode=args.pipeline_decode,
            balance_micro_batches=args.balance_micro_batches,
            served_model_name=args.served_model_name,
        ),
        tokenizer=args.tokenizer,
        shared_memory=args.shared_memory,
        max_new_tokens=args.max_new_tokens,
        max_message_bytes=args.max_message_mb << 20,
        connect_timeout_s=args.connect_timeout,
        tls=tls_from_args(args),
        api_key=api_key_from_args(args),
        limits=RouterLimits(**{name: getattr(args, name) for name in ROUTER_LIMITS}),
        http_address=None if args.http_port is None else f"{args.host}:{args.http_port}",
        chat_template=args.chat_template,
        per_request_spec_decode_metrics=args.per_request_spec_decode_metrics,
    )
    if not settings.targets:
        raise ValueError("--target needs at least one HOST:PORT")
    asyncio.run(serve(settings, grace_s=args.grace))
    return 0
