"""`dflash-train estimate`: the trainer's held-out estimate of an exported drafter, on any cache.

It runs the evaluation a training run runs at its evaluations (`evaluation.evaluate`: the walk of
docs/train.md, "Estimator") over every sample of the given cache(s), for a drafter directory
that `dflash-train export` (or a run's final/) wrote. Given a cache of the target's greedy
completions of exactly the prompts dflash-eval decodes, it is the estimate of that decoding
without the sampling noise of a different held-out prompt set (per-prompt tau varies a lot).
The command line is in cli.py; this module, and torch, load only when the command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash.cache_tools.errors import ConfigMismatchError
from dflash.runtime.devices import resolve_device
from dflash.runtime.errors import DflashError, InputError
from dflash.runtime.findings import Finding
from dflash.train.config import TrainConfig, TrainConfigError
from dflash.train.data.caches import TrainingData, check_cache_target, open_training_data
from dflash.train.exports.export import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    load_drafter,
    training_target_finding,
)
from dflash.train.measure.evaluation import LossModel, evaluate
from dflash.train.run.distributed import DistInfo
from dflash.train.run.loop import autocast_context, load_target_config_or_fail


def estimate_config(drafter_dir: str, settings: dict[str, Any]) -> TrainConfig:
    """The run settings the evaluation reads: every sample of --cache is the held-out set."""
    caches = list(settings.get("cache") or [])
    # TrainConfig wants a run directory; an estimate writes nothing, so the drafter's stands in.
    return TrainConfig.from_dict({**settings, "eval_cache": caches, "output_dir": drafter_dir, "eval_max_samples": 0,
                                  "epochs": 1, "progress": False, "tensorboard": False})


def estimate_drafter(drafter_dir: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The held-out evaluation of the drafter in `drafter_dir` over the caches of `settings`
    (cli.ESTIMATE_SETTINGS: TrainConfig fields): tau (the walk at the drafter's block), tau_b{B/2}, tau_blocks,
    estimator, walked_samples, blocks, loss, and the rest `evaluation.evaluate` reports."""
    cfg = estimate_config(drafter_dir, settings)
    path = Path(drafter_dir)
    if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
        raise InputError(Finding("train.estimate-not-export", dir=str(path)))
    target_config = load_target_config_or_fail(cfg.model.target_model)
    device = resolve_device(cfg.runtime.device)
    data = open_training_data(cfg, rank=0, world_size=1, pin_memory=device.type == "cuda", estimate=True)
    try:
        return _evaluate(cfg, data, target_config, device, path)
    finally:
        data.loader.close()


def _evaluate(cfg: TrainConfig, data: TrainingData, target_config: Any, device: Any, path: Path) -> dict[str, Any]:
    manifest = data.caches.manifest
    # (the target's weights differ from the cache's, ...: said, as training and dflash-eval say it)
    notices = list(check_cache_target(manifest, target_config, cfg.model.target_model))
    if finding := training_target_finding(path, target_config, cfg.model.target_model):  # (as dflash-eval says it)
        notices.append(finding)
    # the result is JSON: its notes are the notices' paragraphs, and note_codes their codes, in order
    said = [(n.code, str(n)) for n in notices if n and str(n)]
    notes = [text[0].upper() + text[1:] for _, text in said]
    try:  # float32 weights: the trainer's master weights (--dtype bf16 is autocast over them, as in training)
        drafter = load_drafter(path, cfg.model.target_model, attention_backend=cfg.model.attention_backend)
    except (OSError, ValueError) as e:
        cause = e.finding if isinstance(e, DflashError) and e.finding is not None else str(e)
        raise InputError(Finding("train.estimate-load", drafter=str(path), target=cfg.model.target_model,
                                 cause=cause)) from e
    if list(drafter.config.target_layer_ids) != list(manifest.target_layer_ids):
        raise ConfigMismatchError(Finding("train.estimate-layers", drafter=str(path),
                                          layers=list(drafter.config.target_layer_ids), cache=str(manifest.cache_dir),
                                          cache_layers=list(manifest.target_layer_ids)))
    drafter = drafter.to(device)
    info = DistInfo(device=device)
    result = evaluate(LossModel(drafter, drafter), data, cfg.objective, autocast_context(cfg.runtime.dtype, device),
                      cfg, info)
    if result is None:
        raise TrainConfigError(Finding("train.estimate-no-samples", caches=list(cfg.data.cache)))
    # A cache used whole needs the target's top-1 for every sample (--top1-share 1): the others are
    # checked against their own tokens, as without top-1 (format_estimate says how many).
    return {"drafter": str(path), "cache": list(cfg.data.cache), "block_size": drafter.config.block_size,
            "samples": len(data.eval_indices), "without_top1": data.eval_without_top1, **result,
            **({"notes": notes, "note_codes": [code for code, _ in said]} if notes else {})}


def format_estimate(result: dict[str, Any]) -> str:
    """The result as one line."""
    block = result["block_size"]
    smaller = "".join(f", {k} {v:.3f}" for k, v in result.items() if k.startswith("tau_b") and k[5:].isdigit())
    if "tau_backbone" in result:  # DFlash2: tau is the selector path's
        smaller += f", backbone tau {result['tau_backbone']:.3f}"
    if result.get("tau_per_sample_mean"):
        smaller += f", per-sample mean {result['tau_per_sample_mean']:.3f}"
    if result.get("tau_lookup"):
        smaller += f", prompt lookup {result['tau_lookup']:.3f} on the same samples ({result['tau'] / result['tau_lookup']:.2f}x)"
    if result.get("confidence_heldout"):
        smaller += f", the target's mean top-1 probability {result['confidence_heldout']:.3f}"
    span = result.get("tau_interval") or []
    interval = f" [95 %: {span[0]:.3f}-{span[1]:.3f} over the samples]" if len(span) == 2 else ""
    return (f"tau {result['tau']:.3f}{interval} ({result['estimator']}, block {block}){smaller}, tau_blocks "
            f"{result['tau_blocks']:.3f}; {int(result['walked_samples'])} of {result['samples']} samples walked, "
            f"{int(result['blocks'])} blocks, loss {result['loss']:.4f}"
            + (f"; warning: {result['without_top1']} of the samples have no target top-1 in the cache (extracted "
               "with a --top1-share below 1, with --no-store-top1 or before it was stored), so their drafts are checked against their own tokens: extract the "
               "cache with --top1-share 1 for the greedy walk of every sample" if result.get("without_top1") else "")
            + "".join(f"\nNote: {note}" for note in result.get("notes", [])))
