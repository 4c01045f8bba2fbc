"""`dflash-cache import`: SpecForge's and speculators' hidden-state directories, written here in
their layouts from the facts in docs/cache-tools.md, become caches of ours: the same ids, masks
and hidden bits, layer ids in our numbering, verified, resumable, bad files named, and training
from them equal to training from a cache our writer wrote from the same arrays."""

from __future__ import annotations

import gzip
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import HIDDEN, WORLD_VOCAB, assert_same_weights, final_weights, tiny_train_config
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.codecs import HiddenCodec
from dflash.cache_tools.importers import (
    SOURCES,
    BadSampleFile,
    RawSample,
    SampleFile,
    SampleSource,
    register_source,
)
from dflash.cache_tools.importing import ImportOptions, import_cache, read_target
from dflash.cache_tools.manifest import make_header, read_manifest
from dflash.cache_tools.reader import CacheReader
from dflash.cache_tools.sample_scores import prompt_split_key
from dflash.cache_tools.writer import CacheWriter
from dflash.runtime.errors import Interrupted
from dflash.train.data.loader import sample_tensors
from safetensors.torch import save_file

LAYERS = [1, 2]  # ours, of the tiny world's 4-layer target (at most N-2)
K = len(LAYERS)


@dataclass
class Sample:
    ids: torch.Tensor  # [T] int64
    mask: torch.Tensor  # [T] int64
    hidden: torch.Tensor  # [T, K*D] bf16
    last: torch.Tensor  # [T, D] bf16: the last layer's output (speculators' final slot)


def make_samples(n: int = 10, seed: int = 0) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = int(torch.randint(12, 40, (1,), generator=gen))
        mask = torch.ones(t, dtype=torch.int64)
        mask[: int(torch.randint(1, t // 2, (1,), generator=gen))] = 0
        out.append(Sample(torch.randint(0, WORLD_VOCAB, (t,), generator=gen), mask,
                          torch.randn(t, K * HIDDEN, generator=gen).to(torch.bfloat16),
                          torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16)))
    return out


def write_specforge(root: Path, samples: list[Sample], *, first: int = 0, gz: tuple[int, ...] = ()) -> Path:
    """prepare_hidden_states.py's layout: rows_<g>-<g+2000>/data_<index>.ckpt(.gz), a dict of
    input_ids [T], loss_mask [T], hidden_states [1, T, K*D]; vocab_mapping/ beside them."""
    for i, s in enumerate(samples, start=first):
        group = i // 2000 * 2000
        path = root / f"rows_{group}-{group + 2000}" / f"data_{i}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"input_ids": s.ids.clone(), "loss_mask": s.mask.clone(), "hidden_states": s.hidden.unsqueeze(0).clone()}
        if i in gz:
            buffer = io.BytesIO()
            torch.save(record, buffer)
            with gzip.open(path.with_name(path.name + ".gz"), "wb") as fh:
                fh.write(buffer.getvalue())
        else:
            torch.save(record, path)
    (root / "vocab_mapping").mkdir(parents=True, exist_ok=True)
    torch.save({"d2t": torch.zeros(4, dtype=torch.int64)}, root / "vocab_mapping" / "vocab_mapping.pt")
    return root


def write_speculators(root: Path, samples: list[Sample], *, without_file: tuple[int, ...] = ()) -> Path:
    """prepare_data.py's dataset (save_to_disk: state.json + an Arrow stream of input_ids, loss_mask,
    seq_len) and data_generation_offline.py's hidden_states/hs_<row>.safetensors: hidden_states
    [T, 3, D] (vLLM's layers 2, 3 and the last, 4), token_ids [T]."""
    pa = pytest.importorskip("pyarrow")
    root.mkdir(parents=True)
    table = pa.table({"input_ids": [s.ids.tolist() for s in samples], "loss_mask": [s.mask.tolist() for s in samples],
                      "seq_len": [len(s.ids) for s in samples]})
    with pa.OSFile(str(root / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (root / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                 "_format_type": "torch", "_split": None}))
    (root / "dataset_info.json").write_text("{}")
    (root / "hidden_states").mkdir()
    for i, s in enumerate(samples):
        if i in without_file:
            continue
        slots = torch.cat([s.hidden, s.last], dim=1).reshape(len(s.ids), K + 1, HIDDEN)
        save_file({"hidden_states": slots.contiguous(), "token_ids": s.ids.clone()},
                  str(root / "hidden_states" / f"hs_{i}.safetensors"))
    return root


def run(*args) -> object:
    return CliRunner().invoke(cache_main, [str(a) for a in args])


def import_args(fmt: str, src: Path, out: Path, target: Path, *extra) -> list:
    ids = ["--target-layer-ids", "1,2"] if fmt == "specforge" else ["--source-layer-ids", "2,3,4"]
    return ["import", src, out, "--format", fmt, "--target-model", target, *ids, "--no-progress", *extra]


def cache_samples(cache: Path) -> dict[int, dict]:
    """Every sample of a cache by its id: input_ids, loss_mask, hidden bits, last_hidden bits."""
    reader = CacheReader(cache)
    out = {}
    for i in range(len(reader)):
        s = sample_tensors(reader.read_sample(i))
        out[s["sample_id"]] = s
    reader.close()
    return out


def assert_same_as(samples: dict[int, Sample], cache: Path, *, last: bool = False) -> None:
    stored = cache_samples(cache)
    assert sorted(stored) == sorted(samples)
    for sid, s in samples.items():
        got = stored[sid]
        assert got["input_ids"].tolist() == s.ids.tolist()
        assert got["loss_mask"].tolist() == s.mask.tolist()
        assert torch.equal(got["hidden"].view(torch.int16), s.hidden.view(torch.int16))  # the same bits
        if last:
            assert torch.equal(got["last_hidden"].view(torch.int16), s.last.view(torch.int16))


# -- the two formats ------------------------------------------------------------------------------


def test_a_specforge_directory_becomes_a_cache_with_its_ids_masks_and_hidden_bits(tiny_world, tmp_path):
    samples = make_samples()
    src = write_specforge(tmp_path / "sf", samples, first=1998, gz=(1999, 2003))  # two row groups, two gzipped
    out = tmp_path / "cache"
    result = run(*import_args("specforge", src, out, tiny_world["target"], "--part-tokens", "60"))
    assert result.exit_code == 0, result.output
    assert_same_as({1998 + i: s for i, s in enumerate(samples)}, out)
    manifest = read_manifest(out)
    assert manifest.target_layer_ids == LAYERS and len(manifest.parts) > 2
    assert manifest.header["target"]["config_hash"] == read_target(tiny_world["target"]).identity["config_hash"]
    verified = run("verify", out)
    assert verified.exit_code == 0 and "OK:" in verified.output and "unfinished" not in verified.output


def test_a_specforge_eagle3_directory_imports_its_auxiliary_layers(tiny_world, tmp_path):
    samples = make_samples(3)
    src = tmp_path / "eagle3"
    (src / "rows_0-2000").mkdir(parents=True)
    for i, s in enumerate(samples):
        torch.save({"input_ids": s.ids, "loss_mask": s.mask, "aux_hidden_state": s.hidden.unsqueeze(0),
                    "hidden_state": s.last.unsqueeze(0)}, src / "rows_0-2000" / f"data_{i}.ckpt")
    assert run(*import_args("specforge", src, tmp_path / "cache", tiny_world["target"])).exit_code == 0
    assert_same_as(dict(enumerate(samples)), tmp_path / "cache")
    refused = run(*import_args("specforge", src, tmp_path / "other", tiny_world["target"], "--store-last-hidden"))
    assert refused.exit_code == 2 and "--store-last-hidden" in refused.output


def test_a_speculators_directory_counts_layers_from_the_embedding_and_keeps_its_last_layer(tiny_world, tmp_path):
    samples = make_samples()
    src = write_speculators(tmp_path / "spec", samples, without_file=(3,))
    out = tmp_path / "cache"
    result = run(*import_args("speculators", src, out, tiny_world["target"], "--store-last-hidden"))
    assert result.exit_code == 0, result.output
    assert "1 of the dataset's 10 rows have no hidden-state file" in result.output
    report = import_cache(src, tmp_path / "again", target_model=tiny_world["target"],
                          options=ImportOptions(format="speculators", source_layer_ids=[2, 3, 4]))
    assert [(n.code, n.fields["missing"], n.fields["rows"]) for n in report.notes] == [
        ("cache.import-rows-without-file", 1, 10)]
    assert_same_as({i: s for i, s in enumerate(samples) if i != 3}, out, last=True)
    header = read_manifest(out).header
    assert header["target_layer_ids"] == LAYERS and header["settings"]["source_layer_ids"] == [2, 3, 4]
    assert header["extras"]["last_hidden"] is True
    assert run("verify", out).exit_code == 0


def test_speculators_ids_given_in_our_numbering_find_the_last_layer_slot_by_the_width(tiny_world, tmp_path):
    samples = make_samples(4)
    src = write_speculators(tmp_path / "spec", samples)
    out = tmp_path / "cache"
    result = run("import", src, out, "--format", "speculators", "--target-model", tiny_world["target"],
                 "--target-layer-ids", "1,2", "--no-progress")
    assert result.exit_code == 0, result.output
    assert_same_as(dict(enumerate(samples)), out)  # the last slot is left out without --store-last-hidden
    assert read_manifest(out).header["extras"]["last_hidden"] is False


@pytest.mark.parametrize("codec", ["fp8", "nf4"])
def test_a_lossy_codec_stores_the_imported_states_within_its_error(tiny_world, tmp_path, codec):
    samples = make_samples(4)
    src = write_specforge(tmp_path / "sf", samples)
    out = tmp_path / "cache"
    assert run(*import_args("specforge", src, out, tiny_world["target"], "--codec", codec)).exit_code == 0
    stored = cache_samples(out)
    for i, s in enumerate(samples):
        got, want = stored[i]["hidden"].float(), s.hidden.float()
        assert stored[i]["input_ids"].tolist() == s.ids.tolist()
        cosine = torch.nn.functional.cosine_similarity(got, want, dim=1)
        assert cosine.min() > 0.98, (codec, cosine.min())


# -- resume -----------------------------------------------------------------------------------------


def test_a_rerun_of_a_finished_import_writes_nothing(tiny_world, tmp_path):
    src = write_specforge(tmp_path / "sf", make_samples())
    out = tmp_path / "cache"
    args = import_args("specforge", src, out, tiny_world["target"], "--part-tokens", "80")
    assert run(*args).exit_code == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.name.startswith(".")}
    again = run(*args)
    assert again.exit_code == 0 and "Imported 0 parts" in again.output, again.output
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.name.startswith(".")} == before


def test_an_import_stopped_mid_part_resumes_to_the_cache_an_unstopped_import_writes(tiny_world, tmp_path, monkeypatch):
    from dflash.cache_tools import importers

    samples = make_samples(12)
    src = write_specforge(tmp_path / "sf", samples)
    options = ImportOptions(format="specforge", target_layer_ids=LAYERS, part_tokens=70)
    whole = import_cache(src, tmp_path / "whole", target_model=tiny_world["target"], options=options)

    real_read, reads = importers.SpecForgeSource.read, []

    def stopping_read(self, sample, *, shape_only=False):
        if not shape_only:
            reads.append(sample.sample_id)
            if len(reads) == 7:  # inside a part, after others were committed
                raise Interrupted(2)
        return real_read(self, sample, shape_only=shape_only)

    monkeypatch.setattr(importers.SpecForgeSource, "read", stopping_read)
    with pytest.raises(Interrupted):
        import_cache(src, tmp_path / "stopped", target_model=tiny_world["target"], options=options)
    stopped = read_manifest(tmp_path / "stopped")
    assert 0 < len(stopped.parts) < len(whole.written)
    unfinished = run("verify", tmp_path / "stopped")
    assert unfinished.exit_code == 0 and "planned: unfinished" in unfinished.output
    from conftest import tiny_train_config
    from dflash.train.config import TrainConfigError
    from dflash.train.data.caches import open_training_data

    with pytest.raises(TrainConfigError) as refused:  # the trainer names the command that finishes it
        open_training_data(tiny_train_config(tmp_path / "stopped", tiny_world["target"], tmp_path / "run"),
                           rank=0, world_size=1, pin_memory=False)
    assert refused.value.code == "train.cache-unfinished" and refused.value.fields["cache"] == str(tmp_path / "stopped")
    assert refused.value.fields["writer"] == "dflash-cache import"
    monkeypatch.setattr(importers.SpecForgeSource, "read", real_read)
    resumed = import_cache(src, tmp_path / "stopped", target_model=tiny_world["target"], options=options)
    assert resumed.skipped == [p.name for p in stopped.parts] and len(resumed.written) + len(resumed.skipped) == len(whole.written)
    a, b = read_manifest(tmp_path / "whole"), read_manifest(tmp_path / "stopped")
    assert [(p.name, p.sample_ids, p.lengths, p.split_keys) for p in a.parts] == \
        sorted((p.name, p.sample_ids, p.lengths, p.split_keys) for p in b.parts)
    assert_same_as(dict(enumerate(samples)), tmp_path / "stopped")


KILLED_IMPORT = """
import sys, time
from dflash.cache_tools import importers
from dflash.cache_tools.importing import ImportOptions, import_cache

real = importers.SpecForgeSource.read

def held(self, sample, *, shape_only=False):
    if not shape_only and sample.sample_id >= int(sys.argv[4]):
        time.sleep(600)  # inside a part: held here until the test kills the process
    return real(self, sample, shape_only=shape_only)

importers.SpecForgeSource.read = held
import_cache(sys.argv[1], sys.argv[2], target_model=sys.argv[3],
             options=ImportOptions(format="specforge", target_layer_ids=[1, 2], part_tokens=70))
"""


def test_an_import_killed_mid_part_resumes_to_the_cache_an_unkilled_import_writes(tiny_world, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    samples = make_samples(12)
    src = write_specforge(tmp_path / "sf", samples)
    whole = tmp_path / "whole"
    options = ImportOptions(format="specforge", target_layer_ids=LAYERS, part_tokens=70)
    import_cache(src, whole, target_model=tiny_world["target"], options=options)
    plan = json.loads((whole / "manifest.plan.json").read_text())["parts"]
    hold = plan[2]["sample_ids"][1]  # the second sample of the third part
    out = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_IMPORT, str(src), str(out), str(tiny_world["target"]),
                             str(hold)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log = out / "manifest.parts.jsonl"
    deadline = time.monotonic() + 120
    while not (log.exists() and log.read_text().count("\n") == 2 and list((out / "parts").glob(".tmp-part-000002*"))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert list((out / "parts").glob(".tmp-*"))  # the part it was writing, left behind
    resumed = run(*import_args("specforge", src, out, tiny_world["target"], "--part-tokens", "70"))
    assert resumed.exit_code == 0 and f"Imported {len(plan) - 2} parts, 2 already present" in resumed.output, \
        resumed.output
    assert not list((out / "parts").glob(".tmp-*"))
    a, b = read_manifest(whole), read_manifest(out)
    assert [(p.name, p.sample_ids, p.lengths, p.split_keys) for p in a.parts] == \
        [(p.name, p.sample_ids, p.lengths, p.split_keys) for p in b.parts]
    assert_same_as(dict(enumerate(samples)), out)
    assert run("verify", out).exit_code == 0


def test_a_resume_with_other_layer_ids_is_refused(tiny_world, tmp_path):
    src = write_specforge(tmp_path / "sf", make_samples(3))
    out = tmp_path / "cache"
    assert run(*import_args("specforge", src, out, tiny_world["target"])).exit_code == 0
    other = run("import", src, out, "--format", "specforge", "--target-model", tiny_world["target"],
                "--target-layer-ids", "0,2", "--no-progress")
    assert other.exit_code == 2 and "target_layer_ids" in other.output


def test_a_source_that_gained_a_file_since_the_import_is_refused_and_imported_anew_with_force(tiny_world, tmp_path):
    samples = make_samples(4)
    src = write_specforge(tmp_path / "sf", samples[:3])
    out = tmp_path / "cache"
    assert run(*import_args("specforge", src, out, tiny_world["target"])).exit_code == 0
    write_specforge(src, samples[3:], first=3)
    refused = run(*import_args("specforge", src, out, tiny_world["target"]))
    assert refused.exit_code == 2 and "data.sha256" in refused.output, refused.output
    assert run(*import_args("specforge", src, out, tiny_world["target"], "--force")).exit_code == 0
    assert_same_as(dict(enumerate(samples)), out)


# -- bad files ----------------------------------------------------------------------------------------


def test_a_truncated_sample_file_is_named_and_skipped_with_skip_bad(tiny_world, tmp_path):
    samples = make_samples(6)
    src = write_specforge(tmp_path / "sf", samples)
    bad = src / "rows_0-2000" / "data_4.ckpt"
    bad.write_bytes(bad.read_bytes()[:300])
    refused = run(*import_args("specforge", src, tmp_path / "cache", tiny_world["target"]))
    assert refused.exit_code == 2 and str(bad) in refused.output and "Traceback" not in refused.output
    assert not (tmp_path / "cache" / "manifest.json").exists()  # refused before the cache was created
    skipped = run(*import_args("specforge", src, tmp_path / "cache", tiny_world["target"], "--skip-bad"))
    assert skipped.exit_code == 0 and "Skipped 1 bad sample file(s)" in skipped.output, skipped.output
    assert_same_as({i: s for i, s in enumerate(samples) if i != 4}, tmp_path / "cache")
    stats = [p.stats.get("skipped_bad", 0) for p in read_manifest(tmp_path / "cache").parts]
    assert sum(stats) == 1
    report = import_cache(src, tmp_path / "again", target_model=tiny_world["target"],
                          options=ImportOptions(format="specforge", target_layer_ids=LAYERS, skip_bad=True))
    assert [(path, problem.fields["file"]) for path, problem in report.bad] == [(bad, str(bad))]
    assert report.bad[0][1].code.startswith("cache.")  # the file's finding, kept as data


@pytest.mark.parametrize("damage,key,code", [
    ("rows", "hidden states", "cache.sample-rows"),  # the hidden states are of another token count
    ("mask", "loss_mask", "cache.sample-mask-length"),
    ("vocab", "input_ids", "cache.sample-token-outside"),
    ("keys", None, "cache.specforge-keys"),
    ("nan", "hidden states", "cache.sample-not-finite"),
])
def test_a_sample_whose_parts_disagree_is_refused_naming_the_file_and_key(tiny_world, tmp_path, damage, key, code):
    samples = make_samples(3)
    src = write_specforge(tmp_path / "sf", samples)
    path = src / "rows_0-2000" / "data_1.ckpt"
    record = torch.load(path)
    if damage == "rows":
        record["hidden_states"] = record["hidden_states"][:, 1:]
    elif damage == "mask":
        record["loss_mask"] = record["loss_mask"][:-1]
    elif damage == "vocab":
        record["input_ids"][2] = WORLD_VOCAB
    elif damage == "nan":
        record["hidden_states"][0, 3, 5] = float("nan")
    else:
        record["aux"] = record.pop("hidden_states")
    torch.save(record, path)
    with pytest.raises(BadSampleFile) as caught:
        import_cache(src, tmp_path / "cache", target_model=tiny_world["target"],
                     options=ImportOptions(format="specforge", target_layer_ids=LAYERS))
    assert caught.value.path == path and caught.value.key == key
    assert caught.value.code == code and caught.value.fields["file"] == str(path)
    assert caught.value.fields.get("planned", False) == (damage == "nan")  # found once the import was planned


def test_speculators_token_ids_of_another_row_are_refused(tiny_world, tmp_path):
    samples = make_samples(3)
    src = write_speculators(tmp_path / "spec", samples)
    shutil.copy(src / "hidden_states" / "hs_0.safetensors", src / "hidden_states" / "hs_2.safetensors")
    result = run(*import_args("speculators", src, tmp_path / "cache", tiny_world["target"]))
    assert result.exit_code == 2 and "hs_2.safetensors" in result.output and "token_ids" in result.output


@pytest.mark.parametrize("flags,fragment", [
    (["--target-layer-ids", "2,1"], "ascending"),
    (["--target-layer-ids", "1,3"], "N-2"),
    (["--target-layer-ids", "1"], "data_0.ckpt"),  # the files hold two layers
    ([], "--source-layer-ids"),
])
def test_layer_ids_that_do_not_fit_the_files_or_the_target_are_refused(tiny_world, tmp_path, flags, fragment):
    src = write_specforge(tmp_path / "sf", make_samples(2))
    result = run("import", src, tmp_path / "cache", "--format", "specforge", "--target-model", tiny_world["target"],
                 "--no-progress", *flags)
    assert result.exit_code == 2 and fragment in result.output, result.output
    assert not (tmp_path / "cache").exists()


def test_speculators_ids_in_our_numbering_given_as_its_own_are_refused_by_the_count(tiny_world, tmp_path):
    src = write_speculators(tmp_path / "spec", make_samples(2))
    result = run("import", src, tmp_path / "cache", "--format", "speculators", "--target-model",
                 tiny_world["target"], "--source-layer-ids", "1,2", "--no-progress")
    assert result.exit_code == 2 and "hs_0.safetensors" in result.output and "3 layers" in result.output


# -- training ---------------------------------------------------------------------------------------


def our_cache(path: Path, samples: dict[int, Sample], target: Path) -> Path:
    """The cache our writer makes of the same arrays, as an extraction would (prompt split keys)."""
    header = make_header(target=read_target(target).identity, target_layer_ids=LAYERS, hidden_size=HIDDEN,
                         codec=HiddenCodec(name="bf16"), data={"name": "ours"})
    writer = CacheWriter(path, header)
    ids = sorted(samples)
    for p in range(3):
        with writer.part_writer(f"part-{p:06d}") as pw:
            for sid in ids[p::3]:
                s = samples[sid]
                pw.add_sample(sid, s.ids, s.mask, s.hidden, split_key=prompt_split_key(s.ids.numpy(), s.mask.numpy()))
    writer.close()
    return path


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_training_on_an_imported_cache_gives_the_weights_of_training_on_our_cache(tiny_world, tmp_path, fmt):
    from dflash.train.run.loop import train

    samples = make_samples(12, seed=3)
    if fmt == "specforge":
        src = write_specforge(tmp_path / "src", samples)
    else:
        src = write_speculators(tmp_path / "src", samples)
    imported = tmp_path / "imported"
    assert run(*import_args(fmt, src, imported, tiny_world["target"], "--part-tokens", "100")).exit_code == 0
    ours = our_cache(tmp_path / "ours", dict(enumerate(samples)), tiny_world["target"])
    weights = []
    for cache in (imported, ours):
        out = tmp_path / f"run-{cache.name}"
        result = train(tiny_train_config(cache, tiny_world["target"], out, max_steps=6, epochs=2, save_interval=3,
                                         eval_fraction=0.25, eval_interval=3))
        assert result.exit_status == 0
        weights.append(final_weights(out))
    assert_same_weights(*weights)


def test_training_on_an_import_of_our_extractions_states_gives_the_weights_of_training_on_the_extraction(
        tiny_world, tmp_path):
    """The peer's files hold exactly what our extraction computed for the same data and target (as
    SpecForge would write them): the import trains to the same weights as the extraction."""
    from conftest import random_records, write_jsonl
    from dflash.extract.config import ExtractConfig
    from dflash.extract.pipeline import run_extraction
    from dflash.train.run.loop import train

    records = [r for r in random_records(16, seed=5, min_len=12, max_len=40)]
    for r in records:
        r["input_ids"] = [i % WORLD_VOCAB for i in r["input_ids"]]
    extracted = tmp_path / "extracted"
    run_extraction(ExtractConfig(target_model=str(tiny_world["target"]), data=str(write_jsonl(tmp_path / "d.jsonl", records)),
                                 output=str(extracted), dtype="bf16", target_layer_ids=LAYERS, store_topk=0,
                                 store_top1=False, part_tokens=150, progress=False, num_writers=0))
    states = {sid: Sample(s["input_ids"].to(torch.int64), s["loss_mask"].to(torch.int64), s["hidden"], s["hidden"][:, :0])
              for sid, s in cache_samples(extracted).items()}
    src = tmp_path / "sf"
    for sid, s in states.items():
        write_specforge(src, [s], first=sid)
    imported = tmp_path / "imported"
    assert run(*import_args("specforge", src, imported, tiny_world["target"])).exit_code == 0
    weights = []
    for cache in (extracted, imported):
        out = tmp_path / f"run-{cache.name}"
        result = train(tiny_train_config(cache, tiny_world["target"], out, max_steps=6, epochs=2, save_interval=3,
                                         eval_fraction=0.25, eval_interval=3))
        assert result.exit_status == 0
        weights.append(final_weights(out))
    assert_same_weights(*weights)


# -- a third format is one registration -----------------------------------------------------------


def test_a_format_registered_from_outside_is_imported_like_the_others(tiny_world, tmp_path):
    @register_source
    @dataclass
    class NpzSource(SampleSource):
        name: ClassVar[str] = "toy-npz"
        layer_ids_help: ClassVar[str] = "as ours"

        def scan(self):
            return [SampleFile(int(p.stem), p) for p in sorted(self.src.glob("*.npz"), key=lambda p: int(p.stem))]

        def read(self, sample, *, shape_only=False):
            z = np.load(sample.path)
            hidden = torch.from_numpy(z["hidden"]).to(torch.bfloat16)
            return RawSample(z["ids"], z["mask"], rows=hidden.shape[0], width=hidden.shape[1],
                             hidden=None if shape_only else hidden)

    try:
        samples = make_samples(3)
        (tmp_path / "npz").mkdir()
        for i, s in enumerate(samples):
            np.savez(tmp_path / "npz" / f"{i}.npz", ids=s.ids.numpy(), mask=s.mask.numpy(), hidden=s.hidden.float().numpy())
        result = run("import", tmp_path / "npz", tmp_path / "cache", "--format", "toy-npz", "--target-model",
                     tiny_world["target"], "--target-layer-ids", "1,2", "--no-progress")
        assert result.exit_code == 0, result.output
        assert_same_as(dict(enumerate(samples)), tmp_path / "cache")
    finally:
        SOURCES.pop("toy-npz", None)


def test_an_unknown_format_is_refused_listing_the_registered_ones(tiny_world, tmp_path):
    (tmp_path / "src").mkdir()
    result = run("import", tmp_path / "src", tmp_path / "cache", "--format", "eagle", "--target-model", tiny_world["target"],
                 "--target-layer-ids", "1,2")
    assert result.exit_code == 2 and "specforge" in result.output and "speculators" in result.output


def test_the_format_registry_loads_without_torch():
    import subprocess
    import sys

    script = ("import sys, dflash.cache_tools.importers as m; "
              "print(sorted(m.SOURCES), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['specforge',", "'speculators']", "False"]
