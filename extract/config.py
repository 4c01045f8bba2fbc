"""Settings of one extraction run: a small validated dataclass and a config-file loader. The
settings that decide the cache's content are marked where they are declared (`identity=True`):
the header records them and a resume must match them (`content_settings`). The target-layer rule
is part of the cache contract: `cache_tools.layers`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from dflash.cache_tools.codecs import CODEC_NAMES
from dflash.cache_tools.layers import validate_target_layer_ids
from dflash.runtime.devices import DTYPE_ALIASES, DTYPE_NAMES, DtypeChoice
from dflash.runtime.errors import SettingError
from dflash.runtime.findings import Finding
from dflash.runtime.positions import TargetPositions
from dflash.runtime.settings import IntList, identity_of, setting

from .data import PartRules

DTYPES = DTYPE_NAMES  # the runtime's dtype names (long torch names are accepted as aliases)
LONG_SAMPLE_POLICIES = ("truncate", "skip")


class ExtractConfigError(SettingError):
    """A setting of `dflash-extract` is missing, unknown or out of range."""


@dataclass(kw_only=True)
class ExtractConfig:
    """Everything `dflash-extract` needs; the same names as its flags and config-file keys."""

    target_model: str
    """Local Hugging Face model directory of a decoder-only causal LM (config.json + safetensors)."""
    data: str
    """Tokenized completions: a .jsonl/.jsonl.gz file or a directory of them (a .json file of one
    record a line is read too; a .json that is one JSON document, such as a config.json, is left
    out with a note)."""
    output: str
    """Cache directory to create, or to resume when it already holds this extraction."""
    target_layer_ids: list[int] | None = setting(None, type=IntList())
    """Comma-separated decoder layers to capture (id l = output of layer l, before the final norm)
    [default: the DFlash rule round(1 + i*(N-4)/(K-1))]."""
    num_captured_layers: int = 5
    """With no --target-layer-ids: how many target layers the DFlash rule captures (its K; the
    reference calls it num_draft_layers, the deprecated name of this setting)."""
    dtype: str = setting("bf16", type=DtypeChoice(DTYPE_NAMES), identity=True)
    """Compute dtype of the target. The cache always stores bf16 (or fp8)."""
    attn_implementation: str | None = None
    """Attention kernel passed to from_pretrained (sdpa, eager, flash_attention_2, ...) [default:
    the model's]."""
    device: str | None = None
    """Torch device [default: cuda if available, else cpu]."""
    device_map: str | None = None
    """'auto' spreads a large target over the visible GPUs (needs accelerate)."""
    max_seq_len: int = setting(8192, identity=True)
    """Longest sample kept whole, at most the target's positions (its config's
    max_position_embeddings, extended by a rope_scaling factor): longer ones are truncated or
    skipped (--long-samples), and the summary says when the target's positions held them."""
    long_samples: str = setting("truncate", choices=LONG_SAMPLE_POLICIES, identity=True)
    """What to do with samples longer than --max-seq-len (or the target's positions)."""
    skip_bad: bool = setting(False, identity=True)
    """Skip malformed records (counted in the manifest) instead of stopping with an error."""
    part_tokens: int = setting(65536, identity=True)
    """Tokens per cache part (the unit of resume): a part closes before the sample that would
    take it past this many tokens."""
    token_budget: int = 32768
    """Padded tokens per forward batch (batch size x longest sample)."""
    sort_window_tokens: int | None = setting(None, identity=True)
    """Sort consecutive records up to this many tokens by length and cut them, in that order, into
    parts: batches of similar lengths, little padding. Changes which samples go to which part, so a
    resume must keep it [default: 16 x --part-tokens; 0: each part alone]."""
    codec: str = setting("bf16", choices=CODEC_NAMES)
    """Hidden-state codec: bf16 lossless, fp8 e4m3 + per-token scale, nf4 4-bit + a scale per 32
    values, raw uncompressed."""
    chunk_rows: int = 128
    """Rows per compressed chunk in the cache."""
    shard_rows: int = 8192
    """Rows per shard file in the cache (a multiple of --chunk-rows)."""
    store_last_hidden: bool = setting(False, identity=True)
    """Also store the last decoder layer's output (pre-norm), for soft labels."""
    store_topk: int = setting(8, identity=True)
    """Also store the target's top-k next-token log-probs, the trainer's soft labels (0: off). The top-8
    cost 64 bytes a token before compression, and the target's last layers and head run over every
    token (about 14 % of the forward at the Qwen3-8B shape); trained on them, the drafter's tau rose
    3-4 % on the BPE benchmark (docs/recipe.md)."""
    store_top1: bool = True
    """Store the target's greedy next token per token (2 bytes a token up to 65,536 ids, else 4),
    for the samples of --top1-share: the trainer's held-out estimate replays greedy verification
    against it."""
    top1_share: float = 0.05
    """The share of samples whose top-1 is stored: those the trainer's held-out split takes first
    (a hash of its split key, the prompt's, below it; the split holds out those below --eval-fraction, 0.02 by
    default), the only ones it reads it for. The others cost no layer past the captured ones and
    no lm_head. 1: every sample (a cache for --eval-cache or `dflash-train estimate --cache`);
    0: none, as --no-store-top1."""
    num_writers: int | None = None
    """Writer processes compressing and committing parts; 0 writes in the main process [default: 0
    on cpu, else min(cores - 2, 12)]."""
    rank: int | None = None
    """This process's rank [default: $RANK (torchrun) or 0]."""
    world_size: int | None = None
    """Number of extraction processes sharing the cache [default: $WORLD_SIZE or 1]."""
    force: bool = setting(False, one_way=True)
    """Delete an existing cache with other settings and start anew (rank 0 only); a cache of the
    same settings is resumed, its committed parts kept."""
    disk_budget: str | int | None = None
    """Most bytes of parts the cache holds on disk (e.g. 500G, 2T; plus at most one part): the
    extraction waits for room and evicts parts every rank of a `dflash-train --follow` run has
    trained on (default: no budget)."""
    follow_epochs: int = 1
    """With --disk-budget: keep extracting for this many training epochs, extracting again, in
    the order the trainer reads them, the parts evicted after the epoch before."""
    progress: bool = True
    """Show a progress bar."""

    def __post_init__(self) -> None:
        def flag(name: str) -> str:
            return f"--{name.replace('_', '-')}"

        for name in ("target_model", "data", "output"):
            if not getattr(self, name):
                raise ExtractConfigError(Finding("extract.flag-required", flag=flag(name)))
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        for name, choices in (("dtype", DTYPES), ("codec", CODEC_NAMES), ("long_samples", LONG_SAMPLE_POLICIES)):
            if getattr(self, name) not in choices:
                raise ExtractConfigError(Finding("extract.flag-choice", flag=flag(name), value=getattr(self, name), choices=list(choices)))
        for name in ("max_seq_len", "part_tokens", "token_budget", "num_captured_layers",
                     "chunk_rows", "shard_rows", "follow_epochs"):
            if int(getattr(self, name)) < 1:
                raise ExtractConfigError(Finding("extract.flag-below-minimum", flag=flag(name), value=getattr(self, name), minimum=1))
        if not 0.0 <= self.top1_share <= 1.0:
            raise ExtractConfigError(Finding("extract.top1-share-range", flag="--top1-share", value=self.top1_share))
        for name in ("store_topk", "sort_window_tokens", "num_writers"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ExtractConfigError(Finding("extract.flag-below-minimum", flag=flag(name), value=getattr(self, name), minimum=0))
        if self.disk_budget is not None:
            from dflash.cache_tools.staging import parse_size

            if parse_size(self.disk_budget) < 1:
                raise ExtractConfigError(Finding("extract.disk-budget-not-positive", flag="--disk-budget", value=self.disk_budget))
        if self.follow_epochs > 1 and self.disk_budget is None:
            raise ExtractConfigError(Finding("extract.follow-epochs-without-budget", flag="--follow-epochs", needs="--disk-budget"))
        if self.target_layer_ids is not None:
            # Order, repeats and signs now, before a target loads; the bound N-2 once it has.
            self.target_layer_ids = validate_target_layer_ids(self.target_layer_ids, None)
        if self.world_size is None:
            self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if self.rank is None:
            self.rank = int(os.environ.get("RANK", "0"))
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ExtractConfigError(Finding("extract.rank-out-of-range", rank=self.rank, world_size=self.world_size))

    def stored_top1_share(self) -> float:
        """The share of samples whose top-1 the cache stores (0: none)."""
        return float(self.top1_share) if self.store_top1 else 0.0

    def window_tokens(self) -> int:
        """Tokens of a sort window (fixed by the settings, never by the run's state)."""
        tokens = self.sort_window_tokens if self.sort_window_tokens is not None else 16 * self.part_tokens
        return max(tokens, self.part_tokens)

    def sample_limit(self, positions: TargetPositions | None = None) -> int:
        """The longest sample kept whole: --max-seq-len, or the target's positions where fewer."""
        return min(self.max_seq_len, positions.limit) if positions else self.max_seq_len

    def part_rules(self, vocab_size: int, positions: TargetPositions | None = None) -> PartRules:
        """How this run cuts the records into sort windows and parts (data.plan_windows)."""
        held = self.sample_limit(positions)
        return PartRules(
            vocab_size=vocab_size, max_seq_len=held, long_samples=self.long_samples,
            skip_bad=self.skip_bad, part_tokens=self.part_tokens, window_tokens=self.window_tokens(),
            length_limit=positions.describe() if positions and held < self.max_seq_len else "",
        )

    def content_settings(self, positions: TargetPositions | None = None) -> dict[str, Any]:
        """The settings that decide the cache's content, those marked `identity=True` (recorded in
        the header's `settings`; `max_seq_len` is the length samples are held to, the target's
        positions where fewer, and `sort_window_tokens` the window as `window_tokens` decides it)."""
        return identity_of(self, values={"max_seq_len": self.sample_limit(positions),
                                         "sort_window_tokens": self.window_tokens()})


DEPRECATED_KEYS = {"num_draft_layers": "num_captured_layers"}
"""Old setting names still accepted (with a warning) as flags and config-file keys."""
