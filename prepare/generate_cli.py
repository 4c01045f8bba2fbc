"""`dflash-generate`: regenerate a chat dataset's assistant turns with the target itself."""

from __future__ import annotations

from typing import Any

import click
from dflash.runtime.cli import Command

from .cli import CONTEXT, build_settings, render_options
from .driver import GenerateConfig

EXIT_INCOMPLETE = 1


@click.command(cls=Command, name="dflash-generate", context_settings=CONTEXT,
               stop_note="; every finished record is kept. Rerun the same command to go on.")
@render_options(loss_on_default="last-assistant")
@click.option("--server", help="Comma-separated base URLs of OpenAI-compatible servers (vLLM, SGLang, "
                               "transformers serve), e.g. http://host1:8000,http://host2:8000. "
                               "Without it the target runs in-process (HF generate).")
@click.option("--model", help="The model name sent in requests (as the server serves it).")
@click.option("--concurrency", type=int, default=64, help="Requests in flight over all servers.")
@click.option("--max-retries", type=int, default=5, help="Retries of a failed request (backoff, next server).")
@click.option("--request-timeout", type=float, default=600.0, help="Seconds before a request is retried.")
@click.option("--token-ids", type=click.Choice(["auto", "server", "text"]), default="auto",
              help="Answer tokens: the server's ids where it returns them (auto), or the text re-tokenized "
                   "and checked to round-trip.")
@click.option("--temperature", type=float, default=0.0, help="0: greedy.")
@click.option("--top-p", type=float, default=1.0)
@click.option("--max-tokens", type=int, default=2048, help="Longest answer; longer ones end with finish_reason length.")
@click.option("--stop", multiple=True, help="A stop string (repeat the flag for several).")
@click.option("--seed", type=int, help="Sampling seed sent with each request.")
@click.option("--regenerate", type=click.Choice(["last", "all"]), default="last",
              help="Regenerate the last assistant turn, or every one in order on the target's own earlier answers.")
@click.option("--drop-truncated/--keep-truncated", default=False, help="Leave out answers cut by --max-tokens.")
@click.option("--batch-size", type=int, default=16, help="In-process backend: conversations per generate().")
@click.option("--sort-window", type=int, default=8,
              help="In-process backend: batches read ahead and sorted by prompt length, so a batch pads "
                   "little (1: input order).")
@click.option("--device", help="In-process backend: torch device [default: cuda:$LOCAL_RANK if available, else cpu].")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", help="In-process backend dtype.")
@click.option("--progress/--no-progress", default=True, help="Show a progress bar (requests/s, tokens/s, ETA).")
def main(**flags: Any) -> int:
    """Regenerate the assistant turns of a chat dataset with the target, in dflash-extract's format.

    Output is append-only and keyed by source id: rerunning the same command skips finished
    records and never duplicates one; Ctrl-C stops within seconds. Under torchrun (in-process
    backend) each rank takes every WORLD_SIZE-th conversation and appends to the same file.
    Exit status: 0 done, 1 some requests failed after their retries (rerun to retry them),
    2 bad settings or input, 130/143 stopped by a signal.
    """
    if flags.get("loss_on") == "all-assistant" and flags.get("regenerate") == "last":
        click.echo("Note: --loss-on all-assistant with --regenerate last also supervises the dataset's "
                   "earlier answers, not the target's.", err=True)
    config = build_settings(flags, GenerateConfig, ("target_model", "data", "output"))
    from .driver import run_generate

    summary = run_generate(config)
    click.echo(summary.format(), err=True)
    if summary.stopped_by:
        return 128 + summary.stopped_by
    return EXIT_INCOMPLETE if summary.failed else 0


if __name__ == "__main__":
    main()
