"""Every export carries a model card (README.md): Hugging Face front matter, the drafter, the data
and recipe it was trained on, the trainer's held-out estimate with prompt lookup beside it, the
launch lines of vLLM 0.34 and SGLang 0.5.23, and the figures `dflash-eval --update-card` records."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_train_config
from dflash.train.exports.export import TRAINING_KEY, is_export_dir, load_drafter, update_card
from dflash.train.exports.model_card import CARD_NAME, card_text
from dflash.train.heads import get_head, head_names
from dflash.train.run.checkpoint import export_checkpoint
from dflash.train.run.loop import train

SETTINGS = dict(max_steps=6, epochs=2, eval_fraction=0.25, eval_interval=3, save_interval=3, lr=1e-3)


def front_matter(card: str) -> dict[str, object]:
    match = re.match(r"---\n(.*?)\n---\n", card, re.S)
    assert match, card[:200]
    out: dict[str, object] = {}
    key = None
    for line in match.group(1).splitlines():
        if line.startswith("- ") and key:
            out.setdefault(key, []).append(line[2:])  # type: ignore[union-attr]
        else:
            key, _, value = line.partition(":")
            if value.strip():
                out[key] = value.strip()
    return out


@pytest.fixture(scope="module", params=list(head_names()))
def run(request, tiny_world, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp(f"card-{request.param}") / "run"
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, drafter_type=request.param,
                                     **SETTINGS))
    assert result.exit_status == 0
    return {"out": out, "result": result, "type": request.param, **tiny_world}


def test_an_export_carries_a_card_that_says_what_it_is_how_to_serve_it_and_what_it_was_trained_on(run):
    final = run["out"] / "final"
    card = (final / CARD_NAME).read_text()
    config = json.loads((final / "config.json").read_text())
    meta = front_matter(card)
    assert meta["library_name"] == "transformers"
    serving = get_head(run["type"]).serving  # the head's serving facts (checked against the engines in its tests)
    assert {"speculative-decoding", *serving["tags"]} <= set(meta["tags"])
    assert "base_model" not in meta  # the tiny target names no Hub id
    # the launch lines: block 4 -> 3 speculative tokens; the method only where vLLM cannot detect it
    spec = json.loads(re.search(r"--speculative-config '(\{.*?\})'", card).group(1))
    assert spec["num_speculative_tokens"] == config["block_size"] - 1
    assert spec.get("method") == serving["vllm_method"]
    algorithm = serving["sglang_algorithm"]
    assert (f"--speculative-algorithm {algorithm}" in card) if algorithm else ("sglang.launch_server" not in card)
    assert config["architectures"][0] in card
    # the data and the recipe it was trained on, and the held-out estimate beside prompt lookup
    record = config[TRAINING_KEY]["run"]
    assert record["data"]["samples"] == 48 and f"{record['data']['tokens']:,} tokens" in card
    assert record["recipe"]["drafter_type"] == run["type"] and record["recipe"]["epochs"] == 2
    best = run["result"].best_step
    assert record["heldout"]["best_step"] == best and record["exported_step"] == best
    assert record["steps"] == run["result"].step
    assert f"tau {record['heldout']['best_heldout_tau']:.3f} at step {best}" in card
    assert "prompt lookup" in card and "Not yet measured by speculative decoding" in card
    assert is_export_dir(final)


def test_dflash_train_export_of_a_checkpoint_writes_the_same_record(run, tmp_path):
    latest = sorted((run["out"] / "checkpoints").glob("step-*"))[-1]
    out = export_checkpoint(latest, tmp_path / "exported")
    record = json.loads((out / "config.json").read_text())[TRAINING_KEY]
    assert record["run"]["steps"] == record["run"]["exported_step"] == int(latest.name.split("-")[1])
    assert record["run"]["data"]["samples"] == 48
    assert (out / CARD_NAME).read_text().startswith("---\n")


def test_the_card_names_the_targets_hub_id_when_its_config_records_one(run, tmp_path):
    config = json.loads((run["out"] / "final" / "config.json").read_text())
    config[TRAINING_KEY]["run"]["target_name_or_path"] = "Qwen/Qwen3-8B"
    card = card_text(config, TRAINING_KEY)
    assert front_matter(card)["base_model"] == "Qwen/Qwen3-8B" and "drafter for Qwen/Qwen3-8B" in card
    config[TRAINING_KEY]["run"]["target_name_or_path"] = str(tmp_path)  # a local path is no Hub id
    assert "base_model" not in front_matter(card_text(config, TRAINING_KEY))


@pytest.mark.parametrize("run", ["dflash2"], indirect=True)  # one head: the card of each is checked above
def test_dflash_eval_update_card_records_its_figures_and_keeps_the_export_loadable(run, tmp_path):
    from dflash.eval.cli import main as eval_main

    final = run["out"] / "final"
    prompts = tmp_path / "prompts.jsonl"
    gen = torch.Generator().manual_seed(3)
    prompts.write_text("".join(json.dumps({"input_ids": torch.randint(0, 63, (8,), generator=gen).tolist()}) + "\n"
                               for _ in range(3)))
    args = ["--target-model", str(run["target"]), "--drafter", str(final), "--prompts", str(prompts),
            "--max-new-tokens", "8", "--json", "--update-card"]
    result = CliRunner().invoke(eval_main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    [entry] = json.loads((final / "config.json").read_text())[TRAINING_KEY]["evaluations"]
    measured = report["prompt_sets"][0]
    assert entry["tau"] == measured["tau"] and entry["lookup_tau"] == measured["prompt_lookup"]["tau"]
    assert entry["lossless"] == "identical" and entry["num_prompts"] == 3
    card = (final / CARD_NAME).read_text()
    assert f"{measured['tau']:.2f}" in card and "Not yet measured" not in card
    # a second measurement of the same prompts, block and temperature replaces the first
    update_card(final, report)
    assert len(json.loads((final / "config.json").read_text())[TRAINING_KEY]["evaluations"]) == 1
    assert is_export_dir(final)
    load_drafter(final, run["target"])  # still loads, strict


def test_an_export_written_before_the_card_is_still_an_export(run, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for name in ("config.json", "model.safetensors"):
        (old / name).write_bytes((run["out"] / "final" / name).read_bytes())
    assert is_export_dir(old)
    (old / "notes.txt").write_text("mine")
    assert not is_export_dir(old)


def test_the_card_is_written_from_config_json_alone(run):
    final = run["out"] / "final"
    config = json.loads((final / "config.json").read_text())
    assert (final / CARD_NAME).read_text() == card_text(config, TRAINING_KEY)
    assert Path(final / CARD_NAME).stat().st_size < 8000
