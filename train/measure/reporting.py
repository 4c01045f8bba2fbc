"""What the trainer reports: running metrics (kept on the device between logs), their reduction
over ranks, and where they go (console with a progress bar, RUN_DIR/metrics.jsonl, TensorBoard).

Metrics per log interval: loss, acc_k (top-1 accuracy of block slot k), tau (expected
acceptance length, see metrics.py), lr, grad_norm, context and block tokens/s, samples/s,
data_wait (fraction of wall time spent waiting for batches), gpu_mem_gib (peak allocated).
Training tau is measured on the batches being trained on, so it flatters a drafter that
memorizes them; what the reports lead with is the held-out tau (`HeldoutTracker`).
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from dflash.runtime.findings import Finding
from dflash.runtime.fsio import atomic_write_bytes
from dflash.train.loss.objective import LossOutput
from dflash.train.measure.metrics import BlockMetrics, leading_correct
from dflash.train.run.distributed import DistInfo, all_reduce_sum, any_rank
from tqdm import tqdm


class RunningMetrics:
    """Sums over micro-batches, on the device: no host sync until `compute`."""

    def __init__(self, block_size: int, device: torch.device):
        self.block_size, self.device = block_size, device
        self.first_nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        """The first step whose loss or gradient norm was nan or inf (0: none yet), kept on the
        device through `reset`: read where the loop syncs anyway (`nonfinite_step`)."""
        self.reset()

    def reset(self) -> None:
        slots = self.block_size - 1
        # [loss_sum, micro_batches, accepted_sum, blocks, context_tokens, block_tokens, samples,
        #  grad_norm_sum, steps, data_wait_seconds]
        self.scalars = torch.zeros(10, dtype=torch.float64, device=self.device)
        self.correct = torch.zeros(slots, dtype=torch.float64, device=self.device)
        self.scored = torch.zeros(slots, dtype=torch.float64, device=self.device)
        self.started = time.perf_counter()

    @torch.no_grad()
    def update(self, out: LossOutput, batch: dict[str, torch.Tensor]) -> None:
        correct, valid = out.correct, out.valid
        counted = valid[..., 0]
        self.correct += (correct & valid).flatten(0, -2).sum(0)
        self.scored += valid.flatten(0, -2).sum(0)
        self.scalars += torch.cat([torch.stack([
            out.loss.detach().double(), torch.ones((), dtype=torch.float64, device=self.device),
            # leading_correct is 0 for blocks whose first slot is not scored: no masking (no sync)
            leading_correct(correct, valid).sum().double(), counted.sum().double(),
            batch["lengths"].sum().double(), (out.anchor_valid.sum() * self.block_size).double(),
            torch.full((), float(batch["lengths"].numel()), dtype=torch.float64, device=self.device),
        ]), torch.zeros(3, dtype=torch.float64, device=self.device)])

    @torch.no_grad()
    def add_step(self, grad_norm: torch.Tensor | float, data_wait_seconds: float, step: int | None = None) -> None:
        """Count optimizer step `step` (its gradient norm); given `step`, note it on the device when
        the loss or the gradient norm summed so far is no longer finite (no host sync)."""
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        self.scalars[7] += torch.as_tensor(grad_norm, device=self.device).double()
        self.scalars[8] += 1
        self.scalars[9] += data_wait_seconds
        if step is not None:  # (a nan or inf in a sum stays: the sums since the last log are enough)
            bad = ~torch.isfinite(self.scalars[0:8:7]).all()  # loss_sum and grad_norm_sum
            self.first_nonfinite = torch.where(bad & (self.first_nonfinite == 0), step, self.first_nonfinite)

    def nonfinite_step(self, info: DistInfo) -> int:
        """The first step (on any rank) whose loss or gradient norm was nan or inf, 0 for none (a host sync)."""
        return any_rank(int(self.first_nonfinite.item()), info)

    def compute(self, info: DistInfo) -> dict[str, float]:
        """Reduce over ranks and turn the sums into metrics (a host sync: call it at log time)."""
        flat = all_reduce_sum(torch.cat([self.scalars, self.correct, self.scored]).cpu(), info)
        n, slots = len(self.scalars), self.block_size - 1
        s = flat[:n]
        m = BlockMetrics(block_size=self.block_size)
        m.correct_per_slot, m.scored_per_slot = flat[n:n + slots], flat[n + slots:]
        m.accepted_sum, m.blocks = float(s[2]), int(s[3])
        out = m.compute()
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        out["loss"] = float(s[0] / max(float(s[1]), 1.0))
        out["grad_norm"] = float(s[7] / max(float(s[8]), 1.0))  # every rank adds the same global norm
        out["context_tokens_per_second"] = float(s[4]) / elapsed
        out["block_tokens_per_second"] = float(s[5]) / elapsed
        out["samples_per_second"] = float(s[6]) / elapsed
        out["seconds_per_step"] = elapsed / max(float(s[8]) / info.world_size, 1.0)
        out["data_wait"] = float(s[9]) / info.world_size / elapsed
        return out


def gpu_memory_gib(device: torch.device) -> float:
    if device.type != "cuda":
        return 0.0
    return torch.cuda.max_memory_allocated(device) / 2**30


# What the console line of each record shows, held-out tau first.
_TRAIN_KEYS = ("heldout_tau", "tau", "loss", "acc_1", "lr", "grad_norm", "context_tokens_per_second", "data_wait",
               "gpu_mem_gib")
_EVAL_KEYS = ("heldout_tau", "tau_backbone", "tau_lookup", "train_tau", "tau_gap", "best_heldout_tau", "best_step",
              "loss", "acc_1")
_SHORT = {"heldout_tau": "held-out_tau", "tau": "train_tau", "context_tokens_per_second": "ctx_tok/s",
          "best_heldout_tau": "best", "best_step": "at_step",
          "tau_backbone": "backbone_tau",  # DFlash2: the held-out tau of its backbone's own top-1, beside the selector's
          "tau_lookup": "lookup_tau"}  # prompt lookup's walk over the same held-out samples


PATIENCE = 2
"""Evaluations in a row without a new best held-out tau before the run warns."""
MIN_EVALS_FOR_VERDICT = 4
"""Evaluations a run has made before it calls a trend: the first few of a short run move with
the warmup, not with the data."""
LITTLE_GAIN = 0.05
"""A held-out gain over a run's second half below this (relative) is little (trajectory_advice)."""
STILL_RISING = 0.02
"""A gain at the last evaluation of at least this (relative) means the held-out tau still rises."""
UNLIKE_TEXT = 0.10
"""Prompt lookup along the held-out text this much (relative) above or below the training
text's: the held-out documents are unlike the rest (unlike_heldout)."""
UNLIKE_CONFIDENCE = 0.025
"""The target's mean top-1 probability over the held-out samples this much (relative) above or
below the training samples': the held-out documents are easier (or harder) for the target, and
so for the drafter (unlike_heldout). On the BPE benchmark's code a split 5.7 % surer read 1.245x
the decoded tau, 1.017x once corrected for it; by that slope 2.5 % is about 10 % of tau."""


def unlike_heldout_finding(text: list[float] | None, confidence: list[float] | None, adjusted: float | None = None,
                           *, said_to_measure: bool = False, ahead: bool = False) -> Finding | None:
    """What the trainer says when the held-out samples are unlike the training ones (None when
    they are alike). `confidence`: the target's mean top-1 probability over the held-out
    samples, over the training samples, and how many of those (over UNLIKE_CONFIDENCE apart, a
    split of few documents drew ones the target finds easier or harder, and its held-out tau
    reads high or low with them; `adjusted`, the estimate corrected for it, goes beside):
    `train.heldout-unlike-confidence`. `text`: prompt lookup's walk along each, the same way
    (UNLIKE_TEXT; `train.heldout-unlike-text`); said only without the confidence figure, and with
    no direction: on the BPE benchmark's code a split whose text repeated itself 14 % less than
    the rest's read 1.245x high. `said_to_measure`: the line already says to measure with
    dflash-eval. `ahead`: said at the start, before any evaluation."""
    if confidence and confidence[0] and confidence[1]:
        held, training, samples = confidence
        if 1 / (1 + UNLIKE_CONFIDENCE) <= held / training <= 1 + UNLIKE_CONFIDENCE:
            return None
        return Finding("train.heldout-unlike-confidence", held=held, training=training, samples=int(samples),
                       adjusted=adjusted or None, ahead=ahead, said_to_measure=said_to_measure)
    if confidence or not text or not text[0] or not text[1]:
        return None
    held, training, samples = text
    if 1 / (1 + UNLIKE_TEXT) <= held / training <= 1 + UNLIKE_TEXT:
        return None
    return Finding("train.heldout-unlike-text", held=held, training=training, samples=int(samples), ahead=ahead,
                   said_to_measure=said_to_measure)


def unlike_heldout(text: list[float] | None, confidence: list[float] | None, adjusted: float | None = None,
                   *, said_to_measure: bool = False, ahead: bool = False) -> str:
    """unlike_heldout_finding's paragraph, "" when the held-out samples are alike (a run's last line)."""
    found = unlike_heldout_finding(text, confidence, adjusted, said_to_measure=said_to_measure, ahead=ahead)
    return str(found) if found is not None else ""


@dataclass
class HeldoutTracker:
    """The held-out tau over a run: its best evaluation (whose checkpoint is kept and becomes
    RUN_DIR/final), the training tau since the previous evaluation, and the warning when the
    held-out tau stops improving. Its state goes into every checkpoint."""

    best_step: int | None = None
    best_tau: float = -math.inf
    best_train_tau: float = math.nan
    """Training tau over the evaluation interval that ended at the best step."""
    best_interval: list[float] = field(default_factory=list)
    """The best evaluation's 95 % interval over its held-out samples (evaluate's tau_interval)."""
    best_per_sample_mean: float | None = None
    """The best evaluation's mean of its samples' own taus (evaluate's tau_per_sample_mean)."""
    lookup_tau: float | None = None
    """Prompt lookup's tau over the held-out samples the estimate reads (evaluate's tau_lookup):
    the same at every evaluation, their text does not change."""
    lookup_text: list[float] = field(default_factory=list)
    """Prompt lookup along the held-out samples' text and the training samples', and how many
    training samples (evaluate's lookup_text_heldout, lookup_text_training and _samples), when
    both were measured."""
    confidence: list[float] = field(default_factory=list)
    """The target's mean top-1 probability over the held-out samples and the training samples,
    and how many training samples (evaluate's confidence_heldout, confidence_training and
    _samples), when both were read."""
    best_confidence_adjusted: float | None = None
    """The best evaluation's estimate corrected for the target's confidence (evaluate's
    tau_confidence_adjusted)."""
    last_tau: float | None = None
    last_step: int | None = None
    evals_since_best: int = 0
    train_accepted: float = 0.0
    """Accepted slots (tau - 1 summed over blocks) of the training logs since the last evaluation."""
    train_blocks: float = 0.0
    history: list[list[float]] = field(default_factory=list)
    """[step, held-out tau, training tau] of every evaluation: the run's trajectory, read by
    `trajectory_advice` at the end."""

    def add_train(self, metrics: dict[str, float]) -> None:
        """Count one training log (its `tau` over its `blocks`) towards the next evaluation's train_tau."""
        self.train_accepted += (metrics["tau"] - 1.0) * metrics["blocks"]
        self.train_blocks += metrics["blocks"]

    def train_fields(self) -> dict[str, float]:
        """What a training record leads with: the latest held-out tau, once there is one."""
        return {} if self.last_tau is None else {"heldout_tau": self.last_tau, "heldout_step": self.last_step}

    def observe(self, step: int, heldout: dict[str, float]) -> dict[str, Any]:
        """Record one evaluation; returns its record (held-out tau, train tau and gap first,
        then the best so far, a warning when it did not improve (a Finding, which `RunLogger.log`
        writes as its text and code), then the held-out metrics)."""
        tau = heldout["tau"]
        train_tau = 1.0 + self.train_accepted / self.train_blocks if self.train_blocks else math.nan
        self.train_accepted, self.train_blocks = 0.0, 0.0
        warning = None
        if tau > self.best_tau:
            self.best_step, self.best_tau, self.best_train_tau = step, tau, train_tau
            self.best_interval = list(heldout.get("tau_interval") or [])
            self.best_per_sample_mean = heldout.get("tau_per_sample_mean")
            self.best_confidence_adjusted = heldout.get("tau_confidence_adjusted")
            self.evals_since_best = 0
        else:
            self.evals_since_best += 1
            # One evaluation below the best can be noise (or a flat start); two in a row are a trend.
            if self.evals_since_best >= PATIENCE and len(self.history) + 1 >= MIN_EVALS_FOR_VERDICT:
                warning = self._warning(tau, train_tau)
        self.last_tau, self.last_step = tau, step
        self.lookup_tau = heldout.get("tau_lookup", self.lookup_tau)
        if "lookup_text_heldout" in heldout and "lookup_text_training" in heldout:
            self.lookup_text = [heldout["lookup_text_heldout"], heldout["lookup_text_training"],
                                heldout.get("lookup_text_training_samples", 0)]
        if "confidence_heldout" in heldout and "confidence_training" in heldout:
            self.confidence = [heldout["confidence_heldout"], heldout["confidence_training"],
                               heldout.get("confidence_training_samples", 0)]
        self.history.append([float(step), float(tau), float(train_tau)])
        # the gap compares like with like: per-block means on both sides (the walk has no
        # training counterpart)
        gap = train_tau - heldout.get("tau_blocks", tau)
        record: dict[str, Any] = {"heldout_tau": tau, "train_tau": train_tau, "tau_gap": gap,
                                  "best_heldout_tau": self.best_tau, "best_step": self.best_step}
        if warning:
            record["warning"] = warning
        return {**record, **heldout}

    def _warning(self, tau: float, train_tau: float) -> Finding:
        said = dict(tau=tau, best_tau=self.best_tau, best_step=self.best_step, evaluations=self.evals_since_best)
        if train_tau > self.best_train_tau:  # training tau rose meanwhile: it fits its samples, not the target
            return Finding("train.heldout-overfitting", **said, best_train_tau=self.best_train_tau,
                           train_tau=train_tau, flag="--epochs")
        return Finding("train.heldout-stalled", **said)

    def progress_fields(self) -> dict[str, float]:
        return {} if self.last_tau is None else {"heldout_tau": self.last_tau}

    def summary(self, step: int) -> dict[str, Any]:
        """For a checkpoint's meta.json: its own held-out tau (when evaluated there) and the best."""
        best = self.best_step is not None
        return {"heldout_tau": self.last_tau if self.last_step == step else None,
                "best_step": self.best_step, "best_heldout_tau": self.best_tau if best else None,
                "interval": list(self.best_interval) if best and self.best_interval else None,
                "lookup_tau": self.lookup_tau if best else None}

    def final_message(self, step: int, final_dir: Path | None, last_checkpoint: Path | None,
                      caveat: str = "", cut_short: str = "") -> str:
        """The run's last line; `caveat` (TrainingData.heldout_caveat) follows the held-out tau it reports;
        `cut_short` (RunLength.done_text) says where --max-steps ended a run before its epochs did."""
        if self.best_step is None:
            return (f"done: {step} steps{cut_short}; drafter exported to {final_dir} (no held-out samples: its "
                    "quality was not measured)")
        span = (f", 95 % interval {self.best_interval[0]:.3f}-{self.best_interval[1]:.3f} over the held-out "
                "samples" if len(self.best_interval) == 2 else "")
        if self.best_per_sample_mean:
            span += f"; {self.best_per_sample_mean:.3f} as the mean of the samples' own taus (pooled: tokens over cycles)"
        if self.lookup_tau:
            span += (f"; prompt lookup, which needs no training, {self.lookup_tau:.3f} on the same samples: the "
                     f"drafter reads {self.best_tau / self.lookup_tau:.2f}x it")
        text = (f"done: {step} steps{cut_short}; {final_dir} holds the best held-out checkpoint, step {self.best_step} "
                f"(held-out tau {self.best_tau:.3f}{span})")
        if self.best_step != step:
            text += (f"; the last step's weights (held-out tau {self.last_tau:.3f}) are in {last_checkpoint} "
                     "(dflash-train export exports them)")
        if caveat:
            text += f". {caveat}"
        unlike = unlike_heldout(self.lookup_text, self.confidence, self.best_confidence_adjusted,
                                said_to_measure=bool(caveat))
        if unlike:
            text += f". {unlike}"
        advice = self.trajectory_advice(step, more="a larger --max-steps" if cut_short else "more --epochs")
        return f"{text}. {advice}" if advice else text

    def trajectory_advice(self, step: int, more: str = "more --epochs") -> str | None:
        """What the run's held-out trajectory says about its length, from its second half: the
        held-out tau at the evaluation nearest half the steps against the best after it, beside the
        training tau over the same span. Flat held-out tau while the training tau climbs: the data
        limits the drafter, not its steps (the BPE benchmark's prose at 32,768 completions: +2.8 %
        held out against +14 % on its training batches over the second half). Still rising at the last evaluation: more epochs may pay. None for a run of
        fewer than four evaluations."""
        rows = [r for r in self.history if math.isfinite(r[1])]
        if len(rows) < 4 or step <= 0:
            return None
        mid = min(rows, key=lambda r: abs(r[0] - step / 2))
        later = [r for r in rows if r[0] > mid[0]]
        if not later:
            return None
        best = max(later, key=lambda r: r[1])
        gain = best[1] / mid[1] - 1
        train_gain = best[2] / mid[2] - 1 if math.isfinite(best[2]) and math.isfinite(mid[2]) and mid[2] > 0 else math.nan
        span = (f"over the second half of the run the held-out tau went {mid[1]:.3f} (step {int(mid[0])}) -> "
                f"{best[1]:.3f} (step {int(best[0])}, {100 * gain:+.1f} %)")
        if gain < LITTLE_GAIN and math.isfinite(train_gain) and train_gain > 2 * max(gain, 0.0) + LITTLE_GAIN:
            return (f"{span} while the training batches' tau went {mid[2]:.3f} -> {best[2]:.3f} "
                    f"({100 * train_gain:+.1f} %): the data limits this drafter more than its steps do. More "
                    "distinct prompts from more text, or more sampled completions of each (dflash-generate "
                    "--samples-per-prompt), raise it (on the BPE benchmark's prose at 32,768 completions, prompts from "
                    "twice the text gave 1.91x prompt lookup's tau where 1.74x had stopped rising); more --epochs "
                    "mostly fit the training samples (docs/recipe.md, --epochs)")
        last, before = rows[-1], rows[-2]
        if last[1] >= self.best_tau and last[1] / before[1] - 1 >= STILL_RISING:
            return (f"{span}, and {100 * (last[1] / before[1] - 1):+.1f} % at the last evaluation alone: still "
                    f"rising, so {more} may pay")
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, **asdict(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k != "version":
                setattr(self, k, v)


def strict_json(value: Any) -> Any:
    """`value` with every nan or inf float (a diverged loss, a train_tau of no training log) as
    None: metrics.jsonl is strict JSON, which has no NaN or Infinity (readers of other languages,
    and `json.loads(..., parse_constant=...)`, refuse them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class RunLogger:
    """Console (tqdm bar + one line per log), metrics.jsonl and TensorBoard; rank 0 only."""

    def __init__(self, run_dir: Path, *, enabled: bool, progress: bool, tensorboard: bool):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.bar: tqdm | None = None
        self.progress = progress
        self.writer = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # optional dependency
                SummaryWriter = None  # noqa: N806
            if SummaryWriter is not None:
                self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def keep_until(self, step: int) -> int:
        """A resume from a checkpoint of `step`: drop metrics.jsonl's records of later steps (a
        killed run logged them past its last checkpoint, the resumed run logs them again) and any
        torn last line, rewriting the file atomically; returns how many records were dropped."""
        if not self.enabled or not self.path.is_file():
            return 0
        lines = self.path.read_text().splitlines()
        kept = []
        for line in lines:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):  # a line torn by the kill
                continue
        if len(kept) < len(lines):
            atomic_write_bytes(self.path, "".join(f"{line}\n" for line in kept).encode())
        return len(lines) - len(kept)

    def set_aside(self) -> Path | None:
        """A fresh start: move the metrics.jsonl of an earlier run in this directory (whose
        checkpoints are gone) to metrics.jsonl.N, the first N free, rather than append this
        run's steps 1, 2, ... after its own; returns where it went (None: there was none)."""
        if not self.enabled or not self.path.is_file() or self.path.stat().st_size == 0:
            return None
        n = 1
        while (aside := self.path.with_name(f"{self.path.name}.{n}")).exists():
            n += 1
        os.replace(self.path, aside)
        return aside

    def start(self, total_steps: int, initial_step: int) -> None:
        if self.enabled and self.progress:
            self.bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True,
                            disable=None, desc="train")

    def info(self, message: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar is not None else tqdm.write)(message)

    def advance(self, steps: int = 1, **postfix: float) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            if postfix:
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)

    def log(self, step: int, kind: str, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "kind": kind, "time": time.time(), **metrics}
        if isinstance(warning := metrics.get("warning"), Finding):  # its text, and its code for readers
            record |= {"warning": str(warning), "warning_code": warning.code}
        with open(self.path, "a") as f:
            f.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.writer.add_scalar(f"{kind}/{k}", v, step)
        keys = _EVAL_KEYS if kind == "eval" else _TRAIN_KEYS
        # nan and inf are shown (loss=nan): a diverged run must not look like one with less to say
        shown = " ".join(f"{_SHORT.get(k, k)}={metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), (int, float)))
        self.info(f"[{kind} step {step}] {shown}")
        if metrics.get("warning"):
            self.info(f"warning: {metrics['warning']}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()


class StepProfiler:
    """Wall-time breakdown of a step, measured only on profiled steps (it synchronizes CUDA)."""

    def __init__(self, interval: int, device: torch.device):
        self.interval, self.device = interval, device
        self.active = False
        self.times: dict[str, float] = {}
        if os.environ.get("DFLASH_SYNC_DEBUG") and device.type == "cuda":
            # Warn (once per code location) wherever the step makes the host wait for the GPU.
            torch.cuda.set_sync_debug_mode("warn")

    def begin(self, step: int) -> None:
        self.active = self.interval > 0 and step % self.interval == 0
        self.times = {}

    @contextmanager
    def section(self, name: str):
        if not self.active:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start

    def report(self) -> str | None:
        if not self.active or not self.times:
            return None
        total = sum(self.times.values())
        parts = " ".join(f"{k}={v * 1e3:.1f}ms({100 * v / total:.0f}%)" for k, v in self.times.items())
        return f"profile: {parts} total={total * 1e3:.1f}ms"
