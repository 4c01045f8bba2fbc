"""Whether the loader holds the training back: a notice the run gives once, when its steps waited
for batches for a share of a logged span in steady state (docs/train.md, "Long samples")."""

from __future__ import annotations

from dataclasses import dataclass

from dflash.runtime.findings import Finding
from dflash.train.data.workers import decode_threads

LOADER_BOUND = 0.1
"""The data wait of a logged span (the share of its wall time the trainer waited for a batch) from
which the run says the loader is its limit. Past the first span (compilation, the workers' start),
a batch waited for is one the workers had not ready: that share of the run goes to reading."""


@dataclass
class LoaderWatch:
    """Watches the logged spans of one process of a run on a GPU. A follow run waits for the
    extraction by design, and on the CPU the workers share the training's cores: neither is told."""

    workers: int
    cores: int
    watching: bool
    spans: int = 0
    told: bool = False

    @property
    def threads(self) -> int:
        """Decode threads of each worker, as the loader gives them (train/data/workers.py)."""
        return decode_threads(self.workers, self.cores)

    def observe(self, step: int, data_wait: float) -> Finding | None:
        """The notice for the span ending at `step`, at most once a run."""
        self.spans += 1
        if self.told or not self.watching or self.spans < 2 or not data_wait >= LOADER_BOUND:
            return None
        self.told = True
        return Finding("train.loader-bound", step=step, data_wait=round(float(data_wait), 3), workers=self.workers,
                       threads=self.threads, cores=self.cores)
