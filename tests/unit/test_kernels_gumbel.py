"""The keyed Gumbel-max draw: the Triton race against the torch reference bit for bit (several
blocks and splits of the vocabulary, masked tokens, ties), the same on CPU and GPU, and the noise
a standard Gumbel keyed by (seed, position, token) alone."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math

import pytest

from specmesh.kernels.gumbel import gumbel_argmax, gumbel_noise_ref, row_keys
from specmesh.kernels.testing import cpu_triton, kernel_devices


def _scores(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Peaked random scores with some tokens masked (-inf), as top-k / top-p leave them."""
    scores = torch.randn(rows, vocab, generator=gen) * 3.0
    return scores.masked_fill(torch.rand(rows, vocab, generator=gen) < 0.3, float("-inf"))


@pytest.mark.parametrize("device", kernel_devices())
def test_triton_matches_reference(device: str) -> None:
    """Both implementations, on this device and on the CPU, draw the same tokens: vocabularies
    of one token, one partial block, several blocks and several splits (16,384 per program)."""
    gen = torch.Generator().manual_seed(3)
    for rows, vocab in [(1, 1), (5, 7), (9, 320), (4, 5000), (3, 40_000)]:
        scores = _scores(rows, vocab, gen)
        keys = row_keys(range(rows), [11 * r for r in range(rows)])
        cpu = gumbel_argmax(scores, keys, "torch")
        args = (scores.to(device), keys.to(device))
        for impl in ("torch", "triton"):
            assert torch.equal(gumbel_argmax(*args, impl).cpu(), cpu), (rows, vocab, impl)
        assert bool(torch.isfinite(scores.gather(-1, cpu[:, None])).all())


@pytest.mark.parametrize("impl", ["torch", cpu_triton()])
def test_a_tie_goes_to_the_first_index(impl: str) -> None:
    """Two tokens so far ahead that the noise rounds away tie, in different splits of the
    vocabulary or different blocks of one split: the lower id wins, as torch's argmax picks it;
    a row with nothing allowed draws 0."""
    scores = torch.full((4, 40_000), float("-inf"))
    scores[0, [20_000, 3]] = 1e30
    scores[1, [39_999, 16_384]] = 1e30
    scores[2, [5000, 100]] = 1e30
    keys = row_keys([1, 2, 3, 4], [0, 0, 0, 0])
    assert gumbel_argmax(scores, keys, impl).tolist() == [3, 16_384, 100, 0]


def test_noise_is_a_standard_gumbel_keyed_by_position_and_token() -> None:
    """Mean Euler's constant and variance pi**2 / 6 over a million values; a row's noise depends
    on its key alone (not on the rows beside it); neighbouring tokens and positions are
    uncorrelated."""
    keys = row_keys([5] * 100, range(100))
    noise = gumbel_noise_ref(keys, 10_000).double()  # [100, 10_000]
    assert abs(float(noise.mean()) - 0.5772) < 0.005
    assert abs(float(noise.var()) - math.pi**2 / 6) < 0.01
    assert torch.equal(gumbel_noise_ref(keys[7:8], 10_000)[0], noise[7].float())
    corr = lambda a, b: float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])
    assert abs(corr(noise[:, 1:], noise[:, :-1])) < 0.005  # token t vs t + 1
    assert abs(corr(noise[1:], noise[:-1])) < 0.005  # position p vs p + 1
    other_seed = gumbel_noise_ref(row_keys([6] * 100, range(100)), 10_000).double()
    assert abs(corr(noise, other_seed)) < 0.005
