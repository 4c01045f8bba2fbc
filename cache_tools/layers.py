"""Which target layers a cache captures and a drafter fuses: the one rule both stages use.

Id `l` is the output of decoder layer `l` (HF `hidden_states[l + 1]`), before the final norm.
The serving engines capture the layers named in `dflash_config.target_layer_ids` in ascending
order by membership, so the ids must be

- strictly increasing: an unsorted list permutes the features against `fc.weight` silently;
- unique: a repeated id fails at run time in the engines;
- at most N-2 for an N-layer target: layer N-1 is pre-norm in vLLM and in the extractor but
  post-norm in HF's `hidden_states[N]`, and SGLang cannot capture it at all.

`validate_target_layer_ids` is the one check; extraction runs it before the first forward and
training before it builds the drafter. `default_target_layer_ids` is z-lab's rule; it never
returns ids the check refuses: for a target too shallow to give K distinct ids by the rule it
refuses too (naming what to pass instead) rather than repeat or shift ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflash.runtime.errors import SettingError
from dflash.runtime.findings import Finding


class LayerIdsError(SettingError):
    """Target layer ids that the serving engines cannot capture, or a rule that cannot pick them."""


# Whose ids a refusal is about, which decides how it names them and what it says to do (the words:
# cache_tools/messages.py): this extraction's, --target-layer-ids, a cache's (fixed: it is
# re-extracted), --source-layer-ids of an import (in the source's numbering).
PURPOSES = ("extract", "flag", "cache", "source-flag")


def validate_target_layer_ids(ids: Sequence[int], num_target_layers: int | None, *, purpose: str | None = None,
                              **of: Any) -> list[int]:
    """`ids` as a list of ints, or a LayerIdsError naming what is wrong and the constraint.

    `num_target_layers` None checks what needs no target (order, repeats, signs): extraction
    does so when it reads its settings, so that a bad list is refused before a large target
    loads, and checks the bound once the target is there. `purpose` (one of PURPOSES, None: the
    ids alone) says whose ids these are, with its data in `of`: `cache` (the cache's directory)
    for "cache"; `source`, `source_ids` and `offset` (the source's name, its ids, how it numbers
    ours) for "source-flag".
    """
    if purpose is not None and purpose not in PURPOSES:
        raise ValueError(f"layer ids purpose {purpose!r} is not one of {PURPOSES}")
    n = None if num_target_layers is None else int(num_target_layers)
    try:
        out = [int(i) for i in ids]
    except (TypeError, ValueError):
        raise LayerIdsError(Finding("cache.layer-ids-not-integers", ids=repr(list(ids)), purpose=purpose,
                                    **of)) from None
    repeated = sorted({i for i in out if out.count(i) > 1})
    problems = dict(
        empty=not out, too_shallow=n is not None and n < 2, repeated=repeated,
        unordered=not repeated and out != sorted(out), negative=[i for i in out if i < 0],
        above=[i for i in out if n is not None and n >= 2 and i > n - 2])
    if any(problems.values()):
        raise LayerIdsError(Finding("cache.layer-ids-unusable", ids=out, layers=n, purpose=purpose, **of,
                                    **problems))
    return out


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int = 5) -> list[int]:
    """z-lab's rule: K = `num_draft_layers` ids `round(1 + i * (N - 4) / (K - 1))`, i in 0..K-1
    (the reference names K after the draft layers; it is the number of target layers fused).

    Qwen3-8B (N=36, K=5) gives [1, 9, 17, 25, 33]; K=1 gives the middle layer N//2. The ids
    lie in [1, N-3]; the rule needs N >= K + 3 to give K distinct ones (N >= 3 for K=1), and
    refuses a shallower target instead of repeating ids. Python's round (half to even) on
    purpose: the reference loaders re-derive omitted ids this way, so they must match exactly.
    """
    n, k = int(num_target_layers), int(num_draft_layers)
    if k < 1 or n < 1:
        raise LayerIdsError(Finding("cache.layer-count-invalid", count=k, layers=n))
    if k == 1:
        ids = [n // 2]
    elif n - 4 >= k - 1:
        ids = [int(round(1 + i * (n - 4) / (k - 1))) for i in range(k)]
    else:
        ids = []
    if not ids or ids[-1] > n - 2:
        raise LayerIdsError(Finding("cache.layer-rule-too-shallow", count=k, layers=n))
    return validate_target_layer_ids(ids, n)
