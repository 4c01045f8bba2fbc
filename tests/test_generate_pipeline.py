"""prepare -> generate -> extract -> train -> eval on a tiny target; the cache names its chat template."""

from __future__ import annotations

import hashlib
import json

from chat_utils import QWEN3_TEMPLATE, make_chat_target
from click.testing import CliRunner
from conftest import read_jsonl, write_jsonl
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.manifest import chat_templates, read_manifest
from dflash.eval.cli import main as eval_main
from dflash.extract.cli import main as extract_main
from dflash.prepare.cli import main as prepare_main
from dflash.prepare.generate_cli import main as generate_main
from dflash.train.cli import main as train_main


def chat(n: int, offset: int) -> list[dict]:
    return [{"id": f"q{offset + i}", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": f"count to {offset + i}"},
        {"role": "assistant", "content": "1 2 3"}]} for i in range(n)]


def invoke(command, args):
    result = CliRunner().invoke(command, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result


def test_chat_data_to_an_evaluated_drafter_with_the_template_in_the_manifest(tmp_path):
    target = make_chat_target(tmp_path / "target", QWEN3_TEMPLATE, layers=4)
    train_chat = write_jsonl(tmp_path / "train_chat.jsonl", chat(12, 0))
    eval_chat = write_jsonl(tmp_path / "eval_chat.jsonl", chat(3, 100))
    render = ["--target-model", target, "--thinking", "off", "--no-progress"]
    # Held-out prompts rendered with the same template and thinking mode as the training data.
    invoke(prepare_main, [*render, "--data", eval_chat, "--output", tmp_path / "eval.jsonl"])
    gen_dir = tmp_path / "generated"
    invoke(generate_main, [*render, "--data", train_chat, "--output", gen_dir / "train.jsonl",
                           "--max-tokens", "24", "--dtype", "fp32", "--batch-size", "6"])
    assert len(read_jsonl(gen_dir / "train.jsonl")) == 12
    cache = tmp_path / "cache"
    invoke(extract_main, ["--target-model", target, "--data", gen_dir, "--output", cache,
                          "--target-layer-ids", "1,2", "--dtype", "fp32", "--device", "cpu",
                          "--num-writers", "0", "--no-progress"])
    manifest = read_manifest(cache)
    assert [f["path"] for f in manifest.header["data"]["files"]] == ["train.jsonl"]  # sidecars are not data
    sha = hashlib.sha256(QWEN3_TEMPLATE.encode()).hexdigest()
    [rendering] = chat_templates(manifest.header)
    assert rendering["chat_template_sha256"] == sha
    assert rendering["chat_template_kwargs"] == {"enable_thinking": False}
    assert rendering["producer"] == "dflash-generate" and rendering["generation"]["regenerate"] == "last"
    info = invoke(cache_main, ["info", cache])
    assert f"chat template    sha256 {sha}" in info.output and '"enable_thinking": false' in info.output
    run = tmp_path / "run"
    trained = invoke(train_main, ["--cache", cache, "--target-model", target, "--output-dir", run, "--max-steps", "6",
                                  "--block-size", "4", "--num-draft-layers", "1", "--max-anchors", "8",
                                  "--max-batch-size", "4", "--num-workers", "0", "--dtype", "fp32", "--device", "cpu",
                                  "--save-interval", "0", "--no-progress", "--no-tensorboard"])
    # The trainer says which rendering its data has (the one to serve with).
    assert f"chat template sha256 {sha[:12]} kwargs {{\"enable_thinking\": false}}" in trained.output
    result = invoke(eval_main, ["--target-model", target, "--drafter", run / "final", "--prompts",
                                tmp_path / "eval.jsonl", "--max-new-tokens", "8", "--device", "cpu",
                                "--dtype", "fp32", "--json"])
    report = json.loads(result.stdout)
    [r] = report["prompt_sets"]
    assert r["num_prompts"] == 3 and r["lossless"]["identical"] is True
