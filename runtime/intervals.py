"""95 % bootstrap intervals of tau over prompts: the prompts drawn with replacement, a fixed seed.

Both the decoded measurement (`dflash-eval`'s intervals) and the head comparison (`dflash-compare`'s
table and its paired ratio) resample the same way from here, so two figures drawn for the same
number of prompts are paired by the same draw."""

from __future__ import annotations

import numpy as np

INTERVAL_RESAMPLES = 2000
"""Resamples of a bootstrap interval."""


def bootstrap_draw(prompts: int, resamples: int = INTERVAL_RESAMPLES, seed: int = 0) -> np.ndarray:
    """[resamples, prompts] prompt indices drawn with replacement (a fixed seed: the same draw
    for the same sizes); resampling two methods' figures with one draw pairs them."""
    return np.random.default_rng(seed).integers(0, prompts, size=(resamples, prompts))


def resampled_tau(tokens: np.ndarray, cycles: np.ndarray, draw: np.ndarray) -> np.ndarray:
    """The pooled tau (tokens over cycles) of each resample of `draw`."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return tokens[draw].sum(1) / cycles[draw].sum(1)


def percentile_interval(values: np.ndarray) -> list[float]:
    """The 95 % interval (2.5th and 97.5th percentiles) of the finite values; [] for none."""
    finite = values[np.isfinite(values)]
    return [float(np.percentile(finite, 2.5)), float(np.percentile(finite, 97.5))] if finite.size else []
