"""DFlash: the backbone alone, drafting each slot's argmax (`DFlashDraftModel`)."""

from __future__ import annotations

from typing import Any

from dflash.train.heads.base import DraftHead


class DFlashHead(DraftHead):
    name = "dflash"
    title = "DFlash"
    architecture = "DFlashDraftModel"
    serving = {"name": "DFlash", "vllm_method": "dflash", "sglang_algorithm": "DFLASH", "tags": ["dflash"]}

    def identity(self, config: Any) -> dict[str, Any]:
        return {}  # as run identities recorded it before other heads: a checkpoint of then resumes


HEAD = DFlashHead()
