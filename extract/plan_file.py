"""The extraction plan written at the start of a run (cache_tools/plan.py): every part this
cache will hold, from the input data alone, so that a trainer can follow the cache while it fills.
"""

from __future__ import annotations

from pathlib import Path

from dflash.cache_tools.manifest import read_header
from dflash.cache_tools.plan import PlannedPart, read_plan, write_plan

from .data import BadRecordError, PartRules, plan_windows


def planned_parts(files: list[Path], rules: PartRules) -> list[PlannedPart]:
    """The parts `plan_windows` cuts, with their samples' ids, lengths and split keys (one pass
    over the data; the keys are those the extraction records when it commits the parts)."""
    return [PlannedPart(plan.name, tuple(s.sample_id for s in plan.samples), tuple(s.length for s in plan.samples),
                        tuple(s.split_key for s in plan.samples))
            for window in plan_windows(files, rules) for plan in window]


def ensure_plan(cache_dir: str | Path, files: list[Path], rules: PartRules) -> int:
    """Write the cache's plan unless a current one is there (a resumed run, another rank); keyed
    by the header on disk, the one a trainer reads.

    A plan promises every part of the cache, so input with a bad record (without --skip-bad)
    gets none: a follower would otherwise take the parts before that record for the whole
    cache. The extraction still streams the input, commits the parts before the record and
    stops at it with this same error (file and line), as it did before plans existed.
    Returns how many parts the plan holds (0: none was written)."""
    header = read_header(Path(cache_dir))
    if (plan := read_plan(cache_dir, header)) is not None:
        return len(plan.parts)
    try:
        parts = planned_parts(files, rules)
    except BadRecordError:
        return 0  # raised again by the extraction when it reaches the record
    write_plan(cache_dir, header, parts)
    return len(parts)
