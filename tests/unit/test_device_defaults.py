"""The runtime a model service picks when its flags are left out (`specmesh.device_defaults`),
checked on this CPU machine by injecting the machine's and the checkpoint's facts: a CPU keeps
the config dataclasses' defaults; where CUDA is present the device, the checkpoint's dtype, the
fastest backend that runs the model (FlashInfer where installed and the head size allows, else
Triton) with CUDA graphs, and a KV cache sized from free memory; given flags win; each service
prints its choice in one line; `specmesh up` puts target and draft on one GPU and gives the
router one micro-batch then."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from up_harness import up

from specmesh import device_defaults as rd
from specmesh.device_defaults import Facts, RuntimeFlags, choose_runtime
from specmesh.protocol.config import DraftConfig, TargetConfig

BOTH = frozenset({"triton", "flashinfer"})
GPU = Facts(cuda=True, backends=BOTH, head_dim=128, dtype="bf16")


@pytest.mark.parametrize("role,cls", [("target", TargetConfig), ("draft", DraftConfig)])
def test_a_cpu_machine_keeps_the_config_defaults(role: str, cls: type) -> None:
    c = choose_runtime(RuntimeFlags(), Facts(cuda=False, backends=BOTH, head_dim=128), role)
    assert (c.device, c.attention_backend, c.num_kv_slots) == (
        cls.device, cls.attention_backend, cls.num_kv_slots)  # fmt: skip
    assert (c.dtype, c.kv_cache_memory, c.cuda_graphs) == ("fp32", None, False)


def test_with_cuda_the_device_the_checkpoint_dtype_flashinfer_graphs_and_free_memory() -> None:
    target, draft = (
        choose_runtime(RuntimeFlags(), GPU),
        choose_runtime(RuntimeFlags(), GPU, "draft"),
    )
    assert (target.device, target.dtype, target.attention_backend) == ("cuda", None, "flashinfer")
    assert target.cuda_graphs and target.shown_dtype == "bf16 (the checkpoint's)"
    assert (target.kv_cache_memory, draft.kv_cache_memory) == ("0.8", "0.1")


@pytest.mark.parametrize(
    "facts",
    [
        Facts(cuda=True, backends=BOTH, head_dim=32, dtype="bf16"),  # the demo pair's heads
        Facts(cuda=True, backends=BOTH, head_dim=128, dtype="fp32"),
        Facts(cuda=True, backends=BOTH, head_dim=192, dtype="bf16", latent=True),  # MLA
        Facts(cuda=True, backends=frozenset({"triton"}), head_dim=128, dtype="bf16"),
        Facts(cuda=True, backends=BOTH),  # no readable config
    ],
)
def test_triton_where_flashinfer_cannot_run_the_model(facts: Facts) -> None:
    choice = choose_runtime(RuntimeFlags(), facts)
    assert choice.attention_backend == "triton" and choice.cuda_graphs


def test_given_flags_win_and_the_device_picks_the_other_defaults() -> None:
    on_cpu = choose_runtime(RuntimeFlags(device="cpu"), GPU)  # a GPU machine, told cpu
    assert (on_cpu.attention_backend, on_cpu.dtype, on_cpu.kv_cache_memory) == (
        "torch",
        "fp32",
        None,
    )
    on_cuda = choose_runtime(RuntimeFlags(device="cuda:1"), Facts(cuda=False, backends=BOTH))
    assert (on_cuda.attention_backend, on_cuda.kv_cache_memory) == ("triton", "0.8")
    given = RuntimeFlags(dtype="fp16", attention_backend="torch", num_kv_slots=4096)
    c = choose_runtime(given, GPU)
    assert (c.dtype, c.attention_backend, c.num_kv_slots, c.kv_cache_memory) == (
        "fp16", "torch", 4096, None)  # fmt: skip
    assert not c.cuda_graphs and c.given == ("--dtype", "--attention-backend", "--num-kv-slots")
    assert choose_runtime(RuntimeFlags(kv_cache_memory="4GiB"), GPU).kv_cache_memory == "4GiB"
    assert not choose_runtime(RuntimeFlags(cuda_graph=False), GPU).cuda_graphs
    tp = choose_runtime(RuntimeFlags(tensor_parallel_size=2), GPU)  # a fraction is refused there
    assert (tp.kv_cache_memory, tp.num_kv_slots, tp.cuda_graphs) == (None, 65536, False)


def test_checkpoint_facts_read_config_json(tmp_path: Path, tiny_dir: Path) -> None:
    base = Facts(cuda=True, backends=BOTH)
    llava = {"text_config": {"hidden_size": 512, "num_attention_heads": 4}, "dtype": "float16"}
    mla = {"num_attention_heads": 4, "head_dim": 64, "kv_lora_rank": 32, "torch_dtype": "bfloat16"}
    for name, config in {"llava": llava, "mla": mla}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert rd.checkpoint_facts(base, str(tmp_path / "llava")) == Facts(True, BOTH, 128, "fp16")
    assert rd.checkpoint_facts(base, str(tmp_path / "mla")).latent
    draft = rd.checkpoint_facts(base, str(tiny_dir / "draft"), str(tmp_path / "mla"))
    assert draft.dtype == "bf16" and draft.head_dim  # its target's dtype
    assert rd.checkpoint_facts(base, str(tmp_path / "none")) == base


def _parse(*argv: str):
    from specmesh.cli.main import build_parser

    return build_parser(argv[0]).parse_args(list(argv))


def test_each_service_resolves_before_its_config_and_prints_one_line(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from specmesh.cli.cmd_serve import _runtime_kwargs

    target = str(tiny_dir / "target")
    kw = _runtime_kwargs(_parse("target", "--model", target), "target", target)
    assert (kw["device"], kw["attention_backend"], kw["num_kv_slots"]) == ("cpu", "torch", 65536)
    assert (kw["dtype"], kw["kv_cache_memory"]) == ("fp32", None)
    line = capsys.readouterr().err
    assert line.startswith("specmesh target: device cpu, dtype fp32, attention torch, KV cache")
    assert line.count("\n") == 1 and "defaults for a CPU" in line
    monkeypatch.setattr(rd, "machine_facts", lambda: Facts(cuda=True, backends=BOTH))
    args = _parse("draft", "--kind", "eagle3", "--target-model", target, "--dtype", "bf16")
    kw = _runtime_kwargs(args, "draft", str(tiny_dir / "draft"), target)
    assert (kw["device"], kw["dtype"], kw["attention_backend"]) == ("cuda", "bf16", "triton")
    assert kw["kv_cache_memory"] == "0.1" and TargetConfig(target, **kw).device == "cuda"
    line = capsys.readouterr().err  # the tiny draft's head_dim is no FlashInfer size
    assert line.startswith("specmesh draft: device cuda, dtype bf16, attention triton with CUDA")
    assert "given: --dtype" in line


def test_up_shares_one_gpu_and_runs_one_micro_batch(started, monkeypatch) -> None:
    assert up() == 0  # this machine: no CUDA, nothing added
    assert not any(
        "--device" in c or "--num-micro-batches" in c for cs in started.values() for c in cs
    )
    monkeypatch.setattr(rd, "machine_facts", lambda: Facts(cuda=True, backends=BOTH))
    for kind in list(started):
        started.pop(kind)
    assert up("--served-model-name", "tiny", "--target-revision", "v1") == 0
    (target,), (draft,), (router,) = started["target"], started["draft"], started["router"]
    assert _value(target, "--device") == _value(draft, "--device") == "cuda"
    assert (
        _value(router, "--num-micro-batches") == "1"
        and _value(router, "--served-model-name") == "tiny"
    )
    assert _value(target, "--revision") == _value(draft, "--target-revision") == "v1"


@pytest.mark.parametrize(
    "given,micro",
    [
        ({"target": ["--device", "cuda:1"]}, None),  # two GPUs
        ({"router": ["--num-micro-batches=2"]}, None),  # the user's choice
        ({"draft": ["--device=cuda:0"]}, ["--num-micro-batches", "1"]),  # cuda is cuda:0
        ({"target": ["--device=cpu"], "draft": ["--device=cpu"]}, None),
    ],
)
def test_up_leaves_given_devices_and_micro_batches(given: dict, micro) -> None:
    by_kind = {"target": [], "draft": [], "router": [], **given}
    added = rd.shared_gpu_flags(True, by_kind, with_draft=True)
    assert added["router"] == (micro or [])
    for kind in ("target", "draft"):
        assert added[kind] == ([] if kind in given else ["--device", "cuda"])


def _value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None
