"""Online learning's training forward and loss are the served head's and the offline trainer's:
step 0 equals the draft's own extend forward, every step and the loss equal
`specmesh.demo.eagle3` / `draft_train` on the same weights, and the window alignment pairs
feature p with tokens p + 1 + j and labels p + 2 + j."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specmesh.draft_service.online.buffer import Window
from specmesh.draft_service.online.head import (
    Eagle3Head,
    chain_accepted,
    make_batch,
    ttt_loss,
    ttt_mask,
)
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.steps import ExtendInput

NUM_STEPS = 4


@pytest.fixture(scope="module")
def runtime(tiny_dir: Path):
    cfg = DraftConfig("eagle3", str(tiny_dir / "draft"), str(tiny_dir / "target"),
                      SpecParams(3, 4, 8), num_kv_slots=2048)  # fmt: skip
    return load_draft(cfg)


def _window(width: int, n: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (n,), generator=g), torch.randn(n, width, generator=g)


def test_batch_pairs_feature_p_with_the_next_tokens_and_labels() -> None:
    ids = torch.arange(10, 16)  # x_0 .. x_5
    feats = torch.arange(6.0)[:, None].expand(6, 3)
    windows = [Window(ids, feats, 0), Window(ids[:4], feats[:4], 0)]
    batch = make_batch(windows, num_steps=3, device="cpu")
    assert batch.aux.shape == (2, 5, 3)  # R = n - 1 rows
    assert batch.aux[0, :, 0].tolist() == [0, 1, 2, 3, 4]
    assert batch.step_tokens[0].tolist() == [11, 12, 13, 14, 15, 0, 0]  # x_{p+1+j} at p + j
    assert batch.labels[0].tolist() == [12, 13, 14, 15, -1, -1, -1]  # x_{p+2+j}
    assert batch.aux[1, 3:].abs().sum() == 0 and batch.labels[1].tolist()[2:] == [-1] * 5
    # tokens 0 .. 3 were the prompt: labels from x_4 on (column c holds x_{c+2})
    prompt = make_batch([Window(ids, feats, 4)], num_steps=3, device="cpu")
    assert prompt.labels[0].tolist() == [-1, -1, 14, 15, -1, -1, -1]
    assert make_batch([Window(ids, feats, 4)], 3, "cpu", prompt_labels=True).labels[0][0] == 12


def test_mask_is_the_offline_trainers() -> None:
    from specmesh.demo.eagle3 import ttt_mask as offline

    for step in range(NUM_STEPS):
        assert torch.equal(ttt_mask(7, step, "cpu"), offline(7, step))


def test_step_zero_is_the_served_extend(runtime) -> None:
    """The last extend row's logits (the tree's root) equal step 0's at that row."""
    net = runtime.drafter.net
    ids, feats = _window(net.feature_width)
    n = len(ids)
    res = runtime.step([ExtendInput("r", ids[:-1].tolist(), int(ids[-1]), feats[:-1], new=True)],
                       propose=False)  # fmt: skip
    assert not res.errors
    batch = make_batch([Window(ids, feats, 0)], NUM_STEPS, "cpu")
    with torch.no_grad():
        logits = Eagle3Head(net)(batch.aux, batch.step_tokens, net.embed, 1)
    # extend row p pairs feature p with token p + 1: the last row is p = n - 2
    torch.testing.assert_close(logits[0][0, n - 2], runtime.drafter.roots["r"].logits)
    runtime.release("r")


def _offline_draft(net):
    """`specmesh.demo.eagle3.Eagle3Draft` (the offline trainer's module) with ``net``'s weights."""
    from specmesh.demo.eagle3 import DraftShape, Eagle3Draft

    c = net.config.base
    shape = DraftShape(c.hidden_size, net.fc.in_features // 3, c.num_heads, c.num_kv_heads,
                       c.intermediate_size, c.vocab_size, net.lm_head.out_features, c.rope.theta,
                       c.max_position, c.rms_norm_eps)  # fmt: skip
    draft = Eagle3Draft(shape)
    state = {k: v.float() for k, v in net.state_dict().items()}
    draft.load_state_dict({**state, "t2d": draft.t2d})
    draft.set_hot_vocab(torch.arange(len(net.d2t)) + net.d2t)
    return draft


def test_every_step_and_the_loss_are_the_offline_trainers(runtime) -> None:
    from specmesh.demo.draft_train import IGNORE, step_labels

    net = runtime.drafter.net
    offline, head = _offline_draft(net), Eagle3Head(net)
    windows = [_window(net.feature_width, n, seed) for n, seed in [(24, 1), (17, 2)]]
    batch = make_batch([Window(*w, 0) for w in windows], NUM_STEPS, "cpu")
    weight = runtime.drafter.net.embed(torch.arange(net.config.base.vocab_size))
    with torch.no_grad():
        ours = head(batch.aux, batch.step_tokens, net.embed, NUM_STEPS)
        theirs = offline(batch.aux, batch.step_tokens, weight, NUM_STEPS)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # RMSNorm spelled differently
    total, weights = 0.0, 0.0
    for step, logits in enumerate(theirs):
        _, labels = step_labels(offline, batch.labels, step, batch.aux.shape[1])
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
        total, weights = total + 0.8**step * ce, weights + 0.8**step
    with torch.no_grad():
        loss = ttt_loss(head, batch, net.embed, NUM_STEPS, 0.8)
    torch.testing.assert_close(loss, total / weights, atol=1e-4, rtol=1e-4)


def test_chain_acceptance_counts_runs_up_to_the_first_miss(runtime) -> None:
    """A head whose every step predicts the label accepts every chain in full; another label
    accepts none, unless the chains keep every token (top-k = the draft vocabulary)."""
    net = runtime.drafter.net
    head = Eagle3Head(net)
    ids, feats = _window(net.feature_width, 12)
    batch = make_batch([Window(ids, feats, 0)], 3, "cpu")
    hot = head.to_target_ids(torch.arange(len(head.d2t)))
    batch.labels[batch.labels >= 0] = hot[0]  # every label the same hot token
    with torch.no_grad():
        head.norm.weight.zero_()  # every logit 0: argmax = draft id 0 = hot[0] at every step
    accepted, rounds = chain_accepted(head, batch, net.embed, 3)
    assert rounds == len(ids) - 1 - 3 and accepted == 3 * rounds  # rows whose chain has labels
    batch.labels[batch.labels >= 0] = hot[1]
    assert chain_accepted(head, batch, net.embed, 3) == (0, rounds)
    batch.labels[:, :2] = -1  # a prompt's labels: chains starting on them are no rounds
    assert chain_accepted(head, batch, net.embed, 3) == (0, rounds - 2)
    # top-k chains: a step accepts when the committed token is among its k most likely
    every = len(head.d2t)
    assert chain_accepted(head, batch, net.embed, 3, topk=every) == (3 * (rounds - 2), rounds - 2)
