"""`dflash-extract`: run the frozen target over tokenized completions and fill the cache.

Errors, signals and exit statuses follow the contract of every dflash command
(`dflash.runtime.cli`); torch and transformers load when the settings are known to be good.
"""

from __future__ import annotations

import sys

import click
from click.core import ParameterSource
from dflash.cache_tools.cli import CODEC_CHOICES
from dflash.runtime.cli import Command
from dflash.runtime.devices import DTYPE_NAMES, DtypeChoice
from dflash.runtime.signals import exit_status

from .config import ExtractConfig, ExtractConfigError, load_config_file, parse_layer_ids

GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


@click.command(cls=Command, name="dflash-extract",
               context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
               stop_note=(" outside the extraction loop; committed parts are kept. Rerun the same "
                          "command to resume."))
@click.option("--config", "config_file", type=click.Path(dir_okay=False),
              help="JSON or YAML file with any of these settings (same names); flags override it.")
@click.option("--target-model", help="Local Hugging Face model directory (config.json + safetensors).")
@click.option("--data", help="Tokenized completions: a .jsonl/.jsonl.gz file or a directory of them.")
@click.option("--output", help="Cache directory to create or resume.")
@click.option("--target-layer-ids", help="Comma-separated decoder layers to capture "
              "[default: DFlash rule round(1 + i*(N-4)/(K-1))].")
@click.option("--num-captured-layers", type=int, default=5,
              help="With no --target-layer-ids: how many target layers the default rule captures (K).")
@click.option("--num-draft-layers", "num_draft_layers", type=int, hidden=True,
              help="Deprecated name of --num-captured-layers.")
@click.option("--dtype", type=DtypeChoice(DTYPE_NAMES), default="bf16",
              help="Compute dtype of the target.")
@click.option("--attn-implementation", help="Attention kernel passed to from_pretrained (sdpa, eager, ...).")
@click.option("--device", help="Torch device [default: cuda if available, else cpu].")
@click.option("--device-map", help="'auto' to spread a large target over the visible GPUs.")
@click.option("--max-seq-len", type=int, default=8192, help="Longest sample kept whole.")
@click.option("--long-samples", type=click.Choice(["truncate", "skip"]), default="truncate",
              help="What to do with samples longer than --max-seq-len.")
@click.option("--skip-bad/--no-skip-bad", default=False,
              help="Skip malformed records (counted in the manifest) instead of stopping.")
@click.option("--part-tokens", type=int, default=65536, help="Tokens per cache part (the unit of resume).")
@click.option("--token-budget", type=int, default=32768, help="Padded tokens per forward batch.")
@click.option("--sort-window-tokens", type=int,
              help="Sort consecutive records up to this many tokens by length and cut them, in "
                   "that order, into parts: batches of similar lengths, little padding. Changes "
                   "which samples go to which part, so a resume must keep it "
                   "[default: 16 x --part-tokens; 0: each part alone].")
@click.option("--codec", type=click.Choice(CODEC_CHOICES), default="bf16",
              help="Hidden-state codec: bf16 lossless, fp8 e4m3 + scales, raw uncompressed.")
@click.option("--chunk-rows", type=int, default=128, help="Rows per compressed chunk.")
@click.option("--shard-rows", type=int, default=8192, help="Rows per shard file.")
@click.option("--store-last-hidden/--no-store-last-hidden", default=False,
              help="Also store the last decoder layer's output (pre-norm).")
@click.option("--store-topk", type=int, default=0, help="Also store the target's top-k log-probs.")
@click.option("--num-writers", type=int,
              help="Writer processes [default: 0 (in-process) on cpu, min(cores-2, 12) on GPU].")
@click.option("--rank", type=int, help="This process's rank [default: $RANK or 0].")
@click.option("--world-size", type=int, help="Number of processes [default: $WORLD_SIZE or 1].")
@click.option("--force", is_flag=True, default=False,
              help="Delete an existing cache with other settings and start anew (rank 0 only).")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
@click.pass_context
def main(ctx: click.Context, config_file: str | None, **flags) -> None:
    """Run the frozen target model over tokenized completions and write the hidden-state cache.

    Rerunning the same command resumes: committed parts are skipped. Several processes
    (torchrun, or --rank/--world-size) can fill one cache. Exit status: 0 done, 2 bad settings
    or input (one paragraph says what and where), 130/143 stopped by SIGINT/SIGTERM (committed
    parts are kept), 1 an unexpected failure.
    """
    config = build_config(ctx, config_file, flags)
    from .pipeline import run_extraction  # torch/transformers: only once the settings are good

    summary = run_extraction(config)
    click.echo(summary.format(), err=True)
    for skip in summary.skips[:20]:
        click.echo(f"  skipped {skip['where']}: {skip['reason']}", err=True)
    if summary.interrupted_by:
        sys.exit(exit_status(summary.interrupted_by))


def build_config(ctx: click.Context, config_file: str | None, flags: dict) -> ExtractConfig:
    """File values, overridden by flags given on the command line; dataclass defaults otherwise."""
    values = load_config_file(config_file) if config_file else {}
    deprecated = flags.pop("num_draft_layers")
    if ctx.get_parameter_source("num_draft_layers") in GIVEN:
        if ctx.get_parameter_source("num_captured_layers") in GIVEN:
            raise ExtractConfigError("--num-draft-layers is the deprecated name of --num-captured-layers: "
                                     "give only --num-captured-layers.")
        click.echo("Warning: --num-draft-layers is deprecated in dflash-extract: it is "
                   "--num-captured-layers (how many target layers are captured, not the drafter's depth).",
                   err=True)
        values["num_captured_layers"] = deprecated
    for name, value in flags.items():
        if ctx.get_parameter_source(name) in GIVEN:
            values[name] = value
    if isinstance(values.get("target_layer_ids"), str):
        values["target_layer_ids"] = parse_layer_ids(values["target_layer_ids"])
    missing = [k for k in ("target_model", "data", "output") if not values.get(k)]
    if missing:
        raise ExtractConfigError(
            f"Missing {', '.join('--' + k.replace('_', '-') for k in missing)}: give it on the "
            "command line or in the --config file."
        )
    try:
        return ExtractConfig(**values)
    except TypeError as e:
        raise ExtractConfigError(f"Invalid settings: {e}.") from e


if __name__ == "__main__":
    main()
