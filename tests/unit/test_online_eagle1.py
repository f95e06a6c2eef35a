"""Online learning of an EAGLE-1 head: the training forward is the served draft's, step by step
(the extend's root and every decode step of a chain), and a learned version serves the target's
greedy output, is checkpointed in the format the draft loads and is resumed after a restart."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from conftest import hf_greedy, record_step_logits
from online_traffic import KeepAll, learning_engine, prompts

from specmesh.draft_service.online import attach_learner
from specmesh.draft_service.online.buffer import Window
from specmesh.draft_service.online.checkpoints import Checkpoints
from specmesh.draft_service.online.head import Eagle1Head, make_batch
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import ExtendInput
from specmesh.runtime.tiny import make_tiny_target
from specmesh.runtime.tiny_drafts import make_tiny_draft

NUM_STEPS = 4


def test_every_step_is_the_served_drafts(tmp_path: Path) -> None:
    """A random EAGLE-1 head: the root's logits are step 0's at the last row, and the logits of
    each decode step of the served chain (topk 1) are step j's there, fed the chain's tokens."""
    target = make_tiny_target(tmp_path / "target", num_hidden_layers=2)
    draft = make_tiny_draft(tmp_path / "eagle", target, "eagle")
    cfg = DraftConfig("eagle", str(draft), str(target), SpecParams(NUM_STEPS, 1, NUM_STEPS + 1),
                      num_kv_slots=2048)  # fmt: skip
    runtime = load_draft(cfg)
    net = runtime.drafter.net
    g = torch.Generator().manual_seed(0)
    n = 24
    ids, feats = (
        torch.randint(3, 300, (n,), generator=g),
        torch.randn(n, net.feature_width, generator=g),
    )
    res = runtime.step([ExtendInput("r", ids[:-1].tolist(), int(ids[-1]), feats[:-1], new=True)],
                       propose=False)  # fmt: skip
    assert not res.errors
    served = record_step_logits(runtime.drafter, "r")
    chain = list(runtime.drafter.propose(["r"], [int(ids[-1])])[0].tokens[1:])
    batch = make_batch([Window(ids, feats, 0)], NUM_STEPS, "cpu")
    # row p = n - 2 (the root's) reads step j's token at column p + j: the chain's j-th node
    tokens = torch.cat([ids[1:], torch.tensor(chain[: NUM_STEPS - 1])])[None]
    with torch.no_grad():
        logits = Eagle1Head(net)(batch.aux, tokens, net.embed, NUM_STEPS)
    assert len(served) == NUM_STEPS
    for step in range(NUM_STEPS):
        torch.testing.assert_close(logits[step][0, n - 2], served[step], rtol=1e-5, atol=1e-5)


def test_a_learned_version_serves_the_targets_output_and_resumes(copy_dir: Path, tmp_path) -> None:
    engine, learner = learning_engine(copy_dir, kind="eagle")
    learner.checkpoints = Checkpoints(tmp_path, copy_dir / "eagle", torch.float32, keep=2)
    engine.generate(prompts(9, seed=0), SamplingParams(max_new_tokens=24))
    learner.guard = KeepAll()
    assert learner.update().keep and learner.version == 1
    batch = prompts(4, seed=1)
    results = engine.generate(batch, SamplingParams(max_new_tokens=24))
    served = {k: v.clone() for k, v in engine.draft.drafter.net.named_parameters()}
    assert any(not torch.equal(served[k].float(), v) for k, v in learner.shipped.items())
    for prompt, r in zip(batch, results, strict=True):
        assert r.token_ids == hf_greedy(copy_dir / "target", prompt, 24)
    assert sum(n > 1 for r in results for n in r.accept_lens) > 0, "no tree was accepted"
    cfg = DraftConfig("eagle", str(copy_dir / "eagle"), str(copy_dir / "target"),
                      SpecParams(3, 4, 8), num_kv_slots=4096)  # fmt: skip
    restarted = load_draft(replace(cfg, online_learning_dir=str(tmp_path)))
    assert attach_learner(restarted, start=False).stats().version == 1
    plain = load_draft(replace(cfg, draft_dir=str(tmp_path / "latest")))
    for name, p in plain.drafter.net.named_parameters():  # a head like any other
        assert torch.equal(p, served[name])
    for name, p in restarted.drafter.net.named_parameters():
        assert torch.equal(p, served[name])
