"""The `dflash-demo` command line; the demo itself is `demo.run_demo` (loaded, with torch, when it runs)."""

from __future__ import annotations

import time
from pathlib import Path

import click
from dflash.runtime.cli import Command


@click.command(cls=Command, name="dflash-demo", context_settings={"help_option_names": ["-h", "--help"]},
               stop_note="; rerun it to start the demo again (each stage rewrites its outputs).")
@click.option("--workdir", default="dflash-demo", show_default=True, type=click.Path(file_okay=False),
              help="Where the target, data, cache, run and report go.")
@click.option("--small", is_flag=True, help="A reduced run (about 25 s on 2 cores) for tests.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--train-target", is_flag=True,
              help="Train the target anew even where the shipped one fits (default sizes, seed 0): about 70 s "
                   "more on 2 cores.")
def main(workdir: str, small: bool, seed: int, train_target: bool) -> None:
    """Take the shipped small target (or train one on the shipped corpus), then extract, train and evaluate a DFlash drafter.

    Exit status: 0 done, 2 a stage failed (one paragraph names it and its log), 130/143
    stopped by SIGINT/SIGTERM, 1 an unexpected failure.
    """
    from .pipeline import SMALL, DemoSizes, run_demo  # torch and transformers load here

    sizes = SMALL if small else DemoSizes()
    begin = time.perf_counter()
    result = run_demo(Path(workdir), sizes, seed, train_anew=train_target)
    r = result["eval"]["prompt_sets"][0]
    click.echo(f"\ndemo done in {time.perf_counter() - begin:.0f} s: tau {r['tau']:.2f} "
               f"(block {result['eval']['settings']['block_size']}), speedup {r['speedup']:.2f}x, "
               f"lossless {'yes' if r['lossless'].get('identical') else 'NO'}; report in {workdir}/demo_report.json")


if __name__ == "__main__":
    main()
