"""dflash-eval's bootstrap intervals over prompts: they hold the figure, shrink with more prompts
and tell two decoders apart only when the prompts do."""

from __future__ import annotations

import random

import pytest
from dflash.eval.run import tau_intervals
from dflash.eval.speculative import Generation


def gens(lengths_per_prompt: list[list[int]]) -> list[Generation]:
    return [Generation(tokens=[0] * sum(a), acceptance_lengths=a) for a in lengths_per_prompt]


def noisy(n: int, seed: int, scale: int = 1) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.choice((1, 1, 2, 3, 8 * scale)) for _ in range(r.randint(5, 40))] for _ in range(n)]


def test_the_interval_holds_the_pooled_and_per_prompt_figures_and_narrows_with_more_prompts():
    few, many = gens(noisy(20, 1)), gens(noisy(400, 1))
    for g in (few, many):
        out = tau_intervals(g)
        pooled = sum(sum(x.acceptance_lengths) for x in g) / sum(len(x.acceptance_lengths) for x in g)
        mean = sum(sum(x.acceptance_lengths) / len(x.acceptance_lengths) for x in g) / len(g)
        assert out["tau"][0] < pooled < out["tau"][1]
        assert out["tau_per_prompt_mean"][0] < mean < out["tau_per_prompt_mean"][1]
        assert out["prompts"] == len(g)
    width = lambda g: (lambda t: t[1] - t[0])(tau_intervals(g)["tau"])  # noqa: E731
    assert width(many) < 0.5 * width(few)  # 20x the prompts: about 1/4.5 the width
    assert tau_intervals(few) == tau_intervals(few)  # a fixed seed: the same report twice


def test_one_prompt_has_no_interval_and_equal_prompts_have_a_point():
    assert tau_intervals(gens([[2, 3]])) == {}
    same = tau_intervals(gens([[2, 2]] * 10))
    assert same["tau"] == [pytest.approx(2.0), pytest.approx(2.0)]


def test_the_ratio_interval_resamples_both_decoders_on_the_same_prompts():
    """A drafter whose every cycle accepts twice the baseline's, however hard the prompts are:
    the paired ratio is 2 in every resample, where each tau alone spreads with the prompts."""
    base = noisy(30, 2)
    out = tau_intervals(gens([[2 * a for a in p] for p in base]), gens(base))  # twice as long, every cycle
    assert out["tau_vs_baseline"] == [pytest.approx(2.0), pytest.approx(2.0)]
    assert out["tau"][1] - out["tau"][0] > 0.5  # while each decoder's own tau is uncertain
    # an unrelated baseline of the same spread: an interval around the ratio, not a point
    other = tau_intervals(gens(noisy(30, 3)), gens(noisy(30, 4)))
    assert other["tau_vs_baseline"][1] - other["tau_vs_baseline"][0] > 0.05
