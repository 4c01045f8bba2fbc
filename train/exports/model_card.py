"""The model card of an export (README.md beside config.json): what a person who finds the drafter
reads before serving it.

The card is written from config.json alone: its Qwen3/DFlash keys say what the drafter is, and
its `dflash_training` record (export.TRAINING_KEY) what it was trained against and on, the
trainer's held-out estimate, and the latest `dflash-eval --update-card` figures. So a card can
always be written again from the export itself, and the figures it shows are the ones recorded.
Hugging Face reads the front matter (base_model, library_name, tags); the engines read neither.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dflash.train.heads import get_head, head_for_architecture

CARD_NAME = "README.md"

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def base_model(record: dict[str, Any]) -> str | None:
    """The target's Hub id where the target's own config names one (`_name_or_path` of the form
    org/name), else None: a local path means nothing to a reader of the Hub."""
    name = (record.get("run") or {}).get("target_name_or_path")
    return name if isinstance(name, str) and HUB_ID.match(name) and not Path(name).exists() else None


def _front_matter(hf_config: dict[str, Any], record: dict[str, Any], serving: dict[str, Any]) -> str:
    lines = ["---"]
    if (base := base_model(record)) is not None:
        lines.append(f"base_model: {base}")
    lines.append("library_name: transformers")
    lines.append("tags:")
    lines += [f"- {tag}" for tag in ("speculative-decoding", "draft-model", "block-diffusion", *serving["tags"])]
    lines.append("---")
    return "\n".join(lines)


def serve_lines(hf_config: dict[str, Any], serving: dict[str, Any], *, target: str = "TARGET_MODEL",
                drafter: str = "THIS_DIRECTORY") -> list[str]:
    """The launch lines of vLLM 0.34 and SGLang 0.5.23 for this export (markdown)."""
    block = int(hf_config.get("block_size") or hf_config["dflash_config"]["block_size"])
    spec: dict[str, Any] = {"model": drafter, "num_speculative_tokens": block - 1}
    if serving["vllm_method"]:
        spec = {"method": serving["vllm_method"], **spec}
    sglang = (f"python -m sglang.launch_server --model-path {target} \\\n"
              f"    --speculative-algorithm {serving['sglang_algorithm']} --speculative-draft-model-path {drafter}")
    if "sliding_attention" in (hf_config.get("layer_types") or []):
        sglang += f" \\\n    --speculative-draft-window-size {hf_config['sliding_window']}"
    vllm = ["vLLM 0.34 (`num_speculative_tokens` is the block size minus one; vLLM does not read `block_size`):",
            "", "```bash", f"vllm serve {target} --speculative-config '{json.dumps(spec)}'", "```", ""]
    if not serving["sglang_algorithm"]:  # e.g. XPress: no model of SGLang 0.5.23 declares its architecture
        return [*vllm, f"SGLang 0.5.23 does not serve {serving['name']} drafters."]
    return [*vllm, "SGLang 0.5.23:", "", "```bash", sglang, "```"]


def _drafter_rows(hf_config: dict[str, Any], serving: dict[str, Any]) -> list[tuple[str, str]]:
    dflash = hf_config.get("dflash_config") or {}
    rows = [("architecture", f"`{hf_config['architectures'][0]}` ({serving['name']})"),
            ("draft layers", str(hf_config["num_hidden_layers"])),
            ("block size", str(hf_config.get("block_size") or dflash.get("block_size"))),
            ("target layers fused", str(list(dflash.get("target_layer_ids") or []))),
            ("mask token id", str(dflash.get("mask_token_id"))),
            ("hidden size / vocabulary", f"{hf_config['hidden_size']} / {hf_config['vocab_size']}")]
    types = hf_config.get("layer_types") or []
    if "sliding_attention" in types:
        rows.append(("layer types", f"{', '.join(types)} (window {hf_config.get('sliding_window')})"))
    named = head_for_architecture(hf_config.get("architectures")) or get_head(None)
    head = {k: dflash[k] for k in named.setting_names if k in dflash}
    if head:
        rows.append(("head", ", ".join(f"{k} {v}" for k, v in head.items())))
    return rows


def _training_lines(record: dict[str, Any]) -> list[str]:
    run = record.get("run") or {}
    lines: list[str] = []
    target = record.get("target_path") or run.get("target_name_or_path")
    if target:
        weights = (record.get("target") or {}).get("weights_hash")
        lines.append(f"- target: `{target}`" + (f" (weights hash `{str(weights)[:16]}`)" if weights else ""))
    if run.get("steps"):
        exported = run.get("exported_step", run["steps"])
        lines.append(f"- steps: {run['steps']:,}" + (f"; these weights are step {exported:,}'s" if exported != run["steps"]
                                                      else ""))
    if data := run.get("data"):
        lines.append(f"- data: {data['samples']:,} samples, {data['tokens']:,} tokens"
                     + (f", cache {', '.join(data['caches'])}" if data.get("caches") else ""))
    if recipe := run.get("recipe"):
        lines.append("- recipe: " + ", ".join(f"{k} {v}" for k, v in sorted(recipe.items())))
    heldout = run.get("heldout") or {}
    if heldout.get("best_heldout_tau") is not None:
        text = f"- the trainer's held-out estimate: tau {heldout['best_heldout_tau']:.3f} at step {heldout['best_step']}"
        if heldout.get("interval"):
            text += f" (95 % interval {heldout['interval'][0]:.3f}-{heldout['interval'][1]:.3f})"
        if heldout.get("lookup_tau"):
            text += f"; prompt lookup, which needs no training, {heldout['lookup_tau']:.3f} on the same samples"
        lines.append(text + " (a replay of greedy decoding on held-out samples, not a decode)")
    return lines


def _evaluation_lines(record: dict[str, Any]) -> list[str]:
    evaluations = record.get("evaluations") or []
    if not evaluations:
        return ["Not yet measured by speculative decoding: `dflash-eval --target-model TARGET --drafter THIS_DIRECTORY "
                "--prompts PROMPTS.jsonl --update-card` decodes held-out prompts and records the figures here."]
    lines = ["| prompts | block | temperature | tau pooled (95 %) | per-prompt mean | prompt lookup tau | "
             "drafter / lookup | speedup | lossless |", "|---|---|---|---|---|---|---|---|---|"]
    for e in evaluations:
        span = f" ({e['tau_interval'][0]:.2f}-{e['tau_interval'][1]:.2f})" if e.get("tau_interval") else ""
        lookup = f"{e['lookup_tau']:.2f}" if e.get("lookup_tau") is not None else "-"
        ratio = f"{e['tau_vs_prompt_lookup']:.2f}x" if e.get("tau_vs_prompt_lookup") is not None else "-"
        lines.append(f"| {e['prompt_set']} ({e['num_prompts']}) | {e['block_size']} | {e['temperature']:g} | "
                     f"{e['tau']:.2f}{span} | {e['tau_per_prompt_mean']:.2f} | {lookup} | {ratio} | "
                     f"{e['speedup']:.2f}x on {e['device']} | {e['lossless']} |")
    return lines


def card_text(hf_config: dict[str, Any], training_key: str) -> str:
    """The README.md of an export whose config.json is `hf_config`."""
    # how the engines serve it, as its head declares (an architecture of no head: a DFlash drafter)
    serving = (head_for_architecture(hf_config.get("architectures")) or get_head(None)).serving
    record = hf_config.get(training_key) or {}
    target = base_model(record) or (Path(record["target_path"]).name if record.get("target_path") else "its target")
    parts = [_front_matter(hf_config, record, serving), "", f"# {serving['name']} drafter for {target}", "",
             f"A block-diffusion speculative-decoding drafter ({serving['name']}, arXiv 2602.06036): from the hidden "
             "states of a few of the target's layers it drafts a whole block in one pass, and the target verifies it. "
             "It holds its own layers only: the embedding and the output head are the target's, read from the "
             "target at load time, so serve it with the target it was trained against.", "",
             "## Serve", "", *serve_lines(hf_config, serving), "",
             "## Drafter", "", "| | |", "|---|---|",
             *[f"| {k} | {v} |" for k, v in _drafter_rows(hf_config, serving)], ""]
    training = _training_lines(record)
    if training:
        parts += ["## Training", "", *training, ""]
    parts += ["## Measured by speculative decoding", "",
              "tau: tokens accepted per verification cycle (accepted + 1), pooled over all cycles, and the mean "
              "of the prompts' own taus; prompt lookup (n-gram drafting, no training) decoded beside it under the "
              "same verification.", "", *_evaluation_lines(record), ""]
    return "\n".join(parts)


def evaluation_record(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures of a dflash-eval report (eval.run.run_eval) a card shows, one per prompt set."""
    settings = report["settings"]
    out = []
    for s in report["prompt_sets"]:
        lookup = s.get("prompt_lookup") or {}
        lossless = s["lossless"]
        out.append({
            "prompt_set": s["name"], "num_prompts": s["num_prompts"], "block_size": settings["block_size"],
            "temperature": settings["temperature"], "max_new_tokens": settings["max_new_tokens"],
            "device": settings["device"], "tau": s["tau"], "tau_interval": (s.get("intervals") or {}).get("tau"),
            "tau_per_prompt_mean": s["tau_per_prompt_mean"], "lookup_tau": lookup.get("tau"),
            "tau_vs_prompt_lookup": s.get("tau_vs_prompt_lookup"), "speedup": s["speedup"],
            "lossless": ("identical" if lossless.get("identical") else "DIVERGED") if lossless.get("checked")
                        else "not checked (sampling)",
        })
    return out
