"""--init-drafter: a run starts from an exported drafter's weights instead of a random init."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from dflash.cache_tools.identity import comparable, target_identity
from dflash.runtime.errors import DflashError, InputError
from dflash.runtime.findings import Finding, emit
from dflash.train.exports.drafter_layouts import read_drafter
from dflash.train.exports.export import trained_target, training_target_change
from dflash.train.heads import get_head
from dflash.train.model.drafter import DFlashDrafter
from dflash.train.model.target_weights import load_target_config

_WARM_START_FIELDS = {"num_hidden_layers": "--num-draft-layers", "target_layer_ids": "the cache's target layers",
                      "mask_token_id": "--mask-token-id", "drafter_type": "--drafter-type"}
"""What an --init-drafter drafter must share with the run's drafter beyond its tensors' shapes
(the block size need not: the backbone's weights do not depend on it)."""
_TARGET_FIELDS = {"hidden_size": "hidden_size", "vocab_size": "vocab_size", "num_target_layers": "num_hidden_layers"}
"""The drafter's fields that are the target's (drafter field -> the target config's)."""


def warm_start(drafter: DFlashDrafter, init_dir: str, target_model: str,
               announce: Callable[[str], None] | None = None, *, resume_from: Path | None = None) -> None:
    """Load a drafter's weights into the freshly built `drafter` (--init-drafter), read in any
    layout `drafter_layouts` knows (this trainer's exports, z-lab / vLLM / SGLang, speculators,
    SpecForge, ModelOpt). It must be a drafter of this run's target (hidden size, vocabulary,
    number of layers) reading what this run reads (target layers, mask token) with this run's
    draft layers; its block size may differ (its head's tensors of the block's shape then start
    fresh), and a head may start from a drafter of a head it names (`DraftHead.warm_starts_from`:
    DFlash2 from DFlash): the backbone's tensors come from it, the head's own keep their fresh
    start (DFlash2's convolutions the identity, its selector's edges 0), so the run starts from
    exactly that drafter's predictions. An export that records another target than this run's
    (its `dflash_training`) still loads, as a start from a related run, with a note naming both
    targets. A run that resumes (`resume_from`, its latest checkpoint) takes the checkpoint's
    weights: the drafter is not loaded, and a note says so. Notes are findings (`emit`), written
    through `announce` (the run's log) when it is given."""
    if resume_from is not None:
        if announce is not None:
            _note(announce, Finding("train.init-drafter-on-resume", init=init_dir, checkpoint=str(resume_from)))
        return
    target_config = load_target_config(target_model)
    try:
        read = read_drafter(init_dir, target_config)
    except FileNotFoundError as e:
        raise InputError(Finding("train.init-drafter-missing", init=init_dir, cause=_cause(e))) from e
    except ValueError as e:
        raise InputError(Finding("train.init-drafter-unreadable", init=init_dir, cause=_cause(e))) from e
    theirs, state = read.config, read.state
    head = drafter.head  # a head may start from another's drafter: its own tensors keep their fresh start
    upgrade = theirs.drafter_type != drafter.config.drafter_type and theirs.drafter_type in head.warm_starts_from
    target = [(f, getattr(theirs, f), getattr(target_config, t))
              for f, t in _TARGET_FIELDS.items() if getattr(theirs, f) != getattr(target_config, t)]
    settings = [
        (flag, _listed(getattr(drafter.config, f)), _listed(getattr(theirs, f)))
        for f, flag in _WARM_START_FIELDS.items()
        if getattr(theirs, f) is not None and _listed(getattr(theirs, f)) != _listed(getattr(drafter.config, f))
        and not (upgrade and f == "drafter_type")]
    own = drafter.state_dict()
    owned = {k for k in own if head.owns_tensor(k)}
    # a block size of its own: the head's tensors of the block's shape (and so all the head's) start fresh
    reblocked = theirs.block_size != drafter.config.block_size and not upgrade and any(
        k in state and state[k].shape != own[k].shape for k in owned)
    fresh = owned if upgrade or reblocked else set()
    state = {k: v for k, v in state.items() if k not in fresh}
    trainable = {k for k, p in drafter.named_parameters() if p.requires_grad}
    wanted = {k for k in own if k not in state and k not in fresh} & trainable
    unexpected = sorted(set(state) - set(own))
    shapes = [(k, tuple(state[k].shape), tuple(own[k].shape)) for k in sorted(set(state) & set(own))
              if state[k].shape != own[k].shape]
    if target:  # every tensor would differ too: the fields say why
        wanted, unexpected, shapes = set(), [], []
    if target or settings or wanted or unexpected or shapes:
        raise InputError(Finding("train.init-drafter-misfit", init=init_dir, layout=read.layout.title,
                                 target_model=target_model, target=target, settings=settings, shapes=shapes[:4],
                                 missing=sorted(wanted)[:4], unexpected=unexpected[:4]))
    with torch.no_grad():
        drafter.load_state_dict(state, strict=False)
    if announce is not None:
        said = [f"warm start: the drafter's {len(state)} weight tensors from {init_dir}"
                + ("" if read.layout.name == "export" else f" in {read.layout.title}")]
        if theirs.block_size != drafter.config.block_size:
            said.append(f"; block {theirs.block_size} -> {drafter.config.block_size}")
        if upgrade:
            said.append(f", a {get_head(theirs.drafter_type).title} drafter")
        if fresh:
            said.append(f": {head.title}'s {len(fresh)} tensors of its own start as they do in a fresh run "
                        f"({head.warm_start_note()}), " + ("so training starts from that drafter's predictions"
                                                          if upgrade else "as some are of the block's shape"))
        if read.dropped:
            said.append(f" (its copy of the target's {', '.join(read.dropped)} is not read)")
        announce("".join(said))
        if not trained_target(init_dir):
            _note(announce, Finding("train.init-drafter-target-unrecorded", init=init_dir))
        if finding := other_target_finding(init_dir, target_model):
            _note(announce, finding)


def other_target_finding(init_dir: str, target_model: str) -> Finding | None:
    """`train.init-other-target` when the --init-drafter export records that it was trained
    against another target than this run's (its weights fit, so it loads: a warm start from a
    related run)."""
    change = training_target_change(init_dir, comparable(target_identity(load_target_config(target_model),
                                                                         target_model)))
    if change is None:
        return None
    trained_at, differences = change
    return Finding("train.init-other-target", init=init_dir, trained=trained_at,
                   here=str(Path(target_model).resolve()), differences=differences)


def _cause(e: Exception) -> Finding | str:
    """What a reader found, as the finding it raised (else its text: a library's error)."""
    return e.finding if isinstance(e, DflashError) and e.finding is not None else str(e)


class _Lines:
    """A text stream whose lines go to `announce` (the run's log: rank 0's console)."""

    def __init__(self, announce: Callable[[str], None]):
        self.announce, self.pending = announce, ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            self.announce(line)
        return len(text)

    def flush(self) -> None:
        pass


def _note(announce: Callable[[str], None], finding: Finding) -> None:
    emit(finding, stream=_Lines(announce))  # type: ignore[arg-type]


def _listed(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


