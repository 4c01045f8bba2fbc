"""The settings of one `dflash-eval` measurement (`run.run_eval` takes them): the same names as the
command's flags and config-file keys. Importing this module does not import torch."""

from __future__ import annotations

from dataclasses import dataclass

import click
from dflash.runtime.devices import AUTO, DTYPE_NAMES, DtypeChoice
from dflash.runtime.errors import UsageError
from dflash.runtime.findings import Finding
from dflash.runtime.settings import setting


class EvalError(UsageError):
    """A setting of `dflash-eval` is wrong."""


@dataclass(kw_only=True)
class EvalConfig:
    """What a measurement of a drafter against its target takes."""

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

    def __post_init__(self) -> None:
        if isinstance(self.prompts, str):
            self.prompts = [self.prompts]
        self.prompts, self.stop_token_ids = [str(p) for p in self.prompts], list(self.stop_token_ids)
        if self.batch_size < 1:
            raise EvalError(Finding("eval.flag-below-one", flag="--batch-size", value=self.batch_size))
        if self.lookup_ngram < 1:
            raise EvalError(Finding("eval.flag-below-one", flag="--lookup-ngram", value=self.lookup_ngram))
