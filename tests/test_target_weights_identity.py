"""The target's identity covers its weights (issue #33, bug 11: resuming with a target of the
same config.json but other weights was accepted silently, and the cache ended half from one
model and half from the other; train and eval with that target passed silently too).

Each weight file's sha256 is computed once and reused while its size and mtime hold (kept in
the user's cache directory, never in the model directory); it joins the target identity, so an
extraction or a training run resumed with other weights is refused naming both, training on a
cache of other weights is warned about, and caches or checkpoints older than the hash are
accepted with a note."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner
from conftest import random_records, tiny_train_config, write_jsonl
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.identity import weights_hash, weights_hashes_path
from dflash.cache_tools.manifest import HEADER_FILE, read_manifest
from dflash.runtime.errors import MismatchError
from dflash.runtime.findings import collected
from dflash.train.run.checkpoint import export_checkpoint
from dflash.train.run.loop import train
from extract_utils import extract, make_target


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two tiny targets of one config.json and other weights, a cache extracted from the first."""
    root = tmp_path_factory.mktemp("weights")
    first = make_target(root / "first", layers=4, seed=0)
    second = make_target(root / "second", layers=4, seed=1)
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()
    data = write_jsonl(root / "data.jsonl", random_records(12, seed=4, max_len=40))
    extract(first, data, root / "cache")
    return {"root": root, "first": first, "second": second, "data": data}


def test_a_weight_file_is_hashed_once_and_reused_while_its_size_and_mtime_hold(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    model = make_target(tmp_path / "m", layers=4)
    listing = sorted(os.listdir(model))
    real = weights_hash(model)
    known = json.loads(weights_hashes_path().read_text())
    entry = known[str((model / "model.safetensors").resolve())]
    assert sorted(os.listdir(model)) == listing  # nothing written into the model directory
    entry["sha256"] = "0" * 64  # a stand-in: a second call must take it instead of rehashing
    weights_hashes_path().write_text(json.dumps(known))
    assert weights_hash(model) not in (real, None)
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # touched: rehashed
    assert weights_hash(model) == real
    weights_hashes_path().write_text("not json")  # a damaged hash file costs a rehash, never an error
    assert weights_hash(model) == real


def test_resuming_an_extraction_or_merging_with_other_weights_is_refused_naming_both(two_models, tmp_path):
    with pytest.raises(MismatchError) as err:
        extract(two_models["second"], two_models["data"], two_models["root"] / "cache")
    assert err.value.code == "cache.settings-differ" and err.value.fields["cache"] == str(two_models["root"] / "cache")
    assert [key for key, _cache, _requested in err.value.fields["differences"]] == ["target.weights_hash"]
    assert err.value.fields["target_paths"] == [str(two_models["first"].resolve()), str(two_models["second"].resolve())]
    extract(two_models["second"], two_models["data"], tmp_path / "other")
    res = CliRunner().invoke(cache_main, ["merge", str(tmp_path / "merged"), str(two_models["root"] / "cache"),
                                          str(tmp_path / "other"), "--no-progress"])
    assert res.exit_code == 2 and "target.weights_hash" in res.output


def test_training_warns_on_a_cache_of_other_weights_and_refuses_to_resume_with_them(two_models, tmp_path):
    cache, run = two_models["root"] / "cache", tmp_path / "run"
    settings = dict(epochs=1, save_interval=1, eval_fraction=0.0)
    with collected() as said:
        assert train(tiny_train_config(cache, two_models["second"], run, max_steps=1, **settings)).step == 1
    differ = [f.fields for f in said if f.code == "cache.target-weights-differ"]
    assert len(differ) == 1 and (differ[0]["cache"], differ[0]["target"]) == (str(cache), str(two_models["second"]))
    with pytest.raises(MismatchError) as err:
        train(tiny_train_config(cache, two_models["first"], run, max_steps=2, resume=True, **settings))
    assert err.value.code == "train.resume-other-run"
    assert err.value.fields["checkpoint"] == str(run / "checkpoints" / "step-000001")
    [[key, in_checkpoint, in_this_run]] = err.value.fields["differences"]  # [key, the checkpoint's, this run's]
    assert key == "target.weights_hash" and in_checkpoint != in_this_run
    assert in_this_run == repr(read_manifest(cache).header["target"]["weights_hash"])  # the first's, as the cache
    with collected() as said:
        assert train(tiny_train_config(cache, two_models["first"], tmp_path / "run2", max_steps=1, **settings)).step == 1
    assert "cache.target-weights-differ" not in [f.code for f in said]
    # dflash-train estimate says it too, in its line and its JSON
    from dflash.train.measure.estimate import estimate_drafter, format_estimate

    export = tmp_path / "export"
    export_checkpoint(next((run / "checkpoints").glob("step-*")), export)
    estimated = estimate_drafter(str(export), {"cache": [str(cache)], "target_model": str(two_models["second"]),
                                               "num_workers": 0, "block_size": 4, "eval_fraction": 0.0})
    assert "cache.target-weights-differ" in estimated["note_codes"]
    assert len(estimated["note_codes"]) == len(estimated["notes"])
    assert f"Note: The cache at {cache} has other weights" in format_estimate(estimated)



def test_estimate_with_another_target_than_the_drafter_was_trained_against_says_so(two_models, tmp_path):
    from dflash.train.measure.estimate import estimate_drafter, format_estimate

    cache, run = two_models["root"] / "cache", tmp_path / "run"
    train(tiny_train_config(cache, two_models["first"], run, max_steps=1, epochs=1, eval_fraction=0.0))
    settings = {"cache": [str(cache)], "num_workers": 0, "block_size": 4, "eval_fraction": 0.0}
    mine = estimate_drafter(str(run / "final"), {**settings, "target_model": str(two_models["first"])})
    assert "train.drafter-other-target" not in mine.get("note_codes", [])
    other = estimate_drafter(str(run / "final"), {**settings, "target_model": str(two_models["second"])})
    assert "train.drafter-other-target" in other["note_codes"]
    said = f"Note: The drafter {run / 'final'} was trained against another target ({two_models['first'].resolve()}) "
    assert said + f"than {two_models['second'].resolve()}: weights_hash " in format_estimate(other)

def test_a_cache_and_a_checkpoint_older_than_the_weights_hash_are_accepted_with_a_note(two_models, tmp_path):
    cache = shutil.copytree(two_models["root"] / "cache", tmp_path / "old-cache")
    header = json.loads((cache / HEADER_FILE).read_text())
    del header["target"]["weights_hash"]
    (cache / HEADER_FILE).write_text(json.dumps(header))
    summary = extract(two_models["first"], two_models["data"], cache)
    assert summary.parts_written == 0
    assert [(n.code, n.fields) for n in summary.notes if n.code == "cache.target-weights-unrecorded"] == [
        ("cache.target-weights-unrecorded", {"purpose": "cache", "path": str(cache)})]
    run, settings = tmp_path / "run", dict(epochs=1, save_interval=1, eval_fraction=0.0)
    train(tiny_train_config(cache, two_models["first"], run, max_steps=1, **settings))
    meta_path = next((run / "checkpoints").glob("step-*")) / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["identity"]["target"]["weights_hash"]
    meta_path.write_text(json.dumps(meta))
    with collected() as said:
        assert train(tiny_train_config(cache, two_models["first"], run, max_steps=2, resume=True, **settings)).step == 2
    assert {(f.fields["purpose"], f.fields["path"]) for f in said if f.code == "cache.target-weights-unrecorded"} == {
        ("cache", str(cache)), ("checkpoint", str(meta_path.parent))}
