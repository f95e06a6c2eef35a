"""What a model service runs when its command line does not say: device, dtype, attention
backend (and so CUDA graphs) and KV cache size, chosen from the machine and the checkpoint.

    flag left out          no CUDA (today's defaults)   CUDA present
    --device               cpu                          cuda
    --dtype                fp32                         the checkpoint's (bf16 for most)
    --attention-backend    torch                        flashinfer where installed and the model
                                                        allows it (fp16 / bf16, head_dim 64, 128
                                                        or 256, no MLA), else triton; CUDA
                                                        graphs with either
    --kv-cache-memory      65,536 slots                 a fraction of the memory free after the
                                                        weights load: target 0.8, draft 0.1

A given ``--device`` decides which column the other defaults come from. The two fractions leave
room for each other when target and draft share one GPU (`specmesh up` puts them on the same
one), in whichever order they load: the draft's tenth first, or the target's 0.8 first and the
draft's tenth of what remains; the rest is for activations and CUDA graphs. A tensor-parallel
target keeps its slots (a fraction is refused there: `runtime.kv_budget.rank_kv_slots`).

`choose_runtime` is a pure function of the flags given and the `Facts` (CUDA available, optional
kernels installed, the checkpoint's head size, dtype and attention kind), so it is tested on any
machine; `machine_facts` and `checkpoint_facts` gather them. The CLI resolves these "auto"
values before it builds a config (STYLE), and the service prints the result in one line.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from specmesh.protocol.config import DraftConfig, TargetConfig, resolve_dtype

KV_FRACTION = {"target": "0.8", "draft": "0.1"}  # of free device memory, on CUDA
CONFIGS = {"target": TargetConfig, "draft": DraftConfig}  # a CPU's defaults: theirs
OPTIONAL_BACKENDS = ("triton", "flashinfer")
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Facts:
    """What the defaults depend on (`machine_facts`, `checkpoint_facts`)."""

    cuda: bool  # torch.cuda.is_available()
    backends: frozenset[str]  # optional attention kernels installed (OPTIONAL_BACKENDS)
    head_dim: int | None = None  # the checkpoint's attention head size (None: unknown)
    dtype: str | None = None  # the checkpoint's dtype: fp32 / bf16 / fp16 (None: unknown)
    latent: bool = False  # multi-head latent attention (DeepSeek MLA)


@dataclass(frozen=True)
class RuntimeFlags:
    """A service's runtime flags as given; None = left out (auto)."""

    device: str | None = None
    dtype: str | None = None
    attention_backend: str | None = None
    num_kv_slots: int | None = None
    kv_cache_memory: str | None = None
    cuda_graph: bool = True  # False with --disable-cuda-graph
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class RuntimeChoice:
    """The resolved values a config is built from, and the line the service prints."""

    device: str
    dtype: str | None  # None = the checkpoint's (the target's, for a draft)
    attention_backend: str
    num_kv_slots: int
    kv_cache_memory: str | None
    cuda_graphs: bool  # whether decode / verify run in CUDA graphs (shown, not configured)
    shown_dtype: str  # e.g. "bf16 (the checkpoint's)"
    given: tuple[str, ...]  # the flags that were set, for the line

    def config_kwargs(self) -> dict:
        return {"device": self.device, "dtype": self.dtype,
                "attention_backend": self.attention_backend, "num_kv_slots": self.num_kv_slots,
                "kv_cache_memory": self.kv_cache_memory}  # fmt: skip

    def line(self, who: str) -> str:
        """``specmesh target: device cuda, dtype bf16 (the checkpoint's), attention flashinfer
        with CUDA graphs, KV cache 0.8 of free memory (defaults where CUDA is present; ...)``."""
        graphs = " with CUDA graphs" if self.cuda_graphs else ""
        kv = self.kv_cache_memory
        kv_text = f"{self.num_kv_slots} slots" if kv is None else kv
        kv_text += " of free memory" if kv is not None and _is_fraction(kv) else ""
        where = "where CUDA is present" if self.device.startswith("cuda") else "for a CPU"
        how = f"given: {', '.join(self.given)}" if self.given else (
            "--device, --dtype, --attention-backend, --kv-cache-memory to change")  # fmt: skip
        return (
            f"specmesh {who}: device {self.device}, dtype {self.shown_dtype}, attention "
            f"{self.attention_backend}{graphs}, KV cache {kv_text} (defaults {where}; {how})"
        )


def choose_runtime(flags: RuntimeFlags, facts: Facts, role: str = "target") -> RuntimeChoice:
    """Every value left out, from ``facts``; ``role``: "target" or "draft" (its KV fraction)."""
    cpu = CONFIGS[role]
    device = flags.device or ("cuda" if facts.cuda else cpu.device)
    on_cuda = device.split(":")[0] == "cuda"
    dtype = resolve_dtype(flags.dtype, device)
    backend = flags.attention_backend or (
        _fastest(facts, dtype) if on_cuda else cpu.attention_backend
    )
    slots, memory = flags.num_kv_slots, flags.kv_cache_memory
    if memory is None and slots is None and on_cuda and flags.tensor_parallel_size == 1:
        memory = KV_FRACTION[role]
    graphs = on_cuda and backend != "torch" and flags.cuda_graph
    return RuntimeChoice(
        device=device,
        dtype=dtype,
        attention_backend=backend,
        num_kv_slots=cpu.num_kv_slots if slots is None else slots,
        kv_cache_memory=memory,
        cuda_graphs=graphs and flags.tensor_parallel_size == 1,
        shown_dtype=dtype or _checkpoint_dtype(facts),
        given=_given(flags),
    )


def _fastest(facts: Facts, dtype: str | None) -> str:
    """FlashInfer where installed and its kernels take the model, else Triton (else torch)."""
    from specmesh.runtime.attention.torch_backend import FLASHINFER_HEAD_DIMS

    runs = dtype or facts.dtype
    if (
        "flashinfer" in facts.backends
        and runs in ("bf16", "fp16")
        and facts.head_dim in FLASHINFER_HEAD_DIMS
        and not facts.latent
    ):
        return "flashinfer"
    return "triton" if "triton" in facts.backends else "torch"


def _checkpoint_dtype(facts: Facts) -> str:
    return f"{facts.dtype} (the checkpoint's)" if facts.dtype else "the checkpoint's"


def _given(flags: RuntimeFlags) -> tuple[str, ...]:
    named = {
        "--device": flags.device,
        "--dtype": flags.dtype,
        "--attention-backend": flags.attention_backend,
        "--num-kv-slots": flags.num_kv_slots,
        "--kv-cache-memory": flags.kv_cache_memory,
    }
    return tuple(flag for flag, value in named.items() if value is not None)  # fmt: skip


def _is_fraction(memory: str) -> bool:
    try:
        return float(memory) <= 1
    except ValueError:
        return False


def machine_facts() -> Facts:
    """CUDA and the optional kernels of this machine (imports torch)."""
    import torch

    installed = frozenset(n for n in OPTIONAL_BACKENDS if importlib.util.find_spec(n) is not None)
    return Facts(cuda=torch.cuda.is_available(), backends=installed)


def checkpoint_facts(facts: Facts, model_dir: str | None, dtype_dir: str | None = None) -> Facts:
    """``facts`` with the head size and attention kind of ``model_dir``'s config.json and the
    dtype of ``dtype_dir``'s (default the same; a draft runs its target's). Unknown (None) where
    a config is missing or unreadable: the service's load reports that itself."""
    config = _read_config(model_dir)
    text = config.get("text_config") or config  # LLaVA: its language model's
    heads = text.get("num_attention_heads")
    head_dim = text.get("head_dim") or (text.get("hidden_size", 0) // heads if heads else None)
    source = config if dtype_dir is None else _read_config(dtype_dir)
    dtype = source.get("dtype") or source.get("torch_dtype")
    return Facts(
        cuda=facts.cuda,
        backends=facts.backends,
        head_dim=head_dim,
        dtype=_DTYPE_NAMES.get(dtype, dtype),
        latent="kv_lora_rank" in text,
    )


def _read_config(model_dir: str | None) -> dict:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()) if model_dir else {}
    except (OSError, ValueError):
        return {}


def parse_device(flags: list[str]) -> str | None:
    """The value of the last ``--device`` among a child's pass-through flags."""
    found = None
    for i, flag in enumerate(flags):
        if flag.startswith("--device="):
            found = flag.split("=", 1)[1]
        elif flag == "--device" and i + 1 < len(flags):
            found = flags[i + 1]
    return found


def shared_gpu_flags(cuda: bool, by_kind: dict[str, list[str]], with_draft: bool) -> dict:
    """``specmesh up``'s additions on a machine with CUDA: target and draft on the same device
    (``--device cuda`` unless one is given), and ``--num-micro-batches 1`` for the router when
    they share a CUDA device (two half-size steps queue on one GPU) unless it is given."""
    added: dict[str, list[str]] = {"target": [], "draft": [], "router": []}
    if not cuda:
        return added
    devices = {}
    for kind in ("target", "draft") if with_draft else ("target",):
        devices[kind] = parse_device(by_kind[kind])
        if devices[kind] is None:
            devices[kind] = "cuda"
            added[kind] = ["--device", "cuda"]
    same = {d if ":" in d else f"{d}:0" for d in devices.values()}
    micro = any(f.split("=")[0] == "--num-micro-batches" for f in by_kind["router"])
    if with_draft and len(same) == 1 and same.pop().startswith("cuda") and not micro:
        added["router"] = ["--num-micro-batches", "1"]
    return added
