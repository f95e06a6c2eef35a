"""``specmesh generate``: one prompt, in process or through a router, text or ``--json``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from specmesh.cli.serve_args import add_model_arg, choose_runtime_from_args
from specmesh.defaults import DEFAULT_SPEC
from specmesh.protocol.config import DRAFT_KINDS
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.policy import MODES as SPECULATION_MODES
from specmesh.router.policy import SpeculationPolicy
from specmesh.rpc.security import add_api_key_arg, add_tls_args, tls_from_args


def add_model_args(p: argparse.ArgumentParser, auto_runtime: bool = True) -> None:
    """Flags shared by every command that loads models in process. ``auto_runtime``: device,
    attention backend and KV cache left out are chosen for this machine
    (`specmesh.device_defaults`); else they are a CPU's (``specmesh bench``)."""
    add_model_arg(
        p, "--target-model", "checkpoint dir or Hugging Face id (default: built-in demo model)"
    )
    add_model_arg(p, "--draft-model", "draft checkpoint dir or Hugging Face id")
    p.add_argument("--draft-kind", choices=DRAFT_KINDS)
    add_spec_args(p)
    auto = "; default: torch on a CPU, with CUDA flashinfer where it runs the model, else triton"
    p.add_argument(
        "--attention-backend",
        choices=["torch", "triton", "flashinfer"],
        default=None if auto_runtime else "torch",
        help="attention kernels" + (auto if auto_runtime else ""),
    )
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="default: fp32 on a CPU (faster there than bf16), the checkpoint's on CUDA",
    )
    p.add_argument(
        "--device",
        default=None if auto_runtime else "cpu",
        help="default: " + ("cuda where CUDA is present, else cpu" if auto_runtime else "cpu"),
    )
    p.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="run decode / verify / draft steps eagerly (graphs are only ever used on CUDA)",
    )


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """The speculation shape: ``--num-steps --topk --num-draft-tokens``."""
    p.add_argument(
        "--num-steps", type=int, default=DEFAULT_SPEC["num_steps"], help="draft steps (tree depth)"
    )
    p.add_argument(
        "--topk", type=int, default=DEFAULT_SPEC["topk"], help="branching per draft step"
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=DEFAULT_SPEC["num_draft_tokens"],
        help="tree nodes incl. the root",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    p.add_argument(
        "--stop-token-ids", default="", metavar="1,2", help="comma-separated stop token ids"
    )
    p.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
        stop_token_ids=tuple(int(t) for t in args.stop_token_ids.split(",") if t.strip()),
        ignore_eos=args.ignore_eos,
    )  # fmt: skip


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate from one prompt", description=__doc__)
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--in-process", action="store_true", help="run target (and draft) in this process (default)"
    )
    where.add_argument("--router", metavar="HOST:PORT", help="send the request to a running router")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (tokenized with the target's tokenizer)")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    p.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="FILE",
        help="image file (PNG/JPEG) for a multimodal model; repeatable",
    )
    p.add_argument("--disable-speculation", action="store_true")
    p.add_argument(
        "--speculation",
        choices=SPECULATION_MODES,
        default="adaptive",
        help="--in-process: adaptive (default) speculates per round only where measured costs "
        "and acceptance say it pays, always verifies full draft trees, never skips the draft",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the target over N ranks, this process being rank 0 (--in-process; the "
        "draft stays on one device)",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=512,
        metavar="N",
        help="--in-process: prompt tokens prefilled per round (0 = whole prompts; see "
        "specmesh router --help)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds (--router)")
    add_tls_args(p)  # --router over TLS: --tls-ca-file verifies it (cert / key: a client cert)
    add_api_key_arg(p, "the router's API key (--router)")
    add_model_args(p)
    add_sampling_args(p)
    p.set_defaults(run=run)


def parse_prompt(args: argparse.Namespace) -> str | list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError as e:
            raise ValueError(f"--prompt-ids must be comma-separated integers: {e}") from e
    return args.prompt


def run(args: argparse.Namespace) -> int:
    if not args.router and (args.api_key or tls_from_args(args)):
        raise ValueError("--api-key and --tls-* flags need --router")
    result = generate_via_router(args) if args.router else generate_in_process(args)
    print(json.dumps(result) if args.json else result["text"])
    return 0 if result["finish_reason"] != "abort" else 1


def generate_in_process(args: argparse.Namespace) -> dict[str, Any]:
    from specmesh.defaults import local_models, resolve_models
    from specmesh.protocol.config import SpecParams
    from specmesh.router.engine import Engine
    from specmesh.router.router_config import RouterConfig

    chosen = resolve_models(args.target_model, args.draft_model, args.draft_kind)
    models = local_models(chosen, args.target_revision, args.draft_revision)
    graphs = {"cuda_graph": not args.disable_cuda_graph}
    target = choose_runtime_from_args(args, "target", models.target).config_kwargs()
    draft = None
    if models.draft_kind is not None and not args.disable_speculation:
        drafted = models.draft or models.target
        draft = choose_runtime_from_args(args, "draft", drafted, models.target).config_kwargs()
    engine = Engine(
        models.target,
        draft_model=models.draft,
        draft_kind=None if draft is None else models.draft_kind,
        spec=SpecParams(args.num_steps, args.topk, args.num_draft_tokens),
        target_config={**target, **graphs, "tensor_parallel_size": args.tensor_parallel_size},
        draft_config={**(draft or {}), **graphs},  # the draft stays on one device
        router_config=RouterConfig(
            speculation=args.speculation, prefill_chunk_tokens=args.prefill_chunk_tokens
        ),
    )
    images = [open(f, "rb").read() for f in args.image]  # noqa: SIM115
    res = engine.generate([parse_prompt(args)], sampling_from_args(args), images=[images])[0]
    speculation = policy_summary(engine.policy, args.speculation if draft else None)
    if not args.json:
        print(
            f"[{res.finish_reason}, {len(res.token_ids)} tokens, mean accept {res.mean_accept_len:.2f}"
            f"; {speculation['note']}]",
            file=sys.stderr,
        )
    return result_dict(
        res.token_ids,
        res.text,
        res.finish_reason,
        res.accept_lens,
        len(res.prompt_token_ids),
        res.num_draft_tokens,
        res.num_predraft_hits,
        res.draft_wait_s,
        speculation,
    )


def policy_summary(policy: SpeculationPolicy, mode: str | None) -> dict[str, Any]:
    """The speculation policy's plans for this run's one request, and why the latest plain one
    was plain (``mode`` None: no draft ran)."""
    if mode is None:
        return {"mode": "off", "note": "no draft: plain decoding"}
    if mode != "adaptive":
        return {"mode": mode, "note": f"--speculation {mode}"}
    tallies = list(policy.tallies.values())
    plain, speculative = (
        sum(t.num_plain for t in tallies),
        sum(t.num_speculative for t in tallies),
    )
    reasons = [t.last_plain for t in tallies if t.last_plain is not None]
    note = f"the policy planned all {speculative} rounds speculative"
    if reasons:
        note = f"plain decoding in {plain} of {plain + speculative} rounds, the latest: "
        note += reasons[-1].describe()
    return {"mode": mode, "plain_rounds": plain, "speculative_rounds": speculative, "note": note}


def router_summary(stats: Any, disabled: bool) -> dict[str, Any]:
    """What the router's stats (`RequestStats`) tell of speculation: its plain and speculative
    rounds and why its adaptive policy last planned one plain."""
    rounds, plain = len(stats.accept_lens), stats.num_plain_rounds
    out = {"mode": "router", "plain_rounds": plain, "speculative_rounds": rounds - plain}
    if disabled:
        note = "--disable-speculation: plain decoding"
    elif stats.plain_reason:
        note = f"plain decoding in {plain} of {rounds} rounds, the latest: {stats.plain_reason}"
    elif stats.num_draft_tokens:
        note = f"{stats.num_draft_tokens} draft tokens verified in {rounds} rounds"
    else:
        note = "no round verified a draft token: the router has no draft, or it failed"
    return {**out, "note": note}


def result_dict(
    token_ids: list[int],
    text: str,
    finish_reason: str,
    accept_lens: list[int],
    prompt_tokens: int,
    num_draft_tokens: int,
    num_predraft_hits: int = 0,
    draft_wait_s: float = 0.0,
    speculation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``--json`` contract, the same for in-process and router runs."""
    return {
        "token_ids": list(token_ids),
        "text": text,
        "finish_reason": finish_reason,
        "accept_lens": list(accept_lens),
        "mean_accept_len": sum(accept_lens) / len(accept_lens) if accept_lens else 0.0,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(token_ids),
        "num_draft_tokens": num_draft_tokens,
        # rounds whose tree was pre-drafted, and the time rounds waited on the draft
        "num_predraft_hits": num_predraft_hits,
        "draft_wait_s": draft_wait_s,
        # whether rounds speculated and, in process, why the policy planned plain ones
        "speculation": speculation or {},
    }


def generate_via_router(args: argparse.Namespace) -> dict[str, Any]:
    """``specmesh generate --router HOST:PORT``: the same ``--json`` dict as in process."""
    import grpc

    from specmesh.client import GenerationClient
    from specmesh.rpc.security import api_key_from_args
    from specmesh.v1 import generation_pb2

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
    accept_lens = list(stats.accept_lens)
    speculation = router_summary(stats, args.disable_speculation)
    if not args.json:
        print(
            f"[{finish}, {len(token_ids)} tokens, mean accept {stats.mean_accept_len:.2f}"
            f"; {speculation['note']}]",
            file=sys.stderr,
        )
    return result_dict(
        token_ids, text, finish, accept_lens, stats.prompt_tokens, stats.num_draft_tokens,
        stats.num_predraft_hits, stats.draft_wait_s, speculation,
    )  # fmt: skip
