"""DSpark: the DFlash backbone plus a Markov head, a low-rank transition bias from the token drafted
before each slot added to the slot's logits and sampled left to right, and a confidence head that
predicts each draft's acceptance probability (`Qwen3DSparkModel`; the modules and their arithmetic:
modules.py; the engines' contract: docs/drafter.md, "DSpark").

Importing this module imports no torch (the registry's heads are read by `dflash-train --help`).
"""

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
from dflash.train.heads.limits import first, not_finite, out_of_range

if TYPE_CHECKING:
    from dflash.train.heads.dspark.modules import MarkovWalk
    from torch import nn


@dataclass(kw_only=True)
class DSparkSettings:
    """DSpark's drafter settings; defaults as speculators' DSparkSpeculatorConfig."""

    markov_rank: int = 256
    """dspark: rank r of the Markov head (markov_w1 embeds the previous token to r, markov_w2 maps r
    to a bias on the draft logits)."""
    enable_confidence_head: bool = True
    """dspark: also train the confidence head, each draft's predicted acceptance probability
    (dflash-eval --confidence-threshold stops a block where it falls; SGLang 0.5.23 loads a DSpark
    drafter only with one)."""
    confidence_head_with_markov: bool = True
    """dspark: the confidence head reads the previous token's Markov embedding beside the state."""
    draft_vocab_size: int | None = None
    """dspark: a draft vocabulary smaller than the target's is not supported yet: leave it out (the
    target's vocabulary, what the export records)."""

    def refusal(self) -> Finding | None:
        # the Markov head is what DSpark adds: vLLM and SGLang refuse a DSpark drafter without one
        return Finding("train.markov-rank", value=self.markov_rank) if self.markov_rank < 1 else None


@dataclass(kw_only=True)
class DSparkObjective:
    """The settings of DSpark's loss terms."""

    markov_loss_weight: float = 1.0
    """dspark: weight of the loss of the Markov-biased logits, (1 - w) CE + w KL to the target's
    top-k as the backbone's (w: --soft-label-weight)."""
    markov_tv_weight: float = 0.0
    """dspark: weight of the total-variation distance of the biased logits to the target's top-k
    (speculators' tv loss; 0: off)."""
    confidence_loss_weight: float = 1.0
    """dspark: weight of the confidence head's binary cross-entropy toward each slot's acceptance
    probability (speculators' confidence_head_alpha)."""

    def refusal(self) -> Finding | None:
        names = ("markov_loss_weight", "markov_tv_weight", "confidence_loss_weight")
        return first(not_finite(self, names), *(out_of_range(n, getattr(self, n), "0 or more")
                                                for n in names if getattr(self, n) < 0))


class DSparkHead(DraftHead):
    name = "dspark"
    title = "DSpark"
    architecture = "Qwen3DSparkModel"  # vLLM 0.34.0 registry.py and SGLang 0.5.23 dspark.py's EntryClass
    settings = DSparkSettings
    objective_settings = DSparkObjective
    module_name = "markov_head"  # and confidence_head beside it: the engines' tensor prefixes
    # vLLM's and SGLang's DSpark loaders read these from the config's top level (getattr(config, ...))
    config_key_names = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                        "draft_vocab_size", "sample_from_anchor", "dspark_noise_token_id")
    picks_drafts = True
    warm_starts_from = ("dflash",)
    # vLLM 0.34: method "dspark" (detected from the architecture); SGLang 0.5.23: --speculative-algorithm DSPARK
    serving = {"name": "DSpark", "vllm_method": "dspark", "sglang_algorithm": "DSPARK", "tags": ["dflash", "dspark"]}

    def check(self, config: DrafterConfig) -> None:
        c = config
        if c.draft_vocab_size is not None and c.draft_vocab_size != c.vocab_size:
            # it would need a pruned lm_head and a token map
            raise HeadSettingError(Finding("train.draft-vocab-size", value=c.draft_vocab_size, vocab_size=c.vocab_size))

    def build(self, config: DrafterConfig) -> dict[str, nn.Module | None]:
        from dflash.train.heads.dspark.modules import ConfidenceHead, MarkovHead

        c = config
        confidence = None
        if c.enable_confidence_head:
            confidence = ConfidenceHead(c.hidden_size + (c.markov_rank if c.confidence_head_with_markov else 0))
        return {"markov_head": MarkovHead(c.vocab_size, c.markov_rank), "confidence_head": confidence}

    def initialize(self, drafter: DFlashDrafter, std: float) -> None:
        from dflash.train.heads.dspark.modules import ConfidenceHead, MarkovHead

        for module in drafter.modules():  # the bias and the confidence at 0: a fresh head drafts what DFlash does
            if isinstance(module, (MarkovHead, ConfidenceHead)):
                module.reset_parameters()

    def owns_tensor(self, name: str) -> bool:
        return name.startswith(("markov_head.", "confidence_head."))

    def sharded_units(self, drafter: DFlashDrafter) -> list[nn.Module]:
        # the Markov head is called through embed() and bias(): its embedding and projection are the units
        units = [drafter.markov_head.markov_w1, drafter.markov_head.markov_w2]
        return units + ([drafter.confidence_head] if getattr(drafter, "confidence_head", None) is not None else [])

    def objective(self, inputs: HeadInputs, objective: ObjectiveConfig) -> HeadOutput:
        from dflash.train.heads.dspark.modules import dspark_objective

        loss, logged, choice = dspark_objective(
            inputs, markov_weight=objective.markov_loss_weight, tv_weight=objective.markov_tv_weight,
            confidence_weight=objective.confidence_loss_weight, soft_weight=objective.soft_label_weight or 0.0)
        return HeadOutput(loss=loss, logged=logged, choice=choice)

    def memory(self, config: DrafterConfig) -> HeadMemory:
        c, d, r = config, config.hidden_size, config.markov_rank
        confidence = (d + (r if c.confidence_head_with_markov else 0) + 1) if c.enable_confidence_head else 0
        # rough, not measured: its biased logits are a second full-vocabulary pass (float32 logits, the
        # bias, their sum, the log-softmax and its gradient) a 1 GiB chunk at a time; per slot the
        # Markov embedding and its gradient, the confidence head's input, the slot's loss terms
        return HeadMemory(params=2 * c.vocab_size * r + confidence, own_logit_rows=1, own_logit_bytes=20,
                          own_chunk_mib=1024, slot_bytes=8 * r + 4 * (d + r) + 32)

    def proposer(self, drafter: DFlashDrafter, temperature: float, seed: int) -> MarkovWalk:
        from dflash.train.heads.dspark.modules import MarkovWalk

        return MarkovWalk(drafter, temperature, seed)

    def export_keys(self, config: DrafterConfig) -> dict[str, Any]:
        c = config
        return dict(markov_rank=c.markov_rank, markov_head_type="vanilla",
                    enable_confidence_head=bool(c.enable_confidence_head),
                    confidence_head_with_markov=bool(c.confidence_head_with_markov),
                    # (no draft_vocab_size: both engines then draft over the target's vocabulary)
                    # the anchor is the verified token and slot k predicts the token at anchor + k, as
                    # in DFlash (speculators' sample_from_anchor=False)
                    sample_from_anchor=False, dspark_noise_token_id=c.mask_token_id)

    def settings_from_export(self, dflash_config: dict[str, Any]) -> dict[str, Any]:
        d = dflash_config
        kind = str(d.get("markov_head_type", "vanilla")).lower()
        if kind != "vanilla":
            raise HeadExportError(Finding("train.markov-head-type", value=kind))
        if d.get("sample_from_anchor", True) is not False:
            raise HeadExportError(Finding("train.sample-from-anchor", value=d.get("sample_from_anchor")))
        if "markov_rank" not in d:
            raise HeadExportError(Finding("train.export-lacks-keys", architecture=self.architecture,
                                          keys=["markov_rank"]))
        out: dict[str, Any] = dict(
            markov_rank=int(d["markov_rank"]),
            # absent: vLLM 0.34 builds no confidence head, and none reading the Markov embedding
            enable_confidence_head=bool(d.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(d.get("confidence_head_with_markov", False)))
        if d.get("draft_vocab_size") is not None:
            out["draft_vocab_size"] = int(d["draft_vocab_size"])
        if d.get("mask_token_id") is None and d.get("dspark_noise_token_id") is not None:
            out["mask_token_id"] = int(d["dspark_noise_token_id"])
        return out

    def describe(self, config: DrafterConfig, shape: str) -> str:
        c = config
        confidence = ("a confidence head" + (" on the state and the Markov embedding" if c.confidence_head_with_markov
                                             else " on the state")) if c.enable_confidence_head else "no confidence head"
        return (f"DSpark ({shape}; Markov head of rank {c.markov_rank}, {confidence}), exported as Qwen3DSparkModel; "
                "--drafter-type dflash trains plain DFlash (DFlashDraftModel)")

    def warm_start_note(self) -> str:
        return "the Markov bias and the confidence at 0"


HEAD = DSparkHead()
