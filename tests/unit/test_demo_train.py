"""The demo pair builder (`specmesh.demo`): quick mode end to end, formats, the draft's math,
and the pair comparison on the quick pair."""

from __future__ import annotations

import dataclasses
import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specmesh.cli.main import build_parser
from specmesh.demo import DemoReport, make_demo
from specmesh.demo import compare as demo_compare
from specmesh.demo.config import FULL, QUICK
from specmesh.demo.corpus import is_heldout, list_py_files
from specmesh.demo.draft_train import aux_hidden_indices, aux_layer_ids
from specmesh.demo.eagle3 import DraftShape, Eagle3Draft, load_draft
from specmesh.demo.target import CHAT_TEMPLATE

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory) -> tuple[Path, DemoReport]:
    out_dir = tmp_path_factory.mktemp("demo")
    report = make_demo(out_dir, seed=0, preset="quick", device="cpu", progress=False)
    return out_dir, report


def expected_draft_tensors(cfg: dict) -> dict[str, tuple[list[int], torch.dtype]]:
    h, ht, hd = cfg["hidden_size"], cfg["target_hidden_size"], cfg["head_dim"]
    q, kv, inter = (
        cfg["num_attention_heads"] * hd,
        cfg["num_key_value_heads"] * hd,
        cfg["intermediate_size"],
    )
    bf16 = torch.bfloat16
    return {
        "fc.weight": ([h, 3 * ht], bf16),
        "midlayer.self_attn.q_proj.weight": ([q, 2 * h], bf16),
        "midlayer.self_attn.k_proj.weight": ([kv, 2 * h], bf16),
        "midlayer.self_attn.v_proj.weight": ([kv, 2 * h], bf16),
        "midlayer.self_attn.o_proj.weight": ([h, q], bf16),
        "midlayer.mlp.gate_proj.weight": ([inter, h], bf16),
        "midlayer.mlp.up_proj.weight": ([inter, h], bf16),
        "midlayer.mlp.down_proj.weight": ([h, inter], bf16),
        "midlayer.input_layernorm.weight": ([h], bf16),
        "midlayer.hidden_norm.weight": ([h], bf16),
        "midlayer.post_attention_layernorm.weight": ([h], bf16),
        "norm.weight": ([h], bf16),
        "lm_head.weight": ([cfg["draft_vocab_size"], h], bf16),
        "d2t": ([cfg["draft_vocab_size"]], torch.int64),
        "t2d": ([cfg["vocab_size"]], torch.bool),
    }


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def check_draft_dir(draft_dir: Path, target_config: LlamaConfig) -> None:
    cfg = json.loads((draft_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == target_config.vocab_size
    assert cfg["target_hidden_size"] == target_config.hidden_size
    num_layers = target_config.num_hidden_layers
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [1, num_layers // 2 - 1, num_layers - 4] and len(set(ids)) == 3
    assert cfg["rope_theta"] != target_config.rope_parameters["rope_theta"]

    tensors = read_safetensors(draft_dir / "model.safetensors")
    expected = expected_draft_tensors(cfg)
    assert sorted(tensors) == sorted(expected)  # exactly these: no embed_tokens
    for name, (shape, dtype) in expected.items():
        assert list(tensors[name].shape) == shape, name
        assert tensors[name].dtype == dtype, name

    d2t, t2d = tensors["d2t"], tensors["t2d"]
    hot = torch.arange(d2t.numel()) + d2t  # target = draft + d2t[draft]
    assert int(t2d.sum()) == cfg["draft_vocab_size"]
    assert torch.equal(hot, t2d.nonzero().flatten())  # ascending, and the same set as t2d


def test_quick_demo_writes_loadable_target(quick_demo):
    out_dir, report = quick_demo
    target_dir = out_dir / "target"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (target_dir / name).is_file(), name
    assert (out_dir / "README.md").read_text().startswith("# specmesh demo pair")

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
    )
    assert tokenizer.chat_template == CHAT_TEMPLATE  # chat works on a freshly made pair
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    ids = tokenizer(source)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == source

    model = LlamaForCausalLM.from_pretrained(target_dir)
    assert model.dtype == torch.bfloat16
    assert model.config.vocab_size == len(tokenizer) == report.vocab_size
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    logits = model(input_ids=torch.tensor([ids[:16]])).logits
    assert logits.shape == (1, 16, len(tokenizer)) and torch.isfinite(logits).all()


def test_quick_demo_draft_format(quick_demo):
    out_dir, _ = quick_demo
    target_config = LlamaConfig.from_pretrained(out_dir / "target")
    check_draft_dir(out_dir / "draft", target_config)


def test_quick_demo_heldout_split_and_report(quick_demo):
    out_dir, report = quick_demo
    heldout = (out_dir / "heldout_files.txt").read_text().split()
    assert heldout and len(heldout) == report.num_heldout_files
    all_files = list_py_files(Path(sysconfig.get_paths()["stdlib"]))
    train = {p for p in all_files if not is_heldout(p, QUICK.heldout_percent)}
    assert set(heldout) <= set(all_files) and not set(heldout) & train
    assert all(is_heldout(p, QUICK.heldout_percent) for p in heldout)
    assert not any("site-packages" in p or p.startswith(("test/", "idlelib/")) for p in all_files)

    assert math.isfinite(report.target_eval_loss) and report.target_eval_loss > 0
    assert 0 < report.target_eval_bits_per_byte < report.target_eval_loss
    assert report.eval_only_loss is None and report.eval_only_tokens == 0  # stdlib only
    assert (report.preset, report.device) == ("quick", "cpu")
    assert [s.name for s in report.sources] == ["stdlib train", "stdlib held out"]
    assert (
        f"{report.target_eval_bits_per_byte:.3f} bits/byte" in (out_dir / "README.md").read_text()
    )
    assert len(report.draft_step_accuracy) == QUICK.num_draft_steps
    assert len(report.chain_conditional_acceptance) == QUICK.num_draft_steps
    assert 1.0 <= report.chain_mean_accept_length <= 1 + QUICK.num_draft_steps
    assert report.aux_layer_ids == [1, QUICK.num_layers // 2 - 1, QUICK.num_layers - 4]


def test_load_draft_reads_what_was_saved(quick_demo):
    out_dir, _ = quick_demo
    draft = load_draft(out_dir / "draft")
    saved = read_safetensors(out_dir / "draft" / "model.safetensors")
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, saved[name].to(tensor.dtype)), name
    assert draft.shape.draft_vocab_size == QUICK.draft_vocab_size and not draft.training


def transformers_bits_per_byte(target_dir: Path, texts: list[str]) -> float:
    """The oracle: transformers' own mean loss over windows of the context overlapping by one."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = []
    for text in texts:
        ids += [tokenizer.bos_token_id, *tokenizer(text, add_special_tokens=False)["input_ids"]]
        ids.append(tokenizer.eos_token_id)
    context, nll = model.config.max_position_embeddings, 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, context - 1):
            window = torch.tensor([ids[start : start + context]])
            nll += model(input_ids=window, labels=window).loss.item() * (window.shape[1] - 1)
    return nll / len("".join(texts).encode()) / math.log(2)


def test_compare_scores_the_quick_pair(quick_demo, tmp_path, capsys):
    out_dir, _ = quick_demo
    flags = ["--max-bytes", "20000", "--chain-prompts", "2", "--prompt-len", "16",
             "--new-tokens", "8", "--depth", "3"]  # fmt: skip
    out = tmp_path / "compare.json"
    assert demo_compare.main([str(out_dir), str(out_dir), *flags, "--out", str(out)]) == 0
    assert "bits/byte" in capsys.readouterr().out
    result = json.loads(out.read_text())
    first, second = result["pairs"]
    assert {**first, "seconds": 0} == {**second, "seconds": 0}  # same pair, same numbers

    settings = demo_compare.CompareSettings(max_bytes=20_000)
    text = demo_compare.heldout_text(settings)
    assert result["heldout_files"] == text.files and all(is_heldout(p, 5) for p in text.files)
    assert first["num_bytes"] == text.num_bytes == result["heldout_bytes"]
    oracle = transformers_bits_per_byte(out_dir / "target", text.texts)
    assert first["bits_per_byte"] == pytest.approx(oracle, rel=1e-4)
    assert len(first["chain_conditional_acceptance"]) == 3 and first["chain_rounds"] > 0
    assert 1.0 <= first["chain_mean_accept_length"] <= 4.0


def test_a_run_from_an_earlier_target_trains_it_further_or_keeps_it(
    quick_demo, tmp_path, monkeypatch
):
    """``init_from``: the earlier run's tokenizer and weights; with no target steps the target
    is saved as it was and only a new draft is trained (the shipped pair's last run)."""
    from specmesh.demo import make as demo_make

    earlier, _ = quick_demo
    kept = dataclasses.replace(QUICK, target_max_steps=0, lineage="RUN1 then RUN2")
    monkeypatch.setitem(demo_make.PRESETS, "quick-draft", kept)
    report = make_demo(tmp_path, preset="quick-draft", init_from=earlier, progress=False)
    assert report.target_steps == 0 and report.draft_steps == QUICK.draft_max_steps
    before = read_safetensors(earlier / "target" / "model.safetensors")
    after = read_safetensors(tmp_path / "target" / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert (earlier / "target" / "tokenizer.json").read_text() == (
        tmp_path / "target" / "tokenizer.json"
    ).read_text()
    card = (tmp_path / "README.md").read_text()
    assert "--init-from EARLIER_RUN" in card and str(earlier) not in card  # the name, not a path
    assert "the target of `EARLIER_RUN` (RUN1 then RUN2), not trained further" in card
    more = make_demo(tmp_path / "more", preset="quick", init_from=earlier, progress=False)
    assert more.target_steps == QUICK.target_max_steps
    assert more.target_eval_loss < report.target_eval_loss  # trained again from there


def test_make_demo_cli_flags():
    def parse(*argv: str):
        return build_parser("make-demo").parse_args(["make-demo", "OUT", *argv])

    assert (parse().preset, parse().device) == ("full", "cpu")
    assert parse("--quick").preset == "quick"
    gpu = parse("--preset", "gpu", "--device", "cuda", "--time-budget", "470")
    assert (gpu.preset, gpu.device, gpu.time_budget) == ("gpu", "cuda", 470.0)


def test_aux_taps_are_layer_inputs():
    """hidden_states[i] of transformers is the input of layer i, so ids = indices - 1."""
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=8,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = LlamaForCausalLM(config).eval()
    inputs: dict[int, torch.Tensor] = {}

    def record(index: int):
        def hook(_module, args, kwargs) -> None:
            inputs[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return hook

    for index, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(record(index), with_kwargs=True)
    out = model(input_ids=torch.arange(6)[None], output_hidden_states=True)
    assert aux_hidden_indices(8) == [2, 4, 5] and aux_layer_ids(8) == [1, 3, 4]
    for index in aux_hidden_indices(8):
        assert torch.equal(out.hidden_states[index], inputs[index])


@pytest.mark.parametrize("feed_drafted", [False, True])
def test_draft_training_forward_matches_incremental_decode(feed_drafted):
    """The batched training-time-test forward == one row decoded step by step, engine style:
    step-0 keys of rows 0..p (draft extend), then each step's query over them plus its chain."""
    torch.manual_seed(0)
    shape = DraftShape(32, 48, 4, 2, 64, vocab_size=100, draft_vocab_size=40,
                       rope_theta=5e4, max_position_embeddings=64)  # fmt: skip
    draft = Eagle3Draft(shape).eval()
    draft.set_hot_vocab(torch.arange(0, 80, 2))
    batch, rows, steps = 2, 10, 3
    aux = torch.randn(batch, rows, 3 * 48)
    embed = torch.randn(100, 32)
    tokens = torch.randint(0, 100, (batch, rows + steps - 1))
    layer, attn = draft.midlayer, draft.midlayer.self_attn
    with torch.no_grad():
        batched = draft(aux, tokens, embed, steps, feed_drafted=feed_drafted)
        fc_out = draft.fc(aux)  # [B, T, H]

        def inputs(token: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
            return torch.cat([layer.input_layernorm(embed[token]), layer.hidden_norm(hidden)], -1)

        for row in (0, 4, rows - 1):
            keys, values = [], []
            for q in range(row + 1):  # the prefix, one token at a time
                _, k, v = attn.project(inputs(tokens[:, q : q + 1], fc_out[:, q : q + 1]),
                                       torch.tensor([q]))  # fmt: skip
                keys.append(k)
                values.append(v)
            hidden, token = fc_out[:, row : row + 1], tokens[:, row : row + 1]
            for step in range(steps):
                query, k, v = attn.project(inputs(token, hidden), torch.tensor([row + step]))
                if step > 0:
                    keys.append(k)
                    values.append(v)
                r = hidden + attn.attend(query, keys, values, None)
                hidden = r + layer.mlp(layer.post_attention_layernorm(r))
                logits = draft.lm_head(draft.norm(hidden))  # [B, 1, Vd]
                torch.testing.assert_close(logits[:, 0], batched[step][:, row])
                if feed_drafted:
                    token = draft.to_target_ids(logits.argmax(-1))
                else:
                    token = tokens[:, row + step + 1 : row + step + 2]


@pytest.mark.skipif(
    not (REPO / "models/demo/draft/config.json").is_file(), reason="no committed demo pair"
)
def test_committed_demo_pair():
    demo = REPO / "models/demo"
    sizes = [p.stat().st_size for p in demo.rglob("*") if p.is_file()]
    assert sum(sizes) <= 20e6
    target_config = LlamaConfig.from_pretrained(demo / "target")
    check_draft_dir(demo / "draft", target_config)
    heldout = (demo / "heldout_files.txt").read_text().split()
    assert heldout and all(is_heldout(p, FULL.heldout_percent) for p in heldout)
