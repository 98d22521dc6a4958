"""Sampler: greedy is argmax; top-k / top-p restrict the support; seeds reproduce tokens
whatever else shares the batch; temperature shapes the distribution."""
from __future__ import annotations

import collections
import math

import pytest
import torch

from actors.sampler import Sampler, make_generator
from scheduler.sampling_params import SamplingParams

GREEDY = SamplingParams()


def _logits(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(rows, 1)


def test_greedy_is_argmax_for_the_whole_batch():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    assert Sampler().sample(logits, [GREEDY] * 6, [None] * 6) == logits.argmax(-1).tolist()


def test_greedy_rows_stay_argmax_next_to_sampled_rows():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = [GREEDY, SamplingParams(temperature=1.0, seed=3), GREEDY, SamplingParams(temperature=2.0)]
    gens = [make_generator(p) for p in params]
    tokens = Sampler().sample(logits, params, gens)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def _draws(probs: list[float], params: SamplingParams, n: int = 400) -> collections.Counter:
    params = SamplingParams(**{**params.to_dict(), "seed": 11})
    gen = make_generator(params)
    sampler = Sampler()
    logits = _logits(probs)
    return collections.Counter(sampler.sample(logits, [params], [gen])[0] for _ in range(n))


def test_top_k_restricts_to_the_k_most_likely():
    probs = [0.05, 0.3, 0.1, 0.25, 0.2, 0.1]
    seen = _draws(probs, SamplingParams(temperature=1.0, top_k=2))
    assert set(seen) == {1, 3}


def test_top_p_keeps_the_smallest_nucleus():
    probs = [0.1, 0.5, 0.05, 0.3, 0.05]
    assert set(_draws(probs, SamplingParams(temperature=1.0, top_p=0.75))) == {1, 3}
    assert set(_draws(probs, SamplingParams(temperature=1.0, top_p=0.4))) == {1}
    assert set(_draws(probs, SamplingParams(temperature=1.0, top_p=1.0))) == {0, 1, 2, 3, 4}


def test_temperature_matches_the_softmax_distribution():
    probs = [0.6, 0.3, 0.1]
    n = 3000
    for temperature in (0.5, 2.0):
        seen = _draws(probs, SamplingParams(temperature=temperature), n=n)
        expected = torch.tensor(probs).log().div(temperature).softmax(-1).tolist()
        for token, p in enumerate(expected):
            assert abs(seen[token] / n - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3, (temperature, token)


def test_seeded_request_is_reproducible_and_batch_independent():
    vocab = 200
    steps = [torch.randn(5, vocab, generator=torch.Generator().manual_seed(s)) for s in range(8)]
    mine = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.7, seed=5), GREEDY, SamplingParams(temperature=1.3), GREEDY]
    sampler = Sampler()

    def alone():
        gen = make_generator(mine)
        return [sampler.sample(logits[2:3], [mine], [gen])[0] for logits in steps]

    def in_batch():
        params = others[:2] + [mine] + others[2:]
        gens = [make_generator(p) for p in params]
        return [sampler.sample(logits, params, gens)[2] for logits in steps]

    first = alone()
    assert first == alone() == in_batch()
    assert len(set(first)) > 1  # it really samples


def test_bad_inputs_are_rejected():
    sampler = Sampler()
    with pytest.raises(ValueError, match="one SamplingParams"):
        sampler.sample(torch.zeros(2, 5), [GREEDY], [None])
    with pytest.raises(ValueError, match="batch, vocab"):
        sampler.sample(torch.zeros(5), [GREEDY], [None])
