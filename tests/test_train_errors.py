"""Startup reads manifests only, and bad settings stop with one clear paragraph (exit status 2)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from click.testing import CliRunner
from conftest import tiny_train_config, write_tiny_cache
from dflash.cache_tools.manifest import LOG_FILE, PartRecord, encode_log_line, read_manifest
from dflash.runtime.findings import collected
from dflash.train.cli import main
from dflash.train.run.loop import train


def run_cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def base_args(world: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["--cache", str(world["cache"]), "--target-model", str(world["target"]), "--output-dir", str(out),
            "--num-draft-layers", "1", "--block-size", "4", "--max-anchors", "4", "--token-budget", "128",
            "--max-seq-len", "64", "--num-workers", "0", "--no-progress", "--no-tensorboard", *extra]


def assert_clear_error(code: int, output: str, *fragments: str) -> None:
    assert code == 2, output
    assert "Traceback" not in output
    assert "Error: " in output  # (after the notices the run said before it was refused)
    flat = " ".join(output[output.index("Error: "):].split())
    for fragment in fragments:
        assert fragment in flat, flat


def test_cache_from_another_target_is_refused(tiny_world, tmp_path):
    cache = write_tiny_cache(tmp_path / "other", samples=4, parts=1, target_layers=8)
    args = base_args(tiny_world, tmp_path / "run")
    args[1] = str(cache)
    assert_clear_error(*run_cli(*args), "was not extracted from the target model",
                       "num_hidden_layers: cache has 8, target has 4")


def test_missing_cache_is_named(tiny_world, tmp_path):
    args = base_args(tiny_world, tmp_path / "run")
    args[1] = str(tmp_path / "no-such-cache")
    assert_clear_error(*run_cli(*args), f"Cache directory {tmp_path / 'no-such-cache'} does not exist")


def test_token_budget_smaller_than_a_sample_is_refused(tiny_world, tmp_path):
    code, output = run_cli(*base_args(tiny_world, tmp_path / "run"), "--token-budget", "16")
    assert_clear_error(code, output, "longer than --token-budget 16", "lower --max-seq-len")


def test_two_caches_with_different_layers_are_refused_naming_both(tiny_world, tmp_path):
    other = write_tiny_cache(tmp_path / "layers-0-2", samples=4, parts=1, layers=(0, 2))
    code, output = run_cli(*base_args(tiny_world, tmp_path / "run", "--cache", str(other)))
    assert_clear_error(code, output, f"{tiny_world['cache']} (first)", f"{other} (second)",
                       "target_layer_ids: second has [0, 2], first has [1, 2]")


def test_unknown_config_key_and_soft_labels_without_extras_are_refused(tiny_world, tmp_path):
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"learning_rate": 1e-3}))
    assert_clear_error(*run_cli("--config", str(config)), "unknown setting(s) learning_rate")
    code, output = run_cli(*base_args(tiny_world, tmp_path / "run", "--soft-label-weight", "0.5"))
    assert_clear_error(code, output, "stores neither last_hidden nor top-k")


def test_resume_with_other_batching_or_model_shape_is_refused_listing_the_differences(tiny_world, tmp_path):
    out = tmp_path / "run"
    code, output = run_cli(*base_args(tiny_world, out, "--max-steps", "2", "--epochs", "1"))
    assert code == 0, output
    code, output = run_cli(*base_args(tiny_world, out, "--max-steps", "4", "--epochs", "1",
                                      "--token-budget", "96"), "--block-size", "8")
    assert_clear_error(code, output, "Cannot resume from", "batching.token_budget: checkpoint has 128, this run has 96",
                       "model.block_size: checkpoint has 4, this run has 8", "another --output-dir")
    code, output = run_cli(*base_args(tiny_world, out, "--max-steps", "4", "--epochs", "1",
                                      "--draft-layer-types", "sliding", "--draft-sliding-window", "8"))
    assert_clear_error(code, output, "Cannot resume from", "model.layer_types", "model.sliding_window")


# -- startup cost -------------------------------------------------------------------------------

_OPENED: list[str] = []


def _record_opens(event, args):
    # Audit hooks cannot be removed: this one records only while the list is armed.
    if _OPENED and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_record_opens)


def test_startup_on_10000_parts_reads_only_the_manifest_and_the_first_batch(tiny_world, tmp_path):
    cache = write_tiny_cache(tmp_path / "cache", samples=2, parts=1, min_len=20, max_len=24)
    template = cache / "parts" / "part-000000"
    record = read_manifest(cache).parts[0]
    lines = []
    for p in range(1, 10_000):
        name = f"part-{p:06d}"
        os.symlink(template, cache / "parts" / name)
        lines.append(encode_log_line(PartRecord(**{**record.__dict__, "name": name})))
    with open(cache / LOG_FILE, "ab") as f:
        f.write(b"".join(lines))

    # Without the held-out split, which reads each part's sample ids (test_train_heldout.py).
    config = tiny_train_config(cache, tiny_world["target"], tmp_path / "run", max_steps=1, epochs=1,
                               max_batch_size=4, eval_fraction=0)
    _OPENED.clear()
    _OPENED.append("recording")
    start = time.perf_counter()
    result = train(config)
    elapsed = time.perf_counter() - start
    opened = [p for p in _OPENED[1:] if str(cache) in p]
    _OPENED.clear()
    assert result.step == 1
    # (and the extraction plan and the eviction log, one file each whatever the part count:
    # whether the cache is finished, whether parts of it were evicted under a disk budget)
    outside_parts = ({os.path.basename(p) for p in opened if "/parts/" not in p}
                     - {"manifest.plan.json", "manifest.evicted.jsonl"})
    assert outside_parts == {"manifest.json", LOG_FILE}
    touched_parts = {p.split("/parts/")[1].split("/")[0] for p in opened if "/parts/" in p}
    assert 1 <= len(touched_parts) <= 4  # the parts of the one batch of 4 samples, nothing else
    assert elapsed < 60, elapsed  # only a guard against a pathological regression (a directory scan)
    shutil.rmtree(tmp_path / "run")


def test_lr_nan_or_inf_on_the_command_line_is_refused_in_one_paragraph(tiny_world, tmp_path):
    for value in ("nan", "inf"):
        code, output = run_cli(*base_args(tiny_world, tmp_path / value, "--lr", value))
        # (every float setting of every command: the settings layer refuses it, naming the flag)
        assert_clear_error(code, output, "'--lr'", f"'{value}' is not a finite number")
        assert not (tmp_path / value).exists()  # refused before the run directory was made


def test_flex_attention_on_a_cpu_is_refused_in_one_paragraph_before_a_step(tiny_world, tmp_path):
    code, output = run_cli(*base_args(tiny_world, tmp_path / "run", "--attention-backend", "flex", "--device", "cpu"))
    assert_clear_error(code, output, "--attention-backend flex trains on CUDA only", "--attention-backend sdpa")
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))


def test_a_cache_holding_samples_past_the_targets_positions_is_named_at_startup(tmp_path):
    from conftest import HIDDEN, TARGET_LAYERS, WORLD_VOCAB, make_tiny_target

    # Samples of 20-24 tokens, as a cache extracted before dflash-extract held samples to the
    # target's positions could hold them; the same target with 16 positions, then with 512.
    cache = write_tiny_cache(tmp_path / "cache", samples=8, parts=2, min_len=20, max_len=24)
    lengths = [n for part in read_manifest(cache).parts for n in part.lengths]
    for positions, named in ((16, True), (512, False)):
        target = make_tiny_target(tmp_path / f"target-{positions}", hidden=HIDDEN, layers=TARGET_LAYERS,
                                  vocab=WORLD_VOCAB, heads=2, kv_heads=1, max_positions=positions)
        config = tiny_train_config(cache, target, tmp_path / f"run-{positions}", max_steps=1, epochs=1,
                                   max_batch_size=4, eval_fraction=0)
        with collected() as found:
            assert train(config).step == 1
        long = [f.fields for f in found if f.code == "train.cache-long-samples"]
        assert long == ([dict(cache=str(cache), samples=len(lengths), longest=max(lengths), limit=16,
                              source="max_position_embeddings 16")] if named else []), found
