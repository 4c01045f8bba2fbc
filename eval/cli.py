"""The `dflash-eval` command line: its flags, config keys and --help are the fields of
`EvalCommandConfig` (through `dflash.runtime.settings`, as every command's); the measurement is
`run.run_eval`, which takes its settings (`config.EvalConfig`) as they are.

Kept apart from the measurement so that `dflash-eval --help` (and a bad flag) never imports
torch or transformers: they load once the settings are read. Errors, signals and exit statuses
follow the contract of every dflash command (`dflash.runtime.cli`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import click
from dflash.runtime.cli import EXIT_FAILED, Command
from dflash.runtime.findings import Finding, emit
from dflash.runtime.settings import setting, settings_options

from .config import EvalConfig


@dataclass(kw_only=True)
class EvalCommandConfig(EvalConfig):
    """Everything `dflash-eval` takes: the measurement's settings (`EvalConfig`) and what the command
    does with its report; the same names as its flags and config-file keys."""

    strict: bool = setting(False, one_way=True)
    """Exit with status 1 if any greedy output diverges from the target's."""
    as_json: bool = setting(False, one_way=True, flag="--json")
    """Print the report as JSON."""
    update_card: bool = setting(False, one_way=True)
    """Record the figures in the drafter's model card (its README.md, written again from config.json,
    where they are kept beside the training record; one entry per prompt set, block and temperature)."""


@click.command(cls=Command, name="dflash-eval", context_settings={"help_option_names": ["-h", "--help"]},
               oom_advice="eval.out-of-memory")
@settings_options(EvalCommandConfig, config_help="JSON or YAML file of settings, keys as the flags (target_model, "
                  "drafter, prompts (a file or a list), max_new_tokens, ...); flags override it.")
def main(settings: EvalCommandConfig) -> None:
    """Speculative decoding of PROMPTS with DRAFTER and TARGET_MODEL: tau, speedup, lossless check.

    Exit status: 0 done, 1 a greedy output diverged under --strict, 2 bad settings or input
    (one paragraph says what and where), 130/143 stopped by SIGINT/SIGTERM.
    """
    from .run import format_report, run_eval  # torch and transformers load here

    report = run_eval(settings)
    click.echo(json.dumps(report, indent=2) if settings.as_json else format_report(report))
    if settings.update_card:
        from dflash.train.exports.export import update_card

        card = update_card(settings.drafter, report)
        click.echo(f"model card updated: {card}", err=settings.as_json)
    checks = [c for r in report["prompt_sets"] for c in (r["lossless"], r.get("prompt_lookup", {}).get("lossless")) if c]
    diverged = any(c["checked"] and not c["identical"] for c in checks)
    if diverged:
        emit(Finding("eval.output-diverged", prompt_sets=[r["name"] for r in report["prompt_sets"]
                                                          if any(c and c["checked"] and not c["identical"]
                                                                 for c in (r["lossless"], r.get("prompt_lookup", {}).get("lossless")))]),
             prefix="dflash-eval: ")
        if settings.strict:
            sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    main()
