"""The training half of `dflash-compare`: let measurement choose the drafter head (docs/train.md,
"Choosing the head").

Each candidate head trains as a run of its own (OUTPUT_DIR/compare/<head>/, resumed as any run)
with the user's settings, its --drafter-type and a nested hash subset of the training samples
(--max-train-samples: --fraction of them, the same samples for every head), for the same steps,
and is evaluated once, at its last step, on the run's held-out split (evaluation.evaluate: the
walk over the held-out samples, prompt lookup's tau on the same samples beside it) and, given a
`decode` callable (the command's, eval/compare.py: dflash-eval's decoding of --prompts), decoded
against the target; this module only tabulates what it returns. The table names the best, its
margin over the second and whether their 95 % intervals overlap; then the best head trains on the
whole data in OUTPUT_DIR, as `dflash-train --drafter-type BEST` would (or the command is printed).

A candidate's figures are kept beside its run (compare.json, decoded.json): a rerun of the same
command reads them instead of training or decoding again, and a candidate stopped by a signal
resumes from its checkpoint. The command line is in eval/compare.py, a layer above both training
and decoding.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from dflash.runtime.errors import InputError
from dflash.runtime.findings import Finding, emit
from dflash.runtime.fsio import atomic_write_json
from dflash.runtime.intervals import bootstrap_draw, percentile_interval, resampled_tau
from dflash.runtime.settings import settings_of
from dflash.train.config import TrainConfig, TrainConfigError
from dflash.train.heads import get_head, head_names

COMPARE_DIR = "compare"
"""OUTPUT_DIR/compare/<head>/: each candidate's run directory."""
RESULT_FILE = "compare.json"
"""In a candidate's run directory: the settings it trained with and its figures."""
SUMMARY_FILE = "summary.json"
"""OUTPUT_DIR/compare/summary.json: the plan, the table's rows and the pick."""


def served_heads() -> tuple[str, ...]:
    """The registered heads an engine serves (those whose `serving` facts are declared)."""
    return tuple(name for name in head_names() if get_head(name).serving)


@dataclass(kw_only=True)
class CompareConfig:
    """What a head comparison takes besides the run's settings (and, in dflash-compare, what to decode)."""

    heads: tuple[str, ...] = ()
    """The candidate heads (--heads dflash2,dspark); empty: every registered head an engine serves."""
    fraction: float = 0.25
    """The share of the training samples each candidate trains on (a nested hash subset)."""
    train_best: bool = True
    """Train the best head on the whole data in OUTPUT_DIR (off: print that command)."""

    def __post_init__(self) -> None:
        self.heads = tuple(dict.fromkeys(self.heads or served_heads()))
        unknown = [h for h in self.heads if h not in head_names()]
        if unknown:
            raise TrainConfigError(Finding("train.compare-heads-unknown", unknown=unknown, heads=list(head_names())))
        if not (math.isfinite(self.fraction) and 0 < self.fraction <= 1):
            raise TrainConfigError(Finding("train.compare-fraction", fraction=self.fraction))


def parse_heads(text: str | None) -> tuple[str, ...]:
    """--heads's comma-separated names (None or empty: the default)."""
    return tuple(h.strip() for h in (text or "").split(",") if h.strip())


# -- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ComparePlan:
    """What the candidates train on and what that costs against one full run."""

    heads: tuple[str, ...]
    train_samples: int
    """Training samples of a full run (after the held-out split and any --max-train-samples)."""
    candidate_samples: int
    """Training samples of each candidate (--max-train-samples of its run)."""
    full_steps: int
    candidate_steps: int
    candidate_max_steps: int
    """--max-steps of each candidate: --fraction of the run's --max-steps (0: its epochs decide)."""

    @property
    def cost(self) -> float:
        """The candidates' steps summed, over one full run's."""
        return len(self.heads) * self.candidate_steps / max(self.full_steps, 1)

    def startup_line(self, fraction: float) -> str:
        return (f"compare: {len(self.heads)} head(s) ({', '.join(self.heads)}), each on {100 * fraction:g} % of the "
                f"training samples ({self.candidate_samples:,} of {self.train_samples:,}) for {self.candidate_steps:,} "
                f"steps; {len(self.heads) * self.candidate_steps:,} steps in all against {self.full_steps:,} for one "
                f"full run: {self.cost:.2f}x one head's training steps (with the best head's full run after: "
                f"{1 + self.cost:.2f}x)")


def candidate_dir(output_dir: str | os.PathLike, head: str) -> Path:
    return Path(output_dir) / COMPARE_DIR / head


def candidate_values(values: dict[str, Any], head: str, plan: ComparePlan) -> dict[str, Any]:
    """The settings of `head`'s candidate run: the user's, its head, the subset, its steps, and one
    held-out evaluation at its last step (the figure of the weights compared, not the best of
    several looks at the same held-out samples)."""
    return {**values, "drafter_type": head, "output_dir": str(candidate_dir(values["output_dir"], head)),
            "max_train_samples": plan.candidate_samples, "max_steps": plan.candidate_max_steps, "eval_interval": 0}


def _training_shape(cfg: TrainConfig) -> tuple[int, int, int]:
    """(training samples, steps, held-out samples) of a run of `cfg` (manifests and the batch plan only)."""
    from dflash.train.data.caches import open_training_data
    from dflash.train.run.run_length import RunLength

    data = open_training_data(cfg, rank=0, world_size=1, pin_memory=False)
    try:
        steps = RunLength.of(data.loader.steps_per_epoch, cfg.optimization.max_steps).total_steps
        return len(data.train_indices), steps, data.heldout_count
    finally:
        data.loader.close()


def plan_compare(values: dict[str, Any], compare: CompareConfig) -> ComparePlan:
    """Check the run's settings and size the candidates' runs."""
    if "drafter_type" in values:
        raise TrainConfigError(Finding("train.compare-drafter-type", drafter_type=values["drafter_type"]))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise TrainConfigError(Finding("train.compare-torchrun", world_size=int(os.environ["WORLD_SIZE"])))
    full = TrainConfig.from_dict({**values, "drafter_type": compare.heads[0]})
    if full.data.follow:
        raise TrainConfigError(Finding("train.compare-follow", flag="--follow"))
    train_samples, full_steps, heldout = _training_shape(full)
    if not heldout:
        raise TrainConfigError(Finding("train.compare-no-heldout"))
    samples = max(1, math.ceil(compare.fraction * train_samples))
    max_steps = math.ceil(compare.fraction * full.optimization.max_steps) if full.optimization.max_steps else 0
    sized = ComparePlan(compare.heads, train_samples, samples, full_steps, 0, max_steps)
    _, steps, _ = _training_shape(TrainConfig.from_dict(candidate_values(values, compare.heads[0], sized)))
    return ComparePlan(compare.heads, train_samples, samples, full_steps, steps, max_steps)


# -- the candidates -------------------------------------------------------------------------------


def _json_round_trip(obj: Any) -> Any:
    return json.loads(json.dumps(obj))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_figures(run_dir: Path) -> dict[str, Any]:
    """A finished candidate's figures from its metrics.jsonl: its steps, training seconds (the train
    records' seconds a step times the steps each covers) and steps a second, and the held-out
    evaluation of its last step."""
    records = []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            records.append(json.loads(line))
        except ValueError:  # a line torn by a kill
            continue
    evals = [r for r in records if r.get("kind") == "eval" and r.get("tau") is not None]
    if not evals:
        raise InputError(Finding("train.compare-no-evaluation", file=str(path), run_dir=str(run_dir)))
    last, seconds, before = evals[-1], 0.0, 0
    for r in records:
        if r.get("kind") == "train" and r.get("seconds_per_step") is not None and r["step"] > before:
            seconds += r["seconds_per_step"] * (r["step"] - before)
            before = r["step"]
    heldout = {k: last.get(k) for k in ("tau", "tau_interval", "tau_per_sample_mean", "tau_lookup", "tau_backbone",
                                        "estimator", "walked_samples", "loss") if last.get(k) is not None}
    return {"steps": last["step"], "train_seconds": seconds,
            "steps_per_second": last["step"] / seconds if seconds > 0 else None, "heldout": heldout}


def train_candidate(values: dict[str, Any], log: Callable[[str], None]) -> tuple[int, dict[str, Any] | None]:
    """(exit status, the candidate's record): read from its compare.json when it trained with these
    settings already, else trained (or resumed) now. A stopped run returns its status and None."""
    from dflash.train.run.loop import FINAL_DIR, train  # torch

    run_dir = Path(values["output_dir"])
    settings = _json_round_trip(values)
    record = _read_json(run_dir / RESULT_FILE)
    if record and record.get("settings") == settings and (run_dir / FINAL_DIR / "config.json").is_file():
        log(f"compare: {values['drafter_type']} trained already ({record['steps']} steps, {run_dir}): its figures are read")
        return 0, record
    log(f"compare: training {values['drafter_type']} in {run_dir}")
    _release_compiled()
    result = train(TrainConfig.from_dict(values))
    if result.exit_status:
        return result.exit_status, None
    record = {"head": values["drafter_type"], "settings": settings, **run_figures(run_dir)}
    atomic_write_json(run_dir / RESULT_FILE, record)
    return 0, record


def _release_compiled() -> None:
    """Forget the previous candidate's compiled graphs and cached memory: a fresh drafter would
    otherwise recompile against their guards, up to the limit past which it runs eager."""
    import torch

    torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the table and the pick -----------------------------------------------------------------------


def decoded_figures(tokens: Sequence[float], cycles: Sequence[float]) -> dict[str, Any]:
    """Pooled tau (tokens over cycles) and the per-prompt mean, each with its 95 % bootstrap interval
    over the prompts (runtime/intervals.py's draw, dflash-eval's too: a fixed seed, so every head is
    resampled alike)."""
    t, c = np.asarray(tokens, dtype=np.float64), np.asarray(cycles, dtype=np.float64)
    keep = c > 0
    own = np.where(keep, t / np.where(keep, c, 1), 0.0)
    out: dict[str, Any] = {"tau": float(t.sum() / c.sum()) if c.sum() else math.nan,
                           "tau_per_prompt_mean": float(own[keep].mean()) if keep.any() else math.nan,
                           "prompts": int(len(t)), "tau_interval": [], "per_prompt_interval": []}
    if keep.sum() >= 2:
        draw = bootstrap_draw(len(t))
        out["tau_interval"] = percentile_interval(resampled_tau(t, c, draw))
        with np.errstate(divide="ignore", invalid="ignore"):
            out["per_prompt_interval"] = percentile_interval((own[draw] * keep[draw]).sum(1) / keep[draw].sum(1))
    return out


def paired_ratio_interval(best: dict[str, Any], second: dict[str, Any]) -> list[float]:
    """The 95 % interval of best's pooled tau over second's on the same prompts, resampled together."""
    if len(best["tokens"]) != len(second["tokens"]) or len(best["tokens"]) < 2:
        return []
    draw = bootstrap_draw(len(best["tokens"]))
    arrays = [np.asarray(d[k], dtype=np.float64) for d in (best, second) for k in ("tokens", "cycles")]
    with np.errstate(divide="ignore", invalid="ignore"):
        return percentile_interval(resampled_tau(*arrays[:2], draw) / resampled_tau(*arrays[2:], draw))


@dataclass
class Row:
    """One head's line of the table."""

    head: str
    record: dict[str, Any]
    decoded: dict[str, Any] | None = None

    @property
    def heldout(self) -> dict[str, Any]:
        return self.record["heldout"]

    def tau(self, by: str) -> float:
        return self.decoded_figures["tau"] if by == "decoded" else self.heldout["tau"]

    def interval(self, by: str) -> list[float]:
        return list(self.decoded_figures["tau_interval"] if by == "decoded" else self.heldout.get("tau_interval") or [])

    @cached_property
    def decoded_figures(self) -> dict[str, Any]:
        return decoded_figures(self.decoded["tokens"], self.decoded["cycles"]) if self.decoded else {}

    def as_dict(self) -> dict[str, Any]:
        return {"head": self.head, "heldout": self.heldout, "steps": self.record["steps"],
                "train_seconds": self.record["train_seconds"], "steps_per_second": self.record["steps_per_second"],
                **({"decoded": {**self.decoded_figures, "lossless": self.decoded["lossless"]}} if self.decoded else {})}


@dataclass
class Pick:
    """The best head by `by` (decoded when every head was decoded, else held out), its margin over
    the second and whether their intervals overlap (None: an interval is missing)."""

    best: str
    by: str
    tau: float
    second: str | None = None
    margin: float | None = None
    overlap: bool | None = None
    paired: list[float] = field(default_factory=list)
    """Decoded: the 95 % interval of best / second on the same prompts."""

    def text(self, rows: dict[str, Row]) -> str:
        figure = "decoded tau" if self.by == "decoded" else "held-out tau"
        line = f"best: {self.best}, {figure} {self.tau:.3f}{_span(rows[self.best].interval(self.by))}"
        if self.second is None:
            return line + " (no second head to compare it with)"
        second = rows[self.second]
        line += (f", {100 * self.margin:+.1f} % over {self.second} ({second.tau(self.by):.3f}"
                 f"{_span(second.interval(self.by))})")
        if self.paired:
            line += f", paired {100 * (self.paired[0] - 1):+.1f} to {100 * (self.paired[1] - 1):+.1f} %"
        if self.overlap is None:
            return line + ": an interval is missing, so the noise is not known"
        return line + (": the intervals overlap, so the pick is within noise" if self.overlap
                       else ": the intervals do not overlap")


def pick_best(rows: list[Row]) -> Pick:
    by = "decoded" if rows and all(r.decoded for r in rows) else "heldout"
    ranked = sorted(rows, key=lambda r: r.tau(by), reverse=True)
    best = ranked[0]
    pick = Pick(best=best.head, by=by, tau=best.tau(by))
    if len(ranked) > 1:
        second = ranked[1]
        pick.second, pick.margin = second.head, best.tau(by) / second.tau(by) - 1
        a, b = best.interval(by), second.interval(by)
        pick.overlap = a[0] <= b[1] if len(a) == 2 and len(b) == 2 else None
        if by == "decoded":
            pick.paired = paired_ratio_interval(best.decoded, second.decoded)
    return pick


def time_cost(plan: ComparePlan, rows: dict[str, Row], best: str) -> dict[str, Any] | None:
    """The candidates' training seconds summed, against one full run of `best` at the steps a
    second its candidate trained at (None without a rate)."""
    rate = rows[best].record["steps_per_second"]
    if not rate:
        return None
    spent = sum(r.record["train_seconds"] for r in rows.values())
    full = plan.full_steps / rate
    return {"candidates_seconds": spent, "full_run_seconds": full, "ratio": spent / full,
            "text": f"cost: the candidates trained {spent:,.1f} s in all; one full run of {best} takes about "
                    f"{full:,.1f} s at its candidate's steps a second: {spent / full:.2f}x its training time"}


def _span(interval: Sequence[float]) -> str:
    return f" [{interval[0]:.3f}-{interval[1]:.3f}]" if len(interval) == 2 else ""


def format_table(rows: list[Row]) -> str:
    """The comparison, one row a head: held-out tau and interval, x prompt lookup on the same
    samples, decoded pooled and per-prompt tau with intervals (when decoded), training time."""
    decoded = any(r.decoded for r in rows)
    header = ["head", "held-out tau [95 %]", "x lookup"]
    if decoded:
        header += ["decoded tau [95 %]", "per-prompt mean [95 %]"]
    header += ["train s", "steps/s"]
    lines = [header]
    for r in rows:
        h = r.heldout
        lookup = h.get("tau_lookup")
        cells = [r.head, f"{h['tau']:.3f}{_span(h.get('tau_interval') or [])}",
                 f"{h['tau'] / lookup:.2f}x" if lookup else "-"]
        if decoded:
            d = r.decoded_figures
            cells += [f"{d['tau']:.3f}{_span(d['tau_interval'])}", f"{d['tau_per_prompt_mean']:.3f}"
                      f"{_span(d['per_prompt_interval'])}"] if d else ["-", "-"]
        rate = r.record["steps_per_second"]
        cells += [f"{r.record['train_seconds']:.1f}", f"{rate:.2f}" if rate else "-"]
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    lookups = {r.heldout.get("tau_lookup") for r in rows} - {None}
    if lookups:
        text.append(f"prompt lookup on the same held-out samples: tau {min(lookups):.3f}")
    return "\n".join(text)


# -- the command ----------------------------------------------------------------------------------


def settings_flags(values: dict[str, Any]) -> list[str]:
    """The run settings `values` as `dflash-train` flags (every one given, whether by flag or file)."""
    specs = settings_of(TrainConfig)
    out: list[str] = []
    for name, value in values.items():
        s = specs[name]
        if value is None:
            continue
        if s.kind == "bool":
            off = s.option.secondary_opts
            out += [s.flag] if value else off[:1]
        elif s.kind == "list":
            for item in value:
                out += [s.flag, str(item)]
        elif s.kind == "tuple":
            out += [s.flag, *map(str, value)]
        elif isinstance(value, dict):
            out += [s.flag, json.dumps(value)]
        elif isinstance(value, (list, tuple)):  # a comma-separated list (--draft-layer-types)
            out += [s.flag, ",".join(map(str, value))]
        else:
            out += [s.flag, str(value)]
    return out


def full_run_command(values: dict[str, Any], head: str) -> str:
    """The command that trains `head` on the whole data in OUTPUT_DIR: the run's settings and its head."""
    return shlex.join(["dflash-train", *settings_flags({**values, "drafter_type": head})])


@dataclass
class CompareResult:
    exit_status: int
    plan: ComparePlan | None = None
    rows: list[Row] = field(default_factory=list)
    pick: Pick | None = None
    command: str = ""
    """The best head's full run (what --no-train-best prints)."""


Decoder = Callable[[dict[str, Any]], dict[str, Any]]
"""A candidate's record (its head, settings and steps) -> its decoded prompts: {"tokens": [accepted
tokens a prompt], "cycles": [cycles a prompt], "lossless": bool} (eval/compare.py's)."""


def compare_heads(values: dict[str, Any], compare: CompareConfig, log: Callable[[str], None] = print,
                  decode: Decoder | None = None) -> CompareResult:
    """Plan, train (or read) every candidate, decode each with `decode` (None: the held-out estimate
    only), print the table and the pick, then train the best head on the whole data (unless
    `compare.train_best` is off)."""
    plan = plan_compare(values, compare)
    log(plan.startup_line(compare.fraction))
    records = {}
    for head in plan.heads:
        status, record = train_candidate(candidate_values(values, head, plan), log)
        if status:
            log(f"compare: stopped while training {head}; rerun the same command to resume it (the heads "
                "trained before it are kept).")
            return CompareResult(status, plan)
        records[head] = record
    rows = [Row(head, records[head]) for head in plan.heads]
    if decode is not None:
        for row in rows:
            row.decoded = decode(row.record)
    pick = pick_best(rows)
    command = full_run_command(values, pick.best)
    log(format_table(rows))
    log(pick.text({r.head: r for r in rows}))
    spent = time_cost(plan, {r.head: r for r in rows}, pick.best)
    if spent:
        log(spent["text"])
    if any(r.decoded and not r.decoded["lossless"] for r in rows):
        emit(Finding("train.compare-not-lossless", heads=[r.head for r in rows if r.decoded and not r.decoded["lossless"]]),
             prefix="warning: ", stream=sys.stdout)
    summary = {"plan": {"fraction": compare.fraction, "train_samples": plan.train_samples,
                        "candidate_samples": plan.candidate_samples, "full_steps": plan.full_steps,
                        "candidate_steps": plan.candidate_steps, "cost": plan.cost},
               "rows": [r.as_dict() for r in rows], "pick": vars(pick), "command": command,
               **({"time_cost": {k: v for k, v in spent.items() if k != "text"}} if spent else {})}
    from dflash.train.measure.reporting import strict_json

    atomic_write_json(Path(values["output_dir"]) / COMPARE_DIR / SUMMARY_FILE, strict_json(summary))
    result = CompareResult(0, plan, rows, pick, command)
    if not compare.train_best:
        log(f"to train {pick.best} on the whole data: {command}")
        return result
    from dflash.train.run.loop import train

    log(f"compare: training {pick.best} on the whole data in {values['output_dir']} ({command})")
    _release_compiled()
    result.exit_status = train(TrainConfig.from_dict({**values, "drafter_type": pick.best})).exit_status
    return result

