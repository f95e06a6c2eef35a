"""`specmesh.demo.finetune`: the demo target trained further on a domain's traffic files (never
its held-out ones), written as a checkpoint the engine and transformers load."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from specmesh.bench.online_data import domain_files
from specmesh.defaults import default_models
from specmesh.demo.data import encode_stream
from specmesh.demo.finetune import Budget, finetune, heldout_loss, read_texts
from specmesh.router.tokenizer import load_tokenizer

LINE = "function add{i}(a, b) {{ return a + b * {i}; }}\n"


def test_finetune_learns_the_domain_and_writes_a_loadable_target(tmp_path: Path) -> None:
    files = tmp_path / "js"
    for n in range(40):
        (files / f"pkg{n}").mkdir(parents=True)
        (files / f"pkg{n}" / "index.js").write_text(
            "".join(LINE.format(i=i % 7) for i in range(60))
        )
    held, served = domain_files("javascript", files)
    assert held and served  # the evaluation reads only the held-out ones
    out = tmp_path / "target"
    stats, before, after = finetune(out, "javascript", Budget(seconds=1e9, steps=2, lr=2e-3),
                                    root=files)  # fmt: skip
    assert stats.num_steps == 2 and after < before
    # the written checkpoint (bf16) carries what was learned: the domain's held-out loss falls
    texts = read_texts(held, 1e6)
    stream = encode_stream(load_tokenizer(out), texts)
    tuned, source = (LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
                     for d in (out, default_models().target))  # fmt: skip
    assert heldout_loss(tuned, stream) < heldout_loss(source, stream) - 0.1
    assert (out / "tokenizer.json").read_bytes() == (
        Path(default_models().target) / "tokenizer.json"
    ).read_bytes()
