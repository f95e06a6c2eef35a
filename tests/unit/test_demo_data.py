"""The demo's data: the corpus rule with extra sources (on fake stdlib / site-packages trees),
streams and windows, bits per byte; the presets' sizes and names (no training)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specmesh.demo import data as demo_data
from specmesh.demo.config import FULL, GPU, QUICK, DemoConfig
from specmesh.demo.corpus import installed_package_roots, is_heldout, load_corpus
from specmesh.demo.draft_train import aux_layer_ids
from specmesh.demo.make import build_draft, resolve_device, resolve_preset
from specmesh.demo.prepare import prepare_data
from specmesh.demo.progress import Progress
from specmesh.demo.target import build_target, eval_loss

HELD, EVAL_ONLY, SIX = "def held():\n    return 2\n", "class Module:\n    pass\n", "PY3 = True\n"
STDLIB = {
    "a.py": "def a():\n    return 1\n",
    "b.py": HELD,  # held out at 50%
    "e.py": "E = 'e'\n",
    "pkg/g.py": "from . import e\n",
    "test/t.py": "assert True\n",  # a test folder: excluded
    "site-packages/x.py": "X = 1\n",  # inside the stdlib: excluded
}
SITE = {
    "numpy/core.py": "import math\n\nTAU = 2 * math.pi\n",
    "numpy/tests/test_core.py": "def test(): pass\n",  # excluded
    "numpy/copy_of_heldout.py": HELD,  # dropped: a held-out file's content
    "numpy/copy_of_stdlib.py": "E = 'e'\n",  # dropped: the stdlib training copy came first
    "torch/nn.py": EVAL_ONLY,  # eval-only
    "transformers/modeling.py": "def forward(x):\n    return x\n",  # eval-only
    "vendored/nn.py": EVAL_ONLY,  # dropped: an eval-only file's content
    "six.py": SIX,
    "other/six_copy.py": SIX,  # one of the two is kept
    "blank.py": "   \n",  # skipped
}
CFG = replace(QUICK, heldout_percent=50, max_train_bytes=None, extra_sources=True)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "latin1.py").write_bytes(b"# caf\xe9\n")  # not UTF-8: skipped
    return root


@pytest.fixture
def trees(tmp_path: Path) -> tuple[Path, Path]:
    return write_tree(tmp_path / "stdlib", STDLIB), write_tree(tmp_path / "site", SITE)


def test_extra_sources_keep_eval_text_out_of_training(trees):
    stdlib, site = trees
    assert is_heldout("b.py", 50) and not any(
        is_heldout(p, 50) for p in ("a.py", "e.py", "pkg/g.py")
    )
    corpus = load_corpus(CFG, stdlib, [site])
    assert corpus.heldout.files == ["b.py"]
    assert corpus.eval_only.files == ["torch/nn.py", "transformers/modeling.py"]
    train = corpus.train.files
    assert train[:3] == ["a.py", "e.py", "pkg/g.py"]  # stdlib first, then the packages, sorted
    assert (
        train[3] == "numpy/core.py"
        and len(train) == 5
        and train[4] in ("six.py", "other/six_copy.py")
    )
    evaluated = set(corpus.heldout.texts) | set(corpus.eval_only.texts)
    assert not evaluated & set(corpus.train.texts)
    assert len(set(corpus.train.texts)) == len(corpus.train.texts)
    counts = {s.name: (s.num_files, s.num_bytes) for s in corpus.sources}
    assert counts["stdlib train"][0] == 3 and counts["installed packages train"][0] == 2
    assert counts["eval-only (torch, transformers)"] == (2, corpus.eval_only.num_bytes)
    assert corpus.train.num_bytes == sum(len(t.encode()) for t in corpus.train.texts)
    assert dict(corpus.package_bytes)["numpy"] == len(SITE["numpy/core.py"])


def test_without_extra_sources_only_the_stdlib(trees):
    stdlib, site = trees
    corpus = load_corpus(replace(CFG, extra_sources=False), stdlib, [site])
    assert corpus.train.files == ["a.py", "e.py", "pkg/g.py"] and not corpus.eval_only.files
    assert [s.name for s in corpus.sources] == ["stdlib train", "stdlib held out"]
    assert all(root.is_dir() for root in installed_package_roots())


def test_train_cap_and_tokenizer_sample(trees):
    """The cap stops before the file that would pass it (never at an empty set); the packages
    only fill what the stdlib leaves."""
    stdlib, site = trees
    stdlib_bytes = sum(len(STDLIB[p]) for p in ("a.py", "e.py", "pkg/g.py"))
    corpus = load_corpus(replace(CFG, max_train_bytes=stdlib_bytes + 12), stdlib, [site])
    assert corpus.train.files[:3] == ["a.py", "e.py", "pkg/g.py"] and len(corpus.train.files) == 4
    corpus = load_corpus(replace(CFG, max_train_bytes=stdlib_bytes - 1), stdlib, [site])
    assert corpus.train.files[:2] == ["a.py", "e.py"] and "pkg/g.py" not in corpus.train.files
    assert corpus.train.num_bytes <= stdlib_bytes - 1
    sample = corpus.train.sample(12)
    assert sample == corpus.train.sample(12) and 0 < sum(map(len, sample)) <= 12
    assert corpus.train.sample(None) == corpus.train.texts


def test_prepare_data_streams_and_bytes(trees):
    stdlib, site = trees
    prepared = prepare_data(CFG, torch.device("cpu"), Progress("test", False), stdlib, [site])
    lengths = prepared.byte_lengths
    for stream, text in [
        (prepared.train_stream, prepared.corpus.train),
        (prepared.eval_only_stream, prepared.corpus.eval_only),
    ]:
        assert int((stream == prepared.tokenizer.bos_token_id).sum()) == len(text.files)
        assert int(lengths[stream].sum()) == text.num_bytes


def test_encode_stream_in_chunks_equals_per_file(monkeypatch):
    texts = ["x = 1\n", "def f(a):\n    return a  # π ≈ 3.14\n", "print('ünïcode')\n"]
    tokenizer = demo_data.train_tokenizer(texts * 20, 300, 64)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    expected = [bos, *tokenizer(texts[0], add_special_tokens=False)["input_ids"], eos]
    expected += [bos, *tokenizer(texts[1], add_special_tokens=False)["input_ids"], eos]
    expected += [bos, *tokenizer(texts[2], add_special_tokens=False)["input_ids"], eos]
    monkeypatch.setattr(demo_data, "ENCODE_CHUNK_CHARS", 10)  # one file per encode_batch
    stream = demo_data.encode_stream(tokenizer, texts)
    assert stream.dtype == torch.int64 and stream.tolist() == expected
    lengths = demo_data.token_byte_lengths(tokenizer)
    assert int(lengths[stream].sum()) == len("".join(texts).encode())


def test_covering_windows_predict_every_token_once():
    stream = torch.arange(23)
    windows = demo_data.covering_windows(stream, 8)
    assert [tuple(w.shape) for w in windows] == [(3, 8), (1, 2)]
    assert torch.equal(torch.cat([w[:, 1:].flatten() for w in windows]), stream[1:])
    assert demo_data.covering_windows(torch.arange(15), 8)[-1].shape == (2, 8)


def test_bits_per_byte_of_a_uniform_model():
    """Zero weights give uniform logits: ln V nats per token, so bits/byte is known exactly."""
    text = "def f(x):\n    return x * 2  # ünïcode\n" * 4
    tokenizer = demo_data.train_tokenizer([text], 280, 64)
    vocab = len(tokenizer)
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    torch.nn.init.zeros_(model.get_input_embeddings().weight)
    stream = demo_data.encode_stream(tokenizer, [text])
    lengths = demo_data.token_byte_lengths(tokenizer)
    windows = demo_data.covering_windows(stream, 16)
    loss = sum(
        (eval_loss(model, w, lengths) for w in windows[1:]), eval_loss(model, windows[0], lengths)
    )
    assert loss.num_tokens == stream.numel() - 1 and loss.num_bytes == len(text.encode())
    assert loss.nats_per_token == pytest.approx(math.log(vocab), rel=1e-5)
    expected = math.log2(vocab) * (stream.numel() - 1) / len(text.encode())
    assert loss.bits_per_byte == pytest.approx(expected, rel=1e-5)


class FakeTokenizer:
    bos_token_id, eos_token_id, pad_token_id = 0, 1, 2

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def pair_params(cfg: DemoConfig) -> tuple[int, int]:
    """(target, draft) parameter counts of a fresh pair built by the demo's own builders."""
    target = build_target(cfg, FakeTokenizer(cfg.vocab_size))
    draft = build_draft(cfg, target, torch.arange(cfg.draft_vocab_size))
    assert target.config.head_dim == cfg.head_dim == draft.shape.head_dim
    return sum(p.numel() for p in target.parameters()), sum(p.numel() for p in draft.parameters())


def test_full_size_fits_budget():
    """bf16 target + draft of the full configuration stay within 20 MB."""
    assert 2 * sum(pair_params(FULL)) <= 20e6
    assert len(set(aux_layer_ids(FULL.num_layers))) == 3


def test_gpu_preset_sizes():
    """hidden 320 / 8 layers / head_dim 64: a 9.9M-parameter target, 19.8 MB in bf16 (the
    draft adds 4.4 MB)."""
    target_params, draft_params = pair_params(GPU)
    assert GPU.head_dim == 64 and target_params == 9_917_760 and draft_params == 2_182_400
    assert 19.5e6 < 2 * target_params <= 20e6
    assert GPU.extra_sources and GPU.batch_tokens == 65_536 and GPU.vocab_size == 4096
    assert len(set(aux_layer_ids(GPU.num_layers))) == 3


def test_preset_and_device_resolution():
    assert resolve_preset(None, False) == "full" and resolve_preset(None, True) == "quick"
    assert resolve_preset("gpu", False) == "gpu"
    with pytest.raises(ValueError):
        resolve_preset("gpu", True)
    with pytest.raises(ValueError):
        resolve_preset("huge", False)
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            resolve_device("cuda")
