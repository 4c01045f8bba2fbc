"""What dflash.train's loss (train/loss/) tells its user: one renderer per finding code
(`dflash.runtime.findings`). Code states findings; the words live here."""

from __future__ import annotations

from dflash.runtime.findings import renders


@renders("train.hard-label-target-without-top1", example=dict(cache="cache", flag="--hard-label"))
def _hard_label_target_without_top1(cache, flag):
    return (f"{flag} target trains toward the target's top-1, and the cache at {cache} stores neither its "
            "top-k nor its top-1 (extracted with --store-topk 0 --no-store-top1, or by an older version). "
            f"Extract again with the defaults (the top-8), or use {flag} sample.")
