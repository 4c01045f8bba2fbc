"""How a run tells its user a notice: once (rank 0, where its log is), on its console."""

from __future__ import annotations

import sys

from dflash.runtime.findings import Finding, emit
from dflash.train.measure.reporting import RunLogger
from tqdm import tqdm


def tell(log: RunLogger, notice: Finding | None, *, prefix: str = "Note: ") -> None:
    """Emit `notice` on the run's console (a test collects it: `findings.collected`), past the
    progress bar."""
    if notice is None or not log.enabled:
        return
    with tqdm.external_write_mode(file=sys.stdout):
        emit(notice, prefix=prefix, stream=sys.stdout)
