"""LiLiCorr: the DFlash backbone plus a candidate-lattice correlator (`LiLiCorrDraftModel`): per
drafted slot the top-K candidates of the target head, attention over the whole block's candidates,
and a walk from the anchor over learned candidate-to-candidate scores (the module and its
arithmetic: lattice.py; the engines' contract: docs/drafter.md, "LiLiCorr").

No released trainer trains it: the loss here is ours, derived from the decode rule (the walk's
cross-entropy along the true path, lattice.path_loss). Importing this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from dflash.runtime.findings import Finding
from dflash.train.heads.base import (
    DFlashDrafter,
    DrafterConfig,
    DraftHead,
    HeadExportError,
    HeadInputs,
    HeadMemory,
    HeadOutput,
    HeadSettingError,
    ObjectiveConfig,
)
from dflash.train.heads.limits import below, first, not_finite, out_of_range

if TYPE_CHECKING:
    import torch
    from dflash.train.heads.lilicorr.lattice import LiLiCorrHead
    from torch import nn

MAX_TOPK = 16  # SGLang's MAX_FUSED_CANDIDATE_TOPK and vLLM's LiLiCorrHead check: a power of two up to 16


@dataclass(kw_only=True)
class LiLiCorrSettings:
    """LiLiCorr's drafter settings, each a dflash_config key of its export of the same name (SGLang's
    parse_lilicorr_draft_config requires every one: the engines have no defaults)."""

    lilicorr_candidate_topk: int = 8
    """lilicorr: candidates per slot, the top-K of the full vocabulary's log-softmax (a power of two
    up to 16, as vLLM and SGLang require)."""
    lilicorr_hidden_size: int = 0
    """lilicorr: width of the correlator (0: the drafter's; narrower adds token_proj and costs less)."""
    lilicorr_num_layers: int = 2
    """lilicorr: attention+MLP layers over the block's candidate lattice."""
    lilicorr_num_heads: int = 8
    """lilicorr: attention heads of those layers (must divide the correlator's width)."""
    lilicorr_mlp_ratio: float = 2.0
    """lilicorr: MLP width of those layers over the correlator's width."""
    lilicorr_factor_dim: int = 64
    """lilicorr: width of the unit vectors whose dot products score candidate -> candidate."""
    lilicorr_vector_eps: float = 1e-6
    """lilicorr: epsilon of those vectors' normalization."""
    lilicorr_logit_scale: float = 16.0
    """lilicorr: factor on the dot products (in [-1, 1]) that makes them the walk's logits."""

    def refusal(self) -> Finding | None:
        k = self.lilicorr_candidate_topk
        return first(
            Finding("train.lilicorr-topk", value=k, most=MAX_TOPK) if not 1 <= k <= MAX_TOPK or k & (k - 1) else None,
            not_finite(self, ("lilicorr_mlp_ratio", "lilicorr_vector_eps", "lilicorr_logit_scale")),
            below(self, ("lilicorr_hidden_size",), 0), below(self, ("lilicorr_num_heads", "lilicorr_num_layers",
                                                                    "lilicorr_factor_dim"), 1),
            *(out_of_range(n, getattr(self, n), "more than 0") for n in
              ("lilicorr_mlp_ratio", "lilicorr_vector_eps", "lilicorr_logit_scale") if not getattr(self, n) > 0))


@dataclass(kw_only=True)
class LiLiCorrObjective:
    """The settings of LiLiCorr's loss."""

    lilicorr_loss_weight: float = 1.0
    """lilicorr: weight of the correlator's loss, the walk's cross-entropy along the true path (ours:
    no released trainer trains LiLiCorr; docs/drafter.md, "LiLiCorr")."""

    def refusal(self) -> Finding | None:
        return first(not_finite(self, ("lilicorr_loss_weight",)),
                     out_of_range("lilicorr_loss_weight", self.lilicorr_loss_weight, "0 or more")
                     if self.lilicorr_loss_weight < 0 else None)


KEYS = tuple(f.name for f in fields(LiLiCorrSettings))
"""The export's dflash_config keys of the correlator: its settings, by their names."""


class LiLiCorrDraftHead(DraftHead):
    name = "lilicorr"
    title = "LiLiCorr"
    architecture = "LiLiCorrDraftModel"  # vLLM 0.34.0 registry.py; SGLang 0.5.23 srt/models/lilicorr.py EntryClass
    settings = LiLiCorrSettings
    objective_settings = LiLiCorrObjective
    module_name = "lilicorr"  # the engines' tensor prefix
    picks_drafts = True
    warm_starts_from = ("dflash",)
    # vLLM 0.34 detects the speculator from the architecture (LiLiCorrSpeculatorConfig); SGLang 0.5.23
    # serves it under DFLASH (its DFlash worker builds the model class the architecture names)
    serving = {"name": "LiLiCorr", "vllm_method": None, "sglang_algorithm": "DFLASH", "tags": ["dflash", "lilicorr"]}

    def check(self, config: DrafterConfig) -> None:
        c = config  # (the ranges: LiLiCorrSettings)
        if c.lilicorr_candidate_topk > c.vocab_size:
            raise HeadSettingError(Finding("train.lilicorr-topk", value=c.lilicorr_candidate_topk, most=c.vocab_size))
        width = c.lilicorr_hidden_size or c.hidden_size
        if width % c.lilicorr_num_heads:
            raise HeadSettingError(Finding("train.lilicorr-num-heads", value=c.lilicorr_num_heads, width=width))
        if int(width * c.lilicorr_mlp_ratio) < 1:
            raise HeadSettingError(Finding("train.setting-range", flag="--lilicorr-mlp-ratio", value=c.lilicorr_mlp_ratio,
                                           allowed=f"at least 1/{width}, the correlator's width", default=None))

    def build(self, config: DrafterConfig) -> nn.Module:
        from dflash.train.heads.lilicorr.lattice import LiLiCorrHead

        c = config
        return LiLiCorrHead(
            model_hidden_size=c.hidden_size, block_size=c.block_size, rms_norm_eps=c.rms_norm_eps,
            candidate_topk=c.lilicorr_candidate_topk, hidden_size=c.lilicorr_hidden_size,
            num_layers=c.lilicorr_num_layers, num_heads=c.lilicorr_num_heads, mlp_ratio=c.lilicorr_mlp_ratio,
            factor_dim=c.lilicorr_factor_dim, vector_eps=c.lilicorr_vector_eps, logit_scale=c.lilicorr_logit_scale)

    def initialize(self, drafter: DFlashDrafter, std: float) -> None:
        drafter.lilicorr.reset_parameters(std)

    def candidates(self, config: DrafterConfig) -> int:
        return config.lilicorr_candidate_topk

    def objective(self, inputs: HeadInputs, objective: ObjectiveConfig) -> HeadOutput:
        from dflash.train.heads.lilicorr.training import lattice_objective

        loss, choice = lattice_objective(inputs)
        return HeadOutput(loss=objective.lilicorr_loss_weight * loss, logged=loss.detach(), choice=choice)

    def memory(self, config: DrafterConfig) -> HeadMemory:
        c, d, t, k = config, config.hidden_size, config.block_size, config.lilicorr_candidate_topk
        w, f, heads = c.lilicorr_hidden_size or d, c.lilicorr_factor_dim, c.lilicorr_num_heads
        m = int(w * c.lilicorr_mlp_ratio)
        layer = 4 * w * w + 4 * w + 2 * w + 2 * w * m + m + w  # attention, norms, MLP (lattice.LatticeLayer)
        params = (c.lilicorr_num_layers * layer + (d * w + w if w != d else 0) + 2 * (d * w + w)
                  + 7 * w + w * w + 10 + (t - 1 + k) * w + heads * 2 * t + 3 * w * w + 3 * w + 3 * (w * f + f))
        # rough, not measured: each slot's K candidates are lattice tokens of width w through every layer
        # (bf16: the norms' and attention's inputs, q/k/v, the output, the MLP's) and the attention bias
        # over the block's (T-1) x K candidates per head
        per_candidate = c.lilicorr_num_layers * (16 * w + 4 * m) + 12 * w + 40
        return HeadMemory(params=params, slot_bytes=k * per_candidate + k * (t - 1) * k * heads * 2)

    def proposer(self, drafter: DFlashDrafter, temperature: float, seed: int) -> LatticeWalk:
        return LatticeWalk(drafter, temperature, seed)

    def export_keys(self, config: DrafterConfig) -> dict[str, Any]:
        # lilicorr_enabled: both engines skip the head where it is false; no convolutions (vLLM and SGLang
        # build them only where conv_kernel_size and conv_group_size are both set)
        return {"lilicorr_enabled": True, **{key: getattr(config, key) for key in KEYS}}

    def settings_from_export(self, dflash_config: dict[str, Any]) -> dict[str, Any]:
        d = dflash_config
        if d.get("lilicorr_enabled") is False:
            raise HeadExportError(Finding("train.lilicorr-disabled"))
        missing = [key for key in KEYS if key not in d]
        if missing:
            raise HeadExportError(Finding("train.export-lacks-keys", architecture=self.architecture, keys=missing))
        if d.get("conv_kernel_size") or d.get("conv_group_size"):
            raise HeadExportError(Finding("train.lilicorr-convolutions"))
        cast = {"lilicorr_mlp_ratio": float, "lilicorr_vector_eps": float, "lilicorr_logit_scale": float}
        return {key: cast.get(key, int)(d[key]) for key in KEYS}

    def describe(self, config: DrafterConfig, shape: str) -> str:
        c = config
        width = c.lilicorr_hidden_size or c.hidden_size
        return (f"LiLiCorr ({shape}; correlator over top-{c.lilicorr_candidate_topk} candidates, "
                f"{c.lilicorr_num_layers} layers of width {width}), exported as LiLiCorrDraftModel")

    def warm_start_note(self) -> str:
        return "at their fresh start (the correlator random, its attention biases 0)"


class LatticeWalk:
    """LiLiCorr's drafts from a block's states: the candidates (top-K of the full log-softmax), the
    correlator's scores, the walk from the anchor (greedy at T = 0, sampled at T > 0; `q` is the last
    block's draft distribution over its candidates). `bind(context)` gives it the decoder's draft
    context, whose last valid fused state is the anchor (without one the anchor counts as absent,
    as the engines score a request without one)."""

    def __init__(self, drafter: DFlashDrafter, temperature: float, seed: int) -> None:
        import torch

        self.drafter, self.temperature, self.context = drafter, temperature, None
        self.generator: torch.Generator | None = None
        self.q: torch.Tensor | None = None
        if temperature > 0:
            self.generator = torch.Generator(device=drafter.embed_weight.device).manual_seed(seed + 1)

    def bind(self, context: Any) -> None:
        self.context = context

    def anchor(self, batch: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        found = None if self.context is None else self.context.anchor_context()
        if found is None:
            return like.new_zeros(batch, like.shape[-1]), torch.zeros(batch, dtype=torch.bool, device=like.device)
        return found

    def __call__(self, states: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        # the same chain walks as DFlash2's selector; sampled over float32 scores, no log-prob prior
        # added (SGLang's `lilicorr_sample_path`)
        from dflash.train.heads.dflash2.modules import walk_greedy, walk_sampled
        from dflash.train.heads.lilicorr.lattice import candidates

        d = self.drafter
        head: LiLiCorrHead = d.lilicorr
        ids, log_probs = candidates(d.logits(states), head.candidate_topk)
        context, valid = self.anchor(states.shape[0], states)
        scores = head(d.embed(ids), log_probs, states, context.to(states.dtype), valid)
        if self.temperature == 0:
            return walk_greedy(ids, scores)
        drafts, self.q = walk_sampled(ids, scores.float(), self.temperature, self.generator)
        return drafts


HEAD = LiLiCorrDraftHead()
