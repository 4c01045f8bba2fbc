"""What dflash.train tells its user: one renderer per finding code (`dflash.runtime.findings`).

Each renderer takes a finding's fields and returns one paragraph: what was wrong, where (file,
sample, part, flag) and what to do. Code states findings; the words live here. The run's
settings (train/config.py) and the heads' (train/heads/limits.py) share the range findings.
"""

from __future__ import annotations

from dflash.runtime.findings import renders

_REQUIRED = {"--cache": ": the directory of a hidden-state cache"}


@renders("train.setting-required", example=dict(flag="--cache"))
def _setting_required(flag):
    return f"{flag} is required{_REQUIRED.get(flag, '')}."


@renders("train.setting-choice", example=dict(flag="--noise-type", value="laplace", choices=["none", "uniform"]))
def _setting_choice(flag, value, choices):
    return f"{flag} {value!r} is not one of {', '.join(choices)}."


@renders("train.setting-range", example=dict(flag="--max-anchors", value=0, allowed="at least 1", default=512))
def _setting_range(flag, value, allowed, default=None):
    fix = "" if default is None else f"; leave it out for the default, {default}"
    return f"{flag} must be {allowed} (got {value}){fix}."


@renders("train.setting-not-finite", example=dict(flag="--lr", value=float("nan"), default=6e-4))
def _setting_not_finite(flag, value, default):
    hint = "leave it out for the default" if default is None else f"the default is {default}"
    return (f"{flag} must be a finite number (got {value}): nan or inf would turn the drafter's weights to nan in "
            f"its first steps. Pass a finite value ({hint}).")


@renders("train.unknown-settings", example=dict(unknown=["learning_rate"], known=["lr", "epochs"]))
def _unknown_settings(unknown, known):
    return f"Unknown training setting(s) {', '.join(unknown)}; the settings are {', '.join(known)}."


@renders("train.staging-dir-unused", example=dict(value="/scratch/staging"))
def _staging_dir_unused(value):
    return (f"--staging-dir {value} is where an s3:// cache is staged, but no --cache or --eval-cache is one (a "
            "local cache is read in place): drop it.")


@renders("train.disk-budget-size", example=dict(value="lots"))
def _disk_budget_size(value):
    return f"--disk-budget must be a positive size such as 500G (got {value!r})."


@renders("train.disk-budget-local", example=dict(value="500G"))
def _disk_budget_local(value):
    return (f"--disk-budget {value} bounds the local disk a run fills with parts: an s3:// cache's staging "
            "directory, or, with --follow, a cache an extraction fills under its own --disk-budget. These caches "
            "are local and finished, read in place: drop --disk-budget, or add --follow to train while "
            "dflash-extract --disk-budget fills the cache.")


@renders("train.follow-budget-shuffle-parts", example=dict(value="500G"))
def _follow_budget_shuffle_parts(value):
    return (f"--follow with --disk-budget {value} needs --shuffle-parts N: without it an epoch is planned over the "
            "whole cache, so its first batches read samples of every part and the extraction can evict nothing "
            "until the epoch ends (it waits for room that never comes once the cache outgrows the budget). Pass "
            "--shuffle-parts 8 (or the largest group of parts that fits the budget; docs/train.md, \"A disk "
            "budget\").")


@renders("train.follow-budget-held-out", example=dict(value="500G", eval_fraction=0.02))
def _follow_budget_held_out(value, eval_fraction):
    return (f"--follow with --disk-budget {value} and a held-out split of the followed cache (--eval-fraction "
            f"{eval_fraction}): the split's samples are spread over every part, so each evaluation would read every "
            "part again, more than the budget holds (the extraction would re-extract the whole cache for it, or "
            "wait). Hold out a separate cache with --eval-cache, or pass --eval-fraction 0.")


@renders("train.sliding-needs-window", example=dict(value="sliding,full"))
def _sliding_needs_window(value):
    return f"--draft-layer-types {value} has sliding layers: pass --draft-sliding-window N (N >= 1 tokens)."


@renders("train.gamma-without-decay", example=dict(gamma=5.0, loss_weighting="acceptance"))
def _gamma_without_decay(gamma, loss_weighting):
    return (f"--gamma {gamma} sets the exp-decay loss weights, but --loss-weighting is {loss_weighting} (the "
            "default since tau 5.01 vs 4.56 on the quality benchmark, docs/recipe.md), which does not use it: add "
            "--loss-weighting decay to train with the decay, or drop --gamma.")


@renders("train.decay-ratio", example=dict(decay_ratio=0.99, warmup_ratio=0.04))
def _decay_ratio(decay_ratio, warmup_ratio):
    return (f"--decay-ratio must be in [0, 1] and, with --warmup-ratio, at most 1 (got {decay_ratio} and "
            f"{warmup_ratio}).")


@renders("train.profile-interval-env", example=dict(value="often"))
def _profile_interval_env(value):
    return f"DFLASH_PROFILE_INTERVAL must be an integer (got {value!r})."
