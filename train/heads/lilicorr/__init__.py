"""LiLiCorr: the DFlash backbone plus a candidate-lattice correlator (`LiLiCorrDraftModel`): per
drafted slot the top-K candidates of the target head, attention over the whole block's candidates,
and a walk from the anchor over learned candidate-to-candidate scores (the module and its
arithmetic: lattice.py; the engines' contract: docs/drafter.md, "LiLiCorr").

No released trainer trains it: the loss here is ours, derived from the decode rule (the walk's
cross-entropy along the true path, lattice.path_loss). Importing this module imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dflash.train.heads.base import (
    DFlashDrafter,
    DrafterConfig,
    DraftHead,
    HeadInputs,
    HeadMemory,
    HeadOutput,
    ObjectiveConfig,
)

if TYPE_CHECKING:
    import torch
    from dflash.train.heads.lilicorr.lattice import LiLiCorrHead
    from torch import nn

# dflash_config keys -> DrafterSettings fields (SGLang's parse_lilicorr_draft_config requires every one)
KEYS = {
    "lilicorr_candidate_topk": "lilicorr_candidate_topk",
    "lilicorr_hidden_size": "lilicorr_hidden_size",
    "lilicorr_num_layers": "lilicorr_num_layers",
    "lilicorr_num_heads": "lilicorr_num_heads",
    "lilicorr_mlp_ratio": "lilicorr_mlp_ratio",
    "lilicorr_factor_dim": "lilicorr_factor_dim",
    "lilicorr_vector_eps": "lilicorr_vector_eps",
    "lilicorr_logit_scale": "lilicorr_logit_scale",
}
MAX_TOPK = 16  # SGLang's MAX_FUSED_CANDIDATE_TOPK and vLLM's LiLiCorrHead check: a power of two up to 16


class LiLiCorrDraftHead(DraftHead):
    name = "lilicorr"
    title = "LiLiCorr"
    architecture = "LiLiCorrDraftModel"  # vLLM 0.34.0 registry.py; SGLang 0.5.23 srt/models/lilicorr.py EntryClass
    setting_names = tuple(KEYS.values())
    module_name = "lilicorr"  # the engines' tensor prefix
    picks_drafts = True
    warm_starts_from = ("dflash",)
    # vLLM 0.34 detects the speculator from the architecture (LiLiCorrSpeculatorConfig); SGLang 0.5.23
    # serves it under DFLASH (its DFlash worker builds the model class the architecture names)
    serving = {"name": "LiLiCorr", "vllm_method": None, "sglang_algorithm": "DFLASH", "tags": ["dflash", "lilicorr"]}

    def check(self, config: DrafterConfig) -> None:
        c = config
        k = c.lilicorr_candidate_topk
        if not 1 <= k <= min(MAX_TOPK, c.vocab_size) or k & (k - 1):
            raise ValueError(f"lilicorr_candidate_topk ({k}) must be a power of two up to {MAX_TOPK} (vLLM and "
                             "SGLang refuse others): pass --lilicorr-candidate-topk 8.")
        width = c.lilicorr_hidden_size or c.hidden_size
        if c.lilicorr_hidden_size < 0 or c.lilicorr_num_heads < 1 or width % c.lilicorr_num_heads:
            raise ValueError(f"lilicorr_num_heads ({c.lilicorr_num_heads}) must divide the correlator's width {width} "
                             "(--lilicorr-hidden-size, 0: the drafter's): pass --lilicorr-num-heads with a divisor.")
        if c.lilicorr_num_layers < 1 or c.lilicorr_factor_dim < 1 or int(width * c.lilicorr_mlp_ratio) < 1:
            raise ValueError("--lilicorr-num-layers, --lilicorr-factor-dim and --lilicorr-mlp-ratio must be positive "
                             f"(got {c.lilicorr_num_layers}, {c.lilicorr_factor_dim}, {c.lilicorr_mlp_ratio}).")
        if not (c.lilicorr_vector_eps > 0 and c.lilicorr_logit_scale > 0):
            raise ValueError(f"--lilicorr-vector-eps ({c.lilicorr_vector_eps}) and --lilicorr-logit-scale "
                             f"({c.lilicorr_logit_scale}) must be positive.")

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
        return {"lilicorr_enabled": True, **{key: getattr(config, name) for key, name in KEYS.items()}}

    def settings_from_export(self, dflash_config: dict[str, Any]) -> dict[str, Any]:
        d = dflash_config
        if d.get("lilicorr_enabled") is False:
            raise ValueError("this LiLiCorrDraftModel export has lilicorr_enabled false: vLLM refuses it and SGLang "
                             "builds no correlator; export it again with lilicorr_enabled true.")
        missing = [key for key in KEYS if key not in d]
        if missing:
            raise ValueError(f"a LiLiCorrDraftModel export's dflash_config lacks {', '.join(missing)}: SGLang refuses "
                             "it (no defaults); export it again with dflash-train export.")
        if d.get("conv_kernel_size") or d.get("conv_group_size"):
            raise ValueError("a LiLiCorr export with convolutions (conv_kernel_size) is not supported by this trainer: "
                             "its backbone is the plain DFlash one.")
        cast = {"lilicorr_mlp_ratio": float, "lilicorr_vector_eps": float, "lilicorr_logit_scale": float}
        return {name: cast.get(key, int)(d[key]) for key, name in KEYS.items()}

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
