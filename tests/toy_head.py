"""A drafter head declared outside the package (tests/test_heads.py registers it): a residual
linear map on the backbone's states, started at zero, with a cross-entropy of its own; it drafts
the argmax of the target head over the corrected states. What docs/drafter.md, "Adding a head",
describes, in the fewest lines."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.nn.functional as F
from dflash.train.heads.base import DraftHead, HeadInputs, HeadOutput
from torch import nn


class ToyHead(DraftHead):
    name = "toy"
    title = "Toy"
    architecture = "ToyDraftModel"
    module_name = "toy_residual"
    picks_drafts = True
    warm_starts_from = ("dflash",)
    serving = {"name": "Toy", "vllm_method": None, "sglang_algorithm": "DFLASH", "tags": ["dflash", "toy"]}

    def __init__(self) -> None:
        self.stop_at_call = 0  # >0: send this process SIGINT from that call of the objective (a stop mid-run)
        self.calls = 0

    def build(self, config: Any) -> nn.Module:
        return nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def initialize(self, drafter: Any, std: float) -> None:
        with torch.no_grad():
            drafter.toy_residual.weight.zero_()  # a fresh toy drafter drafts what DFlash does

    def corrected_logits(self, drafter: Any, states: torch.Tensor) -> torch.Tensor:
        return drafter.logits(states + drafter.toy_residual(states))

    def objective(self, inputs: HeadInputs, objective: Any) -> HeadOutput:
        self.calls += 1
        if self.stop_at_call and self.calls == self.stop_at_call:
            os.kill(os.getpid(), signal.SIGINT)  # the run finishes this step, checkpoints and stops
        logits = self.corrected_logits(inputs.drafter, inputs.states).float()
        ce = F.cross_entropy(logits, inputs.labels, reduction="none")
        weights = inputs.weights.detach()
        loss = (weights * ce).sum() / weights.sum().clamp(min=1e-12)
        return HeadOutput(loss=0.5 * loss, logged=loss.detach(), choice=logits.argmax(-1))

    def proposer(self, drafter: Any, temperature: float, seed: int):
        return lambda states, anchors: self.corrected_logits(drafter, states).argmax(-1)

    def export_keys(self, config: Any) -> dict[str, Any]:
        return {"toy_residual": True}

    def settings_from_export(self, dflash_config: dict[str, Any]) -> dict[str, Any]:
        if not dflash_config.get("toy_residual"):
            raise ValueError("a ToyDraftModel export records toy_residual: true in its dflash_config.")
        return {}


HEAD = ToyHead()
