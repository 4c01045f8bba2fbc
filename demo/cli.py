"""The `dflash-demo` command line; the demo itself is `demo.run_demo` (loaded, with torch, when it runs).
Its flags, config keys and --help are the fields of `DemoCommandConfig` (`dflash.runtime.settings`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import click
from dflash.runtime.cli import Command
from dflash.runtime.settings import setting, settings_options


@dataclass(kw_only=True)
class DemoCommandConfig:
    """Everything `dflash-demo` takes; the same names as its flags and config-file keys."""

    workdir: str = setting("dflash-demo", type=click.Path(file_okay=False))
    """Where the target, data, cache, run and report go: a new or empty directory (the demo marks
    it as its own) or one an earlier demo used; each run replaces what the demo wrote there."""
    small: bool = setting(False, one_way=True)
    """A reduced run (about 25 s on 2 cores) for tests."""
    seed: int = 0
    """Seed of every random choice of the demo."""
    train_target: bool = setting(False, one_way=True)
    """Train the target anew even where the shipped one fits (default sizes, seed 0): about 70 s
    more on 2 cores."""


@click.command(cls=Command, name="dflash-demo", context_settings={"help_option_names": ["-h", "--help"]},
               stop_note="demo.stopped")
@settings_options(DemoCommandConfig)
def main(settings: DemoCommandConfig) -> None:
    """Take the shipped small target (or train one on the shipped corpus), then extract, train and evaluate a DFlash drafter.

    Exit status: 0 done, 2 a stage failed (one paragraph names it and its log) or --workdir holds
    files that are not the demo's, 130/143 stopped by SIGINT/SIGTERM, 1 an unexpected failure.
    """
    from .pipeline import SMALL, DemoSizes, run_demo  # torch and transformers load here

    sizes = SMALL if settings.small else DemoSizes()
    begin = time.perf_counter()
    result = run_demo(Path(settings.workdir), sizes, settings.seed, train_anew=settings.train_target)
    r = result["eval"]["prompt_sets"][0]
    click.echo(f"\ndemo done in {time.perf_counter() - begin:.0f} s: tau {r['tau']:.2f} "
               f"(block {result['eval']['settings']['block_size']}), speedup {r['speedup']:.2f}x, "
               f"lossless {'yes' if r['lossless'].get('identical') else 'NO'}; report in {settings.workdir}/demo_report.json")


if __name__ == "__main__":
    main()
