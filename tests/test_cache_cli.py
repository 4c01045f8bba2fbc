"""The `dflash-cache` command line: help, error reporting, exit codes, outputs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from dflash.cache_tools.cli import main
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.manifest import make_header
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.writer import CacheWriter

COMMANDS = ["info", "verify", "stats", "recompress", "merge", "prune"]


def make_cache(path: Path, *, parts: int = 2, layer_ids=(1, 5), seed: int = 0) -> int:
    """A tiny bf16 cache (K=2, D=32, 16-row chunks, 64-row shards); returns its token count."""
    header = make_header(
        target={"model": "tiny", "architecture": "Qwen3ForCausalLM", "vocab_size": 500},
        target_layer_ids=list(layer_ids), hidden_size=32, codec=HiddenCodec(name="bf16"),
        chunk_rows=16, shard_rows=64, data={"seed": seed},
    )
    writer = CacheWriter(path, header)
    g = torch.Generator().manual_seed(seed)
    tokens = 0
    for p in range(parts):
        with writer.part_writer(f"part-{p:06d}") as pw:
            pw.stats["skipped_too_long"] = 2
            for s in range(3):
                t = int(torch.randint(30, 80, (1,), generator=g))
                pw.add_sample(10 * p + s, torch.randint(0, 500, (t,), generator=g),
                              torch.ones(t, dtype=torch.uint8), torch.randn(t, 64, generator=g).bfloat16())
                tokens += t
    return tokens


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def flat(text: str) -> str:
    return " ".join(text.split())


def test_group_help_lists_every_command():
    res = run("--help")
    assert res.exit_code == 0
    for cmd in COMMANDS:
        assert cmd in res.output
    assert "Exit status" in res.output


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_explains_itself_with_an_example(cmd):
    res = run(cmd, "--help")
    assert res.exit_code == 0
    assert "Example:" in res.output and f"dflash-cache {cmd}" in res.output


@pytest.mark.parametrize("cmd", ["info", "verify", "stats", "prune"])
def test_a_missing_directory_is_one_clear_error_without_traceback(tmp_path, cmd):
    res = run(cmd, tmp_path / "nope")
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    assert flat(res.output).startswith(f"Error: Cache directory {tmp_path / 'nope'} does not exist.")


@pytest.mark.parametrize("cmd", ["info", "verify", "stats", "prune"])
def test_a_directory_without_manifest_is_not_a_cache(tmp_path, cmd):
    res = run(cmd, tmp_path)
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    assert f"{tmp_path} is not a dflash cache: it has no manifest.json." in flat(res.output)


def test_a_corrupt_manifest_is_a_clear_error(tmp_path):
    make_cache(tmp_path / "c", parts=1)
    (tmp_path / "c" / "manifest.json").write_text('{"format_version": 1, "tar')
    for cmd in ("info", "verify"):
        res = run(cmd, tmp_path / "c")
        assert res.exit_code == 2 and "Traceback" not in res.output
        assert "is not valid JSON" in flat(res.output) and "The manifest is damaged" in flat(res.output)


def test_info_json_reports_what_was_written(tmp_path):
    tokens = make_cache(tmp_path / "c", parts=2)
    res = run("info", tmp_path / "c", "--json")
    assert res.exit_code == 0
    info = json.loads(res.output)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "c" / "parts").rglob("*") if f.is_file())
    assert (info["parts"], info["samples"], info["tokens"], info["bytes"]) == (2, 6, tokens, on_disk)
    assert info["raw_bf16_bytes"] == tokens * 2 * 32 * 2
    assert info["compression_ratio"] == pytest.approx(info["raw_bf16_bytes"] / on_disk)
    assert info["part_stats"] == {"skipped_too_long": 4}
    assert info["target"]["architecture"] == "Qwen3ForCausalLM" and info["target_layer_ids"] == [1, 5]
    text = run("info", tmp_path / "c").output
    assert f"tokens           {tokens}" in text and "skipped_too_long=4" in text


def test_verify_is_clean_on_a_sound_cache(tmp_path):
    make_cache(tmp_path / "c", parts=2)
    res = run("verify", tmp_path / "c")
    assert res.exit_code == 0 and res.output.startswith("OK: 2 parts")


def _damage(cache: Path) -> None:
    """Flip bytes inside hidden chunk 1 of part-000000; truncate a shard file of part-000001."""
    pf = CacheReader(cache).part_arrays(0)
    _, idx = pf.shard_index("hidden", 0, pf.array_meta("hidden"))
    off, nbytes = (int(x) for x in idx[1])
    pf.close()
    with open(cache / "parts/part-000000/hidden/c/0/0", "r+b") as f:
        f.seek(off + nbytes // 2)
        f.write(b"\x00\xff\x00\xff")
    shard = cache / "parts/part-000001/hidden/c/1/0"
    os.truncate(shard, shard.stat().st_size - 100)


def test_verify_names_the_corrupt_chunk_and_the_truncated_shard_and_exits_1(tmp_path):
    make_cache(tmp_path / "c", parts=3)
    _damage(tmp_path / "c")
    res = run("verify", tmp_path / "c")
    assert res.exit_code == 1 and "Traceback" not in res.output
    lines = res.output.splitlines()
    assert any(ln.startswith("BAD part-000000 hidden chunk 1 (rows 16-31)") and "checksum mismatch" in ln for ln in lines)
    assert any(ln.startswith("BAD part-000001 hidden shard file hidden/c/1/0") for ln in lines)
    assert not any("part-000002" in ln for ln in lines)
    assert "2 of 3 parts (part-000000, part-000001)" in lines[-1]


def test_verify_fast_catches_the_truncation_without_decoding(tmp_path):
    make_cache(tmp_path / "c", parts=3)
    _damage(tmp_path / "c")
    res = run("verify", "--fast", tmp_path / "c")
    assert res.exit_code == 1
    assert "BAD part-000001 hidden shard file hidden/c/1/0" in res.output
    assert "part-000000" not in res.output  # a flipped byte needs the full check


def test_stats_prints_every_layer_and_a_length_histogram(tmp_path):
    make_cache(tmp_path / "c", parts=2)
    res = run("stats", tmp_path / "c", "--num-tokens", "50", "--seed", "3", "--json")
    assert res.exit_code == 0
    s = json.loads(res.output)
    assert [la["layer_id"] for la in s["layers"]] == [1, 5] and s["sampled_tokens"] == 50
    assert sum(h["samples"] for h in s["length_histogram"]) == 6
    assert "sample lengths:" in run("stats", tmp_path / "c", "--num-tokens", "50").output


def test_recompress_then_info_shows_the_new_codec_and_a_rerun_skips_everything(tmp_path):
    make_cache(tmp_path / "c", parts=2)
    res = run("recompress", tmp_path / "c", tmp_path / "fp8", "--codec", "fp8")
    assert res.exit_code == 0 and "Recompressed 2 parts, 0 already present" in res.output
    assert json.loads(run("info", tmp_path / "fp8", "--json").output)["codec"]["name"] == "fp8"
    again = run("recompress", tmp_path / "c", tmp_path / "fp8", "--codec", "fp8")
    assert "Recompressed 0 parts, 2 already present" in again.output
    assert run("recompress", tmp_path / "c", tmp_path / "x", "--codec", "int8").exit_code == 2


def test_merge_cli_merges_and_refuses_different_layers_with_a_clear_message(tmp_path):
    make_cache(tmp_path / "a", parts=1, seed=1)
    make_cache(tmp_path / "b", parts=2, seed=2)
    make_cache(tmp_path / "other", parts=1, layer_ids=(2, 6))
    res = run("merge", tmp_path / "m", tmp_path / "a", tmp_path / "b")
    assert res.exit_code == 0 and "Merged 3 parts" in res.output
    assert json.loads(run("info", tmp_path / "m", "--json").output)["samples"] == 9
    bad = run("merge", tmp_path / "m2", tmp_path / "a", tmp_path / "other")
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert f"Error: Cannot merge {tmp_path / 'other'} with {tmp_path / 'a'}: they differ in target_layer_ids" \
        in flat(bad.output)


def test_merge_with_the_destination_last_points_at_the_argument_order(tmp_path):
    make_cache(tmp_path / "a", parts=1, seed=1)
    make_cache(tmp_path / "b", parts=1, seed=2)
    before = {p: p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()}
    res = run("merge", tmp_path / "a", tmp_path / "b", tmp_path / "new")
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "merge takes the new cache first" in flat(res.output)
    assert {p: p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()} == before  # nothing touched
    assert not (tmp_path / "new").exists()


def test_prune_reports_and_removes_leftovers(tmp_path):
    make_cache(tmp_path / "c", parts=2)
    stale = tmp_path / "c/parts/.tmp-part-000009.123.abcd"
    stale.mkdir()
    (stale / "zarr.json").write_text("{}")
    dry = run("prune", tmp_path / "c", "--dry-run")
    assert dry.exit_code == 0 and "would remove parts/.tmp-part-000009.123.abcd" in dry.output
    assert stale.exists()
    res = run("prune", tmp_path / "c")
    assert "removed parts/.tmp-part-000009.123.abcd" in res.output and not stale.exists()
    assert run("prune", tmp_path / "c").output.strip() == "Nothing to remove."
    assert run("verify", tmp_path / "c").exit_code == 0
