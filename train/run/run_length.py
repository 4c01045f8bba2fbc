"""How long a run is: --epochs sizes it, and --max-steps may end it sooner, partway through an
epoch. The learning-rate schedule and the default held-out evaluations (10 a run) span the steps
the run takes, whichever of the two decides them; the startup and the last line say which did."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dflash.runtime.findings import Finding
from dflash.train.config import TrainConfig


@dataclass(frozen=True)
class RunLength:
    """The steps of a run: its epochs' steps, cut at --max-steps where that comes first."""

    steps_per_epoch: tuple[int, ...]
    """Optimizer steps of each epoch (the loader's plan)."""
    max_steps: int = 0
    """--max-steps (0: none)."""

    @classmethod
    def of(cls, steps_per_epoch: Sequence[int], max_steps: int) -> RunLength:
        return cls(tuple(int(n) for n in steps_per_epoch), int(max_steps))

    @property
    def epochs_steps(self) -> int:
        """The steps of every epoch: what the run takes without --max-steps."""
        return sum(self.steps_per_epoch)

    @property
    def total_steps(self) -> int:
        return min(self.max_steps or self.epochs_steps, self.epochs_steps)

    @property
    def cut(self) -> bool:
        """Whether --max-steps ends the run before its last epoch ends."""
        return self.total_steps < self.epochs_steps

    def end(self) -> tuple[int, int, int]:
        """(the epoch the run ends in, counted from 1; the steps of it the run takes; its steps)."""
        before, epoch = 0, 0
        while before + self.steps_per_epoch[epoch] < self.total_steps:
            before += self.steps_per_epoch[epoch]
            epoch += 1
        return epoch + 1, self.total_steps - before, self.steps_per_epoch[epoch]

    def where_it_ends(self, *said: str) -> str:
        """"partway through epoch 2 of 3 (step 6 of its 14; ...)" for a cut run, `said` in the parentheses."""
        epoch, done, steps = self.end()
        of = len(self.steps_per_epoch)
        if done < steps:
            said = (f"step {done} of its {steps}", *said)
        where = "at the end of" if done == steps else "partway through"
        return f"{where} epoch {epoch} of {of}" + (f" ({'; '.join(said)})" if said else "")

    def cut_short(self) -> Finding | None:
        """The notice of a run cut by --max-steps, before its first step (None: its epochs decide its length)."""
        if not self.cut:
            return None
        n = self.total_steps
        epoch, done, steps = self.end()
        return Finding("train.max-steps-cut", max_steps=self.max_steps, step=n, epoch=epoch,
                       epochs=len(self.steps_per_epoch), epoch_step=done, epoch_steps=steps,
                       all_steps=self.epochs_steps,
                       first_epoch_share=None if n >= self.steps_per_epoch[0] else n / self.steps_per_epoch[0])

    def schedule_line(self, cfg: TrainConfig, heldout: bool) -> str | None:
        """The startup line of a run cut by --max-steps (after its notice): its schedule over the steps it takes."""
        if not self.cut:
            return None
        o, n = cfg.optimization, self.total_steps
        floor = "0" if o.min_lr_ratio == 0 else f"{o.min_lr_ratio:g} x --lr"
        evaluations = (f"; held-out evaluations every {cfg.logging.eval_every(n)} step(s), 10 a run"
                       if heldout and cfg.logging.eval_interval is None else "")
        decay = (f"--lr held, then a linear decay over the last {max(1, math.ceil(o.decay_ratio * n))} (wsd)"
                 if o.lr_schedule == "wsd" else "a cosine decay")
        warmup = f"warmup {math.ceil(o.warmup_ratio * n)}, then " if o.warmup_ratio else ""
        return f"schedule over those {n} steps: {warmup}{decay} to {floor} at step {n}{evaluations}"

    def done_text(self) -> str:
        """For the run's last line, after "done: N steps": where --max-steps ended it ("" when the epochs did)."""
        if not self.cut:
            return ""
        every = f"all {len(self.steps_per_epoch)} epoch(s) are {self.epochs_steps} steps"
        return f", ended by --max-steps {self.max_steps} {self.where_it_ends(every)}"
