"""`dflash-eval`'s measurement: a drafter by real speculative decoding against its target.

For every prompt set it runs target-only decoding and speculative decoding on the same
prompts in the same process, and reports the acceptance length tau, its histogram,
tokens/s of both, the speedup, and (greedy) whether the outputs are identical. Beside the
drafter it runs prompt lookup (`lookup.py`, n-gram drafting without training) under the same
verification, so a user sees at once whether the drafter beats the free baseline. The command
line is `cli.py` (it loads this module, and torch, only when it runs).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dflash.runtime.devices import resolve_device, resolve_dtype_name, torch_dtype
from dflash.runtime.errors import InputError, MismatchError, SettingError
from dflash.runtime.findings import Finding, emit
from dflash.runtime.intervals import (
    INTERVAL_RESAMPLES,
    bootstrap_draw,
    percentile_interval,
    resampled_tau,
)
from dflash.runtime.positions import TargetPositions, target_positions
from dflash.runtime.records import NotJson, completion_start, iter_lines, read_json
from dflash.runtime.safetensors_files import (
    check_weight_dir,
    refuse_drafter_as_target,
    refuse_incomplete_weights,
)
from dflash.runtime.signals import stop_if_signalled
from dflash.train.heads import get_head, head_names

from .config import EvalConfig, EvalError
from .lookup import lookup_generate
from .speculative import (
    DecodeConfig,
    Generation,
    NoConfidenceError,
    acceptance_summary,
    first_divergence,
    speculative_generate,
    target_generate,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


# -- inputs -----------------------------------------------------------------------------------


def prompt_from_record(record: dict[str, Any], where: str, tokenizer: Any = None) -> list[int]:
    """The prompt token ids of one JSONL record.

    `prompt_ids` is taken as is. `input_ids` is cut where the completion starts when the
    record says so (the first 1 of `loss_mask`, the first label that is not -100, or
    `prompt_len`, read as extraction reads them: runtime/records.py), so a held-out file of
    extraction input can be used directly; otherwise all of it
    is the prompt. `text` is tokenized with the target's tokenizer when there are no ids.
    """
    if "prompt_ids" in record:
        ids = record["prompt_ids"]
    elif "input_ids" in record:
        ids = record["input_ids"]
        cut = completion_start(record)
        if cut is not None:
            ids = ids[:cut]
    elif "text" in record:
        if tokenizer is None:
            raise InputError(Finding("eval.prompt-text-without-tokenizer", where=where))
        ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
    else:
        raise InputError(Finding("eval.prompt-missing", where=where))
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InputError(Finding("eval.prompt-not-int-list", where=where))
    if not ids:
        raise InputError(Finding("eval.prompt-empty", where=where))
    return ids


def load_prompts(
    path: str | Path, vocab_size: int, *, tokenizer: Any = None, max_prompts: int | None = None,
    positions: TargetPositions | None = None, max_new_tokens: int = 0, block_size: int = 0,
) -> list[list[int]]:
    """Prompts of a JSONL file (one record a line, blank lines skipped); ids checked against the vocab,
    and each prompt with the tokens its decoding adds (`max_new_tokens`, and a verify block of
    `block_size` past them) against the target's `positions`."""
    path = Path(path)
    if not path.is_file():
        raise InputError(Finding("eval.prompt-file-missing", file=str(path)))
    prompts: list[list[int]] = []
    for where, line in iter_lines([path]):
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
        try:
            record = read_json(line)
        except NotJson as e:
            raise InputError(Finding("eval.prompt-not-json", where=where, error=e.detail)) from None
        if not isinstance(record, dict):
            raise InputError(Finding("eval.prompt-not-object", where=where, type=type(record).__name__))
        ids = prompt_from_record(record, where, tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InputError(Finding("eval.prompt-out-of-vocab", where=where, tokens=bad[:5], vocab_size=vocab_size))
        if positions is not None and len(ids) + max_new_tokens + block_size > positions.limit:
            raise InputError(Finding("eval.prompt-past-positions", where=where, prompt_len=len(ids),
                                     positions=positions.describe(), limit=positions.limit,
                                     max_new_tokens=max_new_tokens, block_size=block_size))
        prompts.append(ids)
    if not prompts:
        raise InputError(Finding("eval.prompt-file-empty", file=str(path)))
    return prompts


# -- the measurement --------------------------------------------------------------------------


@dataclass(kw_only=True)
class EvalSettings:
    """How the measurement runs (a subset of the flags)."""

    batch_size: int = 1
    """Prompts decoded together (left-padded)."""
    device: str = "cpu"
    """Torch device of the target and the drafter."""
    baseline: bool = True
    """Also run prompt lookup (the free baseline) under the same verification."""
    lookup_ngram: int = 4
    """Longest n-gram prompt lookup matches (it falls back to shorter ones)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_batches(decode: Any, prompts: list[list[int]], config: DecodeConfig, batch_size: int,
                   device: torch.device) -> tuple[list[Generation], float]:
    """`decode(batch, config)` over `prompts` in batches: the generations and the wall time."""
    out: list[Generation] = []
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        stop_if_signalled()  # a Ctrl-C whose stop a finalizer swallowed ends it here
        out.extend(decode(prompts[i : i + batch_size], config))
    _sync(device)
    return out, time.perf_counter() - start


def evaluate_prompt_set(
    model: Any, drafter: Any, prompts: list[list[int]], config: DecodeConfig, settings: EvalSettings
) -> dict[str, Any]:
    """Target-only and speculative decoding of `prompts` (and prompt lookup, the baseline, unless
    `settings.baseline` is off); tau, speed and the lossless check of each."""
    device = torch.device(settings.device)
    decoders = {"speculative": lambda batch, cfg: speculative_generate(
        model, drafter, batch, replace(cfg, confidence_threshold=None))}  # the whole block
    if config.confidence_threshold is not None:  # and the drafts the head is sure enough of
        decoders["confidence_stop"] = lambda batch, cfg: speculative_generate(model, drafter, batch, cfg)
    if settings.baseline:
        decoders["prompt_lookup"] = lambda batch, cfg: lookup_generate(model, batch, cfg, max_ngram=settings.lookup_ngram)
    # Warm up every path (kernels, allocator) so that no timing pays for it.
    warm = DecodeConfig(**{**asdict(config), "max_new_tokens": min(4, config.max_new_tokens)})
    target_generate(model, prompts[:1], warm)
    for decode in decoders.values():
        decode(prompts[:1], warm)

    baseline, target_seconds = _timed_batches(
        lambda batch, cfg: target_generate(model, batch, cfg), prompts, config, settings.batch_size, device)
    target_tps = sum(len(g.tokens) for g in baseline) / max(target_seconds, 1e-9)
    runs = {}
    for name, decode in decoders.items():
        gens, seconds = _timed_batches(decode, prompts, config, settings.batch_size, device)
        tps = sum(len(g.tokens) for g in gens) / max(seconds, 1e-9)
        runs[name] = {"gens": gens, "seconds": seconds, "tokens_per_second": tps}

    spec = runs["speculative"]
    report: dict[str, Any] = {
        "num_prompts": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "new_tokens": sum(len(g.tokens) for g in spec["gens"]),
        **acceptance_summary(spec["gens"]),
        "tau_per_prompt_mean": per_prompt_mean(spec["gens"]),
        "per_prompt": per_prompt(prompts, spec["gens"]),
        "speculative": {"seconds": spec["seconds"], "tokens_per_second": spec["tokens_per_second"]},
        "target_only": {"seconds": target_seconds, "tokens_per_second": target_tps},
        "speedup": spec["tokens_per_second"] / max(target_tps, 1e-9),
        "lossless": lossless_check(baseline, spec["gens"], config),
    }
    if "prompt_lookup" in runs:
        lookup = runs["prompt_lookup"]
        report["prompt_lookup"] = {
            "max_ngram": settings.lookup_ngram,
            **acceptance_summary(lookup["gens"]),
            "tau_per_prompt_mean": per_prompt_mean(lookup["gens"]),
            "per_prompt": per_prompt(prompts, lookup["gens"]),
            "seconds": lookup["seconds"], "tokens_per_second": lookup["tokens_per_second"],
            "speedup": lookup["tokens_per_second"] / max(target_tps, 1e-9),
            "lossless": lossless_check(baseline, lookup["gens"], config),
        }
        report["tau_vs_prompt_lookup"] = report["tau"] / max(report["prompt_lookup"]["tau"], 1e-9)
        report["prompt_lookup"]["intervals"] = tau_intervals(lookup["gens"])
    report["intervals"] = tau_intervals(spec["gens"], runs["prompt_lookup"]["gens"] if "prompt_lookup" in runs else None)
    if "confidence_stop" in runs:
        stop = runs["confidence_stop"]
        report["confidence_stop"] = {
            "threshold": config.confidence_threshold,
            **acceptance_summary(stop["gens"]),
            "tau_per_prompt_mean": per_prompt_mean(stop["gens"]),
            "tau_vs_whole_block": acceptance_summary(stop["gens"])["tau"] / max(report["tau"], 1e-9),
            "seconds": stop["seconds"], "tokens_per_second": stop["tokens_per_second"],
            "speedup": stop["tokens_per_second"] / max(target_tps, 1e-9),
            "lossless": lossless_check(baseline, stop["gens"], config),
            "intervals": tau_intervals(stop["gens"], spec["gens"]),
        }
    return report


def per_prompt(prompts: list[list[int]], generations: list[Generation]) -> list[dict[str, Any]]:
    """Prompt length, new tokens, cycles and tau of each prompt (in the prompts' order): a
    subset's tau (long prompts only, say) is its tokens over its cycles."""
    return [{"prompt_tokens": len(p), "new_tokens": len(g.tokens), "cycles": len(g.acceptance_lengths),
             "accepted_tokens": sum(g.acceptance_lengths),
             "tau": sum(g.acceptance_lengths) / len(g.acceptance_lengths) if g.acceptance_lengths else 0.0}
            for p, g in zip(prompts, generations)]


def tau_intervals(generations: list[Generation], baseline: list[Generation] | None = None,
                  resamples: int = INTERVAL_RESAMPLES, seed: int = 0) -> dict[str, Any]:
    """95 % bootstrap intervals over the prompts (the prompts drawn with replacement, `resamples`
    times, a fixed seed): of the pooled tau, of the per-prompt mean and, with `baseline` (the
    same prompts decoded by another method), of the pooled ratio tau / baseline tau, the two
    resampled together. Tau varies so much from prompt to prompt that a few dozen prompts leave
    it uncertain by about +-15 %: two figures whose intervals overlap are not told apart."""
    def sums(gens: list[Generation]) -> tuple[np.ndarray, np.ndarray]:
        return (np.array([sum(g.acceptance_lengths) for g in gens], dtype=np.float64),
                np.array([len(g.acceptance_lengths) for g in gens], dtype=np.float64))

    tokens, cycles = sums(generations)
    keep = cycles > 0
    if keep.sum() < 2:
        return {}
    draw = bootstrap_draw(len(tokens), resamples, seed)
    pooled = resampled_tau(tokens, cycles, draw)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_prompt = np.where(keep, tokens / np.where(keep, cycles, 1), 0.0)
        means = (per_prompt[draw] * keep[draw]).sum(1) / keep[draw].sum(1)
        out: dict[str, Any] = {"prompts": int(len(tokens)), "resamples": resamples,
                               "tau": percentile_interval(pooled), "tau_per_prompt_mean": percentile_interval(means)}
        if baseline is not None and len(baseline) == len(generations):
            out["tau_vs_baseline"] = percentile_interval(pooled / resampled_tau(*sums(baseline), draw))
    return out


def per_prompt_mean(generations: list[Generation]) -> float:
    """The mean over prompts of each prompt's tau: every prompt weighs the same, where the pooled
    tau (all tokens over all cycles) weighs a prompt by its cycles, so hard prompts count more."""
    taus = [sum(g.acceptance_lengths) / len(g.acceptance_lengths) for g in generations if g.acceptance_lengths]
    return sum(taus) / len(taus) if taus else 0.0


def lossless_check(baseline: list[Generation], speculative: list[Generation], config: DecodeConfig) -> dict[str, Any]:
    """Greedy only: every speculative output must equal the target's own output."""
    if config.temperature > 0:
        return {"checked": False, "reason": "sampling (temperature > 0): outputs are random draws"}
    divergences = []
    for i, (want, got) in enumerate(zip(baseline, speculative)):
        at = first_divergence(want.tokens, got.tokens)
        if at is not None:
            divergences.append({
                "prompt": i,
                "position": at,
                "target": want.tokens[at] if at < len(want.tokens) else None,
                "speculative": got.tokens[at] if at < len(got.tokens) else None,
            })
    return {"checked": True, "identical": not divergences, "divergent_prompts": len(divergences),
            "divergences": divergences[:20]}


# -- loading ----------------------------------------------------------------------------------


def load_models(target_dir: str, drafter_dir: str, device: str, dtype: torch.dtype,
                attn_implementation: str | None = None) -> tuple[Any, Any, Any]:
    """The target (eval mode), the drafter on the same device and dtype, and the tokenizer if any."""
    from dflash.train.exports.export import load_drafter, training_target_finding
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    refuse_drafter_as_target(target_dir)
    check_weight_dir(target_dir, purpose="target")
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(target_dir, output_loading_info=True, **kwargs)
        drafter = load_drafter(drafter_dir, target_dir, dtype=dtype)
    except (OSError, ValueError) as e:
        raise InputError(Finding("eval.models-unloadable", target=str(target_dir), drafter=str(drafter_dir),
                                 error=str(e))) from e
    refuse_incomplete_weights(target_dir, loading)
    if finding := training_target_finding(drafter_dir, model.config, target_dir):
        emit(finding, prefix="warning: ")
    n_layers = model.config.get_text_config().num_hidden_layers
    if max(drafter.config.target_layer_ids) >= n_layers:
        raise MismatchError(Finding("eval.drafter-layers-past-target", layers=list(drafter.config.target_layer_ids),
                                    target_layers=n_layers))
    tokenizer = None
    if any((Path(target_dir) / name).is_file() for name in TOKENIZER_FILES):
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
        except Exception:  # noqa: BLE001 - a tokenizer is optional: prompts are ids by default
            tokenizer = None
    return model.to(device).eval(), drafter.to(device).eval(), tokenizer


def default_stop_tokens(model: Any) -> tuple[int, ...]:
    """The target's eos ids (generation_config first, then config)."""
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    return ()


# -- output -----------------------------------------------------------------------------------


def format_report(report: dict[str, Any]) -> str:
    s = report["settings"]
    kind = f" drafter={get_head(s['drafter_type']).title}" if s.get("drafter_type") in head_names() else ""
    lines = [f"dflash-eval  device={s['device']} dtype={s['dtype']}{kind} block_size={s['block_size']} "
             f"batch_size={s['batch_size']} temperature={s['temperature']} max_new_tokens={s['max_new_tokens']}"]
    for r in report["prompt_sets"]:
        lossless = r["lossless"]
        check = ("identical to target" if lossless.get("identical") else
                 f"DIVERGED on {lossless.get('divergent_prompts')} prompt(s)") if lossless["checked"] else "not checked (sampling)"
        hist = " ".join(f"{k}:{v}" for k, v in r["histogram"].items())
        lines += [
            f"\n[{r['name']}] {r['num_prompts']} prompts, {r['new_tokens']} new tokens, {r['cycles']} cycles"
            + ("; [95 %: a-b]: bootstrap interval over the prompts" if r.get("intervals") else ""),
            f"  tau (accepted+1 per cycle): {r['tau']:.3f}{_interval(r, 'tau')} "
            f"(per-prompt mean {r['tau_per_prompt_mean']:.3f}{_interval(r, 'tau_per_prompt_mean')})",
            f"  histogram (length:cycles):  {hist}",
            *([f"  drafts per cycle: {r['drafted_per_cycle']:.2f}"] if "drafted_per_cycle" in r else []),
            f"  target-only: {r['target_only']['tokens_per_second']:.1f} tok/s ({r['target_only']['seconds']:.2f} s)",
            f"  speculative: {r['speculative']['tokens_per_second']:.1f} tok/s ({r['speculative']['seconds']:.2f} s)",
            f"  speedup:     {r['speedup']:.2f}x",
            f"  lossless:    {check}",
        ]
        for d in lossless.get("divergences", [])[:5]:
            lines.append(f"    prompt {d['prompt']}: token {d['position']}: target {d['target']}, speculative {d['speculative']}")
        if "confidence_stop" in r:
            lines += format_confidence_stop(r)
        if "prompt_lookup" in r:
            lines += format_lookup(r)
    return "\n".join(lines)


def format_confidence_stop(r: dict[str, Any]) -> list[str]:
    """The lines of a prompt set's decode that stopped each block where the drafter was unsure."""
    c = r["confidence_stop"]
    lossless = c["lossless"]
    check = ("identical to target" if lossless.get("identical") else
             f"DIVERGED on {lossless.get('divergent_prompts')} prompt(s)") if lossless["checked"] else "not checked (sampling)"
    return [
        f"  confidence stop (running product of the drafts' confidence >= {c['threshold']:g}):",
        f"    tau:       {c['tau']:.3f}{_interval(c, 'tau')} ({c['tau_vs_whole_block']:.2f}x the whole block's"
        f"{_interval(c, 'tau_vs_baseline')})",
        f"    drafts per cycle: {c['drafted_per_cycle']:.2f} (whole block {r['drafted_per_cycle']:.2f})",
        f"    speed:     {c['tokens_per_second']:.1f} tok/s ({c['seconds']:.2f} s), speedup {c['speedup']:.2f}x",
        f"    lossless:  {check}",
    ]


def _interval(r: dict[str, Any], key: str) -> str:
    """`, 95 % interval a-b` of a report's bootstrap interval `key`, or nothing without one."""
    span = (r.get("intervals") or {}).get(key)
    return f" [95 %: {span[0]:.2f}-{span[1]:.2f}]" if span else ""


def format_lookup(r: dict[str, Any]) -> list[str]:
    """The baseline's lines of a prompt set's report: its tau and speedup, and who wins."""
    p = r["prompt_lookup"]
    lossless = p["lossless"]
    check = ("identical to target" if lossless.get("identical") else
             f"DIVERGED on {lossless.get('divergent_prompts')} prompt(s)") if lossless["checked"] else "not checked (sampling)"
    ratio = r["tau_vs_prompt_lookup"]
    span = (r.get("intervals") or {}).get("tau_vs_baseline")
    if span and span[0] <= 1 <= span[1]:
        verdict = "not told apart at these prompts: decode more prompts to tell which accepts more"
    elif ratio > 1:
        verdict = "the drafter beats the free baseline"
    else:
        verdict = "prompt lookup (no training) accepts as much or more: the drafter does not pay for itself"
    return [
        f"  prompt lookup (n-gram <= {p['max_ngram']}, the free baseline):",
        f"    tau:       {p['tau']:.3f}{_interval(p, 'tau')}",
        f"    drafter / lookup: {ratio:.2f}x{_interval(r, 'tau_vs_baseline')} ({verdict})",
        f"    speed:     {p['tokens_per_second']:.1f} tok/s ({p['seconds']:.2f} s), speedup {p['speedup']:.2f}x",
        f"    lossless:  {check}",
    ]


def run_eval(config: EvalConfig) -> dict[str, Any]:
    """The whole evaluation as a function (the CLI and the demo call it); returns the report dict."""
    c = config
    device = str(resolve_device(c.device))
    # fp32 on CPU keeps batched (padded) and single-token passes bit-close: see docs/eval.md.
    dtype = resolve_dtype_name(c.dtype, device)
    model, drafter, tokenizer = load_models(c.target_model, c.drafter, device, torch_dtype(dtype), c.attn_implementation)
    trained = drafter.config.block_size
    if c.block_size is not None and not 2 <= c.block_size <= trained:
        raise EvalError(Finding("eval.block-size-range", flag="--block-size", value=c.block_size, trained=trained))
    stops = () if c.ignore_eos else (tuple(c.stop_token_ids) or default_stop_tokens(model))
    try:
        decode = DecodeConfig(max_new_tokens=c.max_new_tokens, temperature=c.temperature, stop_token_ids=stops,
                              block_size=c.block_size or trained, seed=c.seed,
                              confidence_threshold=c.confidence_threshold)
    except SettingError as e:  # a flag out of its range: said as the flag's refusal
        raise EvalError(e.finding) from None
    vocab = model.config.get_text_config().vocab_size
    positions = target_positions(model.config)
    sets = []
    for path in c.prompts:
        prompts = load_prompts(path, vocab, tokenizer=tokenizer, max_prompts=c.max_prompts, positions=positions,
                               max_new_tokens=c.max_new_tokens, block_size=decode.block_size)
        try:
            result = evaluate_prompt_set(model, drafter, prompts, decode, EvalSettings(
                batch_size=c.batch_size, device=device, baseline=c.baseline, lookup_ngram=c.lookup_ngram))
        except NoConfidenceError:
            raise EvalError(Finding("eval.drafter-without-confidence", drafter=str(c.drafter),
                                    flag="--confidence-threshold")) from None
        sets.append({"name": Path(path).stem, "path": str(path), **result})
    return {
        "settings": {"device": device, "dtype": dtype, "drafter_type": drafter.config.drafter_type,
                     "block_size": decode.block_size,
                     "trained_block_size": trained, "batch_size": c.batch_size, "temperature": c.temperature,
                     "max_new_tokens": c.max_new_tokens, "stop_token_ids": list(stops), "baseline": c.baseline,
                     "lookup_ngram": c.lookup_ngram, "confidence_threshold": c.confidence_threshold},
        "prompt_sets": sets,
    }


