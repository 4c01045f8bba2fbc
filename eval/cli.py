"""The `dflash-eval` command line: flags and `--config FILE`; the measurement is `run.run_eval`.

Kept apart from the measurement so that `dflash-eval --help` (and a bad flag) never imports
torch or transformers: they load once the settings are read. Errors, signals and exit statuses
follow the contract of every dflash command (`dflash.runtime.cli`).
"""

from __future__ import annotations

import json
import sys

import click
from dflash.runtime.cli import EXIT_FAILED, Command
from dflash.runtime.config import config_file_option
from dflash.runtime.devices import AUTO, DTYPE_NAMES, DtypeChoice


@click.command(cls=Command, name="dflash-eval", context_settings={"help_option_names": ["-h", "--help"]})
@config_file_option(help="JSON or YAML file of settings, keys as the flags (target_model, drafter, prompts "
                         "(a file or a list), max_new_tokens, ...); flags override it.")
@click.option("--target-model", required=True, type=click.Path(exists=True, file_okay=False),
              help="HF target model directory.")
@click.option("--drafter", required=True, type=click.Path(exists=True, file_okay=False),
              help="Exported drafter directory.")
@click.option("--prompts", "prompt_files", required=True, multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="JSONL of prompts (input_ids / prompt_ids / text); repeat for several prompt sets.")
@click.option("--max-new-tokens", default=128, show_default=True, type=int)
@click.option("--max-prompts", default=None, type=int, help="Use only the first N prompts of each file.")
@click.option("--block-size", default=None, type=int, help="Drafted block size (<= the trained one). [default: trained]")
@click.option("--batch-size", default=1, show_default=True, type=int, help="Prompts decoded together.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy (lossless check).")
@click.option("--seed", default=0, show_default=True, type=int, help="Sampling seed.")
@click.option("--stop-token-id", "stop_token_ids", multiple=True, type=int, help="Stop token(s). [default: eos]")
@click.option("--ignore-eos", is_flag=True, help="Always generate --max-new-tokens tokens.")
@click.option("--device", default=AUTO, show_default=True,
              help="cpu, cuda, cuda:1, ... (auto: this process's GPU if CUDA is available, else cpu).")
@click.option("--dtype", default=AUTO, show_default=True, type=DtypeChoice((AUTO, *DTYPE_NAMES)),
              help="Compute dtype (auto: fp32 on CPU, bf16 on CUDA; bfloat16/float16/float32 are accepted too).")
@click.option("--attn-implementation", default=None, help="Target attention (sdpa, eager, ...).")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Also run prompt lookup (n-gram drafting, no training) under the same verification.")
@click.option("--lookup-ngram", default=4, show_default=True, type=int,
              help="Longest suffix n-gram prompt lookup matches (falls back to shorter ones).")
@click.option("--strict", is_flag=True, help="Exit with status 1 if any greedy output diverges from the target's.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def main(target_model: str, drafter: str, prompt_files: tuple[str, ...], max_new_tokens: int,
         max_prompts: int | None, block_size: int | None, batch_size: int, temperature: float, seed: int,
         stop_token_ids: tuple[int, ...], ignore_eos: bool, device: str, dtype: str,
         attn_implementation: str | None, baseline: bool, lookup_ngram: int, strict: bool, as_json: bool) -> None:
    """Speculative decoding of PROMPTS with DRAFTER and TARGET_MODEL: tau, speedup, lossless check.

    Exit status: 0 done, 1 a greedy output diverged under --strict, 2 bad settings or input
    (one paragraph says what and where), 130/143 stopped by SIGINT/SIGTERM.
    """
    from .run import format_report, run_eval  # torch and transformers load here

    report = run_eval(
        target_model, drafter, list(prompt_files), max_new_tokens=max_new_tokens, max_prompts=max_prompts,
        block_size=block_size, batch_size=batch_size, temperature=temperature, seed=seed,
        stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, device=device, dtype=dtype,
        attn_implementation=attn_implementation, baseline=baseline, lookup_ngram=lookup_ngram)
    click.echo(json.dumps(report, indent=2) if as_json else format_report(report))
    checks = [c for r in report["prompt_sets"] for c in (r["lossless"], r.get("prompt_lookup", {}).get("lossless")) if c]
    diverged = any(c["checked"] and not c["identical"] for c in checks)
    if diverged:
        click.echo("dflash-eval: speculative output differs from the target's greedy output "
                   "(see docs/eval.md, 'The lossless check').", err=True)
        if strict:
            sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    main()
