"""The `dflash-eval` command line: its flags, config keys and --help are the fields of
`EvalCommandConfig` (through `dflash.runtime.settings`, as every command's); the measurement is
`run.run_eval`.

Kept apart from the measurement so that `dflash-eval --help` (and a bad flag) never imports
torch or transformers: they load once the settings are read. Errors, signals and exit statuses
follow the contract of every dflash command (`dflash.runtime.cli`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

import click
from dflash.runtime.cli import EXIT_FAILED, Command
from dflash.runtime.devices import AUTO, DTYPE_NAMES, DtypeChoice
from dflash.runtime.settings import setting, settings_options


@dataclass(kw_only=True)
class EvalCommandConfig:
    """Everything `dflash-eval` takes; the same names as its flags and config-file keys."""

    target_model: str = setting(type=click.Path(exists=True, file_okay=False))
    """HF target model directory."""
    drafter: str = setting(type=click.Path(exists=True, file_okay=False))
    """Exported drafter directory."""
    prompts: list[str] = setting(type=click.Path(exists=True, dir_okay=False))
    """JSONL of prompts (input_ids / prompt_ids / text); repeat for several prompt sets (in a config
    file: a list, or one file as a string)."""
    max_new_tokens: int = 128
    """New tokens generated per prompt."""
    max_prompts: int | None = None
    """Use only the first N prompts of each file."""
    block_size: int | None = None
    """Drafted block size (<= the trained one) [default: the trained one]."""
    batch_size: int = 1
    """Prompts decoded together."""
    temperature: float = 0.0
    """0 = greedy (lossless check)."""
    seed: int = 0
    """Sampling seed."""
    stop_token_ids: list[int] = setting(default_factory=list, flag="--stop-token-id")
    """Stop token (repeat for several) [default: eos]."""
    ignore_eos: bool = setting(False, one_way=True)
    """Always generate --max-new-tokens tokens."""
    device: str = AUTO
    """cpu, cuda, cuda:1, ... (auto: this process's GPU if CUDA is available, else cpu)."""
    dtype: str = setting(AUTO, type=DtypeChoice((AUTO, *DTYPE_NAMES)))
    """Compute dtype (auto: fp32 on CPU, bf16 on CUDA; bfloat16/float16/float32 are accepted too)."""
    attn_implementation: str | None = None
    """Target attention (sdpa, eager, ...)."""
    baseline: bool = True
    """Also run prompt lookup (n-gram drafting, no training) under the same verification."""
    lookup_ngram: int = 4
    """Longest suffix n-gram prompt lookup matches (falls back to shorter ones)."""
    confidence_threshold: float | None = None
    """Also decode stopping each block where the running product of the drafts' predicted acceptance
    probabilities falls below this (a drafter with a confidence head, DSpark's), and report its tau
    and drafts per cycle beside the whole block's."""
    strict: bool = setting(False, one_way=True)
    """Exit with status 1 if any greedy output diverges from the target's."""
    as_json: bool = setting(False, one_way=True, flag="--json")
    """Print the report as JSON."""
    update_card: bool = setting(False, one_way=True)
    """Record the figures in the drafter's model card (its README.md, written again from config.json,
    where they are kept beside the training record; one entry per prompt set, block and temperature)."""


@click.command(cls=Command, name="dflash-eval", context_settings={"help_option_names": ["-h", "--help"]},
               oom_advice="Lower --batch-size (the prompts decoded at once) or --max-new-tokens, or free the "
                          "device of other processes, then rerun.")
@settings_options(EvalCommandConfig, config_help="JSON or YAML file of settings, keys as the flags (target_model, "
                  "drafter, prompts (a file or a list), max_new_tokens, ...); flags override it.")
def main(settings: EvalCommandConfig) -> None:
    """Speculative decoding of PROMPTS with DRAFTER and TARGET_MODEL: tau, speedup, lossless check.

    Exit status: 0 done, 1 a greedy output diverged under --strict, 2 bad settings or input
    (one paragraph says what and where), 130/143 stopped by SIGINT/SIGTERM.
    """
    from .run import format_report, run_eval  # torch and transformers load here

    measured = {k: v for k, v in asdict(settings).items()
                if k not in ("target_model", "drafter", "prompts", "strict", "as_json", "update_card")}
    measured["stop_token_ids"] = tuple(settings.stop_token_ids)
    report = run_eval(settings.target_model, settings.drafter, list(settings.prompts), **measured)
    click.echo(json.dumps(report, indent=2) if settings.as_json else format_report(report))
    if settings.update_card:
        from dflash.train.export import update_card

        card = update_card(settings.drafter, report)
        click.echo(f"model card updated: {card}", err=settings.as_json)
    checks = [c for r in report["prompt_sets"] for c in (r["lossless"], r.get("prompt_lookup", {}).get("lossless")) if c]
    diverged = any(c["checked"] and not c["identical"] for c in checks)
    if diverged:
        click.echo("dflash-eval: speculative output differs from the target's greedy output "
                   "(see docs/eval.md, 'The lossless check').", err=True)
        if settings.strict:
            sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    main()
