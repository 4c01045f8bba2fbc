"""DFlash2: in-block convolutions around every sublayer and a candidate selector over the target
head's top-K (`DFlash2DraftModel`; the modules and their arithmetic: train/heads/dflash2/modules.py)."""

from __future__ import annotations

from dataclasses import dataclass
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
    from torch import nn


@dataclass(kw_only=True)
class DFlash2Settings:
    """DFlash2's drafter settings (flags and config keys of dflash-train, recorded in the drafter's
    DrafterConfig, its run identity and its export)."""

    selector_top_k: int = 16
    """dflash2: candidates per slot, the target head's top-K."""
    selector_rank: int = 256
    """dflash2: rank of the selector's codebooks and hidden projection."""
    # vLLM requires conv_kernel_size in the checkpoint (no default of its own); the shipped DFlash2
    # checkpoints and the peers' trainers use two taps.
    conv_kernel_size: int = 2
    """dflash2: taps of the in-block convolutions."""
    conv_group_size: int = 16
    """dflash2: channels sharing one dynamic tap offset (must divide the target's hidden size)."""

    def refusal(self) -> Finding | None:
        return below(self, ("selector_top_k", "selector_rank", "conv_kernel_size", "conv_group_size"), 1)


@dataclass(kw_only=True)
class DFlash2Objective:
    """The settings of DFlash2's selector loss (flags and config keys of dflash-train)."""

    selector_loss_weight: float = 1.0
    """dflash2: weight (alpha) of the candidate selector's K-way cross-entropy in the loss."""
    selector_stop_gradient: bool = False
    """dflash2: the selector's loss does not reach the backbone (its states and logits enter detached)."""

    def refusal(self) -> Finding | None:
        return first(not_finite(self, ("selector_loss_weight",)),
                     out_of_range("selector_loss_weight", self.selector_loss_weight, "0 or more")
                     if self.selector_loss_weight < 0 else None)


class DFlash2Head(DraftHead):
    name = "dflash2"
    title = "DFlash2"
    architecture = "DFlash2DraftModel"
    settings = DFlash2Settings
    objective_settings = DFlash2Objective
    module_name = "candidate_selector"
    wrapper_names = {"attention": "attention_conv", "mlp": "mlp_conv"}
    picks_drafts = True
    default_hard_label = "target"  # on the BPE benchmark at 4,096 completions +5.0 % tau on code, level on prose
    warm_starts_from = ("dflash",)
    # vLLM 0.34 detects the speculator from the architecture; SGLang 0.5.23 serves it under DFLASH
    serving = {"name": "DFlash2", "vllm_method": None, "sglang_algorithm": "DFLASH", "tags": ["dflash", "dflash2"]}

    def check(self, config: DrafterConfig) -> None:
        c = config  # (each setting at least 1: DFlash2Settings)
        if c.hidden_size % c.conv_group_size:
            fits = max(d for d in range(1, c.conv_group_size + 1) if c.hidden_size % d == 0)
            raise HeadSettingError(Finding("train.conv-group-size", value=c.conv_group_size, hidden_size=c.hidden_size,
                                           fits=fits))
        if c.selector_top_k > c.vocab_size:
            raise HeadSettingError(Finding("train.selector-top-k", value=c.selector_top_k, vocab_size=c.vocab_size))

    def wrap_sublayer(self, config: DrafterConfig, sublayer: str) -> nn.Module:
        from dflash.train.heads.dflash2.modules import GroupedDynamicConv

        return GroupedDynamicConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)

    def build(self, config: DrafterConfig) -> nn.Module:
        from dflash.train.heads.dflash2.modules import CandidateSelector

        return CandidateSelector(config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k)

    def initialize(self, drafter: DFlashDrafter, std: float) -> None:
        from dflash.train.heads.dflash2.modules import CandidateSelector, GroupedDynamicConv

        for module in drafter.modules():  # the convolutions at the identity, the selector's edges at 0
            if isinstance(module, (GroupedDynamicConv, CandidateSelector)):
                module.reset_parameters(std)

    def candidates(self, config: DrafterConfig) -> int:
        return config.selector_top_k

    def objective(self, inputs: HeadInputs, objective: ObjectiveConfig) -> HeadOutput:
        from dflash.train.heads.dflash2.modules import selector_objective

        c = inputs.drafter.config
        loss, choice = selector_objective(
            inputs.drafter.candidate_selector, inputs.states, None, inputs.predecessors, inputs.labels,
            inputs.weights.detach(), output_multiplier=c.output_multiplier, softcap=c.final_logit_softcapping,
            stop_gradient=objective.selector_stop_gradient, top_ids=inputs.top_ids,
            gather_logits=inputs.gather_logits,
            head_weight=inputs.drafter.lm_head_weight if inputs.compiled else None)
        return HeadOutput(loss=objective.selector_loss_weight * loss, logged=loss.detach(), choice=choice)

    def memory(self, config: DrafterConfig) -> HeadMemory:
        c, d, k = config, config.hidden_size, config.conv_kernel_size
        # two convolutions a layer (their taps' projection and the offsets), the selector's two codebooks
        # and its hidden projection; measured (tests/test_train_memory.py): the convolutions keep 4 bytes
        # a block token, layer and channel (the bf16 input of each output convolution; the input
        # convolution's is the projection's own); the selector's K + 1 candidate logits per slot come from their rows
        # of the head, gathered one chunk of slots at a time (head_loss.candidate_logits): float32
        # logits and their gradient per slot
        conv = 2 * k * (d // c.conv_group_size) * d + 2 * k * d
        params = c.num_hidden_layers * 2 * conv + 2 * c.vocab_size * c.selector_rank + d * c.selector_rank
        return HeadMemory(params=params, layer_block_bytes=4 * d, slot_bytes=8 * (c.selector_top_k + 1))

    def proposer(self, drafter: DFlashDrafter, temperature: float, seed: int) -> SelectorWalk:
        return SelectorWalk(drafter, temperature, seed)

    def export_keys(self, config: DrafterConfig) -> dict[str, Any]:
        return dict(conv_kernel_size=config.conv_kernel_size, conv_group_size=config.conv_group_size,
                    selector_rank=config.selector_rank, selector_top_k=config.selector_top_k,
                    input_embedding_scale=1.0, output_multiplier=config.output_multiplier,
                    final_logit_softcapping=config.final_logit_softcapping)

    def settings_from_export(self, dflash_config: dict[str, Any]) -> dict[str, Any]:
        d = dflash_config
        embedding_scale = float(d.get("input_embedding_scale", 1.0))
        if embedding_scale != 1.0:
            raise HeadExportError(Finding("train.input-embedding-scale", value=embedding_scale))
        return dict(conv_kernel_size=int(d["conv_kernel_size"]), conv_group_size=int(d["conv_group_size"]),
                    selector_rank=int(d["selector_rank"]), selector_top_k=int(d["selector_top_k"]),
                    output_multiplier=float(d.get("output_multiplier", 1.0)),
                    final_logit_softcapping=d.get("final_logit_softcapping") or None)

    def describe(self, config: DrafterConfig, shape: str) -> str:
        c = config
        return (f"DFlash2 ({shape}), exported as DFlash2DraftModel\n  its head: convolutions of "
                f"{c.conv_kernel_size} taps, group {c.conv_group_size}; selector top-{c.selector_top_k}, rank {c.selector_rank}")

    def warm_start_note(self) -> str:
        return "the convolutions at the identity, the selector's edges at 0"


class SelectorWalk:
    """DFlash2's drafts from a block's states: the candidate selector's path from the anchor,
    greedy at T = 0, sampled at T > 0 (`q`, the last block's draft distribution over its
    candidates, is kept for a verifier that rejection-samples; eval's loop checks each draft
    against the target's own choice, which is lossless for any draft)."""

    def __init__(self, drafter: DFlashDrafter, temperature: float, seed: int) -> None:
        import torch

        self.drafter, self.temperature = drafter, temperature
        self.generator: torch.Generator | None = None
        self.q: torch.Tensor | None = None
        if temperature > 0:
            device = drafter.embed_weight.device
            self.generator = torch.Generator(device=device).manual_seed(seed + 1)  # not the target's draws

    def __call__(self, states: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        from dflash.train.heads.dflash2.modules import block_lattice, walk_greedy, walk_sampled

        d, c = self.drafter, self.drafter.config
        ids, scores = block_lattice(d.candidate_selector, states, d.logits(states), anchors,
                                    c.output_multiplier, c.final_logit_softcapping)
        if self.temperature == 0:
            return walk_greedy(ids, scores)
        drafts, self.q = walk_sampled(ids, scores, self.temperature, self.generator)
        return drafts


HEAD = DFlash2Head()
