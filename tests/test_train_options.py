"""End-to-end runs of the options no other test drives: `dflash-train export`, --eval-cache,
soft labels from a real extraction, --gradient-checkpointing, --compile on a CPU, and an
extraction's --force given to two ranks."""

from __future__ import annotations

import extract_utils
import pytest
import torch
from click.testing import CliRunner
from conftest import (
    assert_same_weights,
    final_weights,
    random_records,
    read_metrics,
    tiny_train_config,
    write_jsonl,
    write_tiny_cache,
)
from dflash.cache_tools.cache_set import CacheSet
from dflash.cache_tools.manifest import read_manifest
from dflash.runtime.findings import collected
from dflash.train.cli import main as train_main
from dflash.train.config import TrainConfigError
from dflash.train.exports.export import load_drafter
from dflash.train.run.loop import train
from extract_utils import assert_same_contents, cache_contents, make_target
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def soft_caches(tmp_path_factory) -> dict:
    """A 4-layer target and two extractions of it: one with last_hidden, one with top-4 log-probs."""
    root = tmp_path_factory.mktemp("soft")
    target = make_target(root / "target", layers=4)
    data = write_jsonl(root / "data.jsonl", random_records(12, seed=3, min_len=16, max_len=40))
    caches = {}
    for name, extra in {"last_hidden": dict(store_last_hidden=True), "topk": dict(store_topk=4)}.items():
        caches[name] = extract(target, data, root / name, **extra)
    return {"target": target, "data": data, **caches}


def extract(target, data, out, **kw):
    extract_utils.extract(target, data, out, **kw)
    return out


def test_export_command_writes_the_checkpoint_weights_as_a_drafter(tiny_world, tmp_path):
    run = tmp_path / "run"
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=2, save_interval=1))
    step1 = run / "checkpoints" / "step-000001"
    out = tmp_path / "export"
    result = CliRunner().invoke(train_main, ["export", str(step1), str(out), "--dtype", "fp32"])
    assert result.exit_code == 0, result.output
    assert str(out) in result.output
    drafter = load_drafter(out, tiny_world["target"])
    state = drafter.state_dict()
    saved = load_file(str(step1 / "model.safetensors"))
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name
    # The run directory exports its latest checkpoint (step 2, other weights than step 1).
    latest = tmp_path / "latest"
    assert CliRunner().invoke(train_main, ["export", str(run), str(latest), "--dtype", "fp32"]).exit_code == 0
    step2 = load_file(str(run / "checkpoints" / "step-000002" / "model.safetensors"))
    reloaded = load_drafter(latest, tiny_world["target"]).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in step2.items())
    assert any(not torch.equal(step2[k], v) for k, v in saved.items())


def test_export_command_refuses_a_directory_without_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(train_main, ["export", str(tmp_path / "empty"), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "not a dflash-train checkpoint" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_eval_cache_is_evaluated_instead_of_a_split_of_the_training_cache(tiny_world, tmp_path, capsys):
    eval_cache = write_tiny_cache(tmp_path / "eval", samples=4, parts=2, seed=9)
    run = tmp_path / "run"
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=2, eval_interval=1,
                            eval_cache=[str(eval_cache)], eval_fraction=0.25))
    assert "48 for training, 4 in --eval-cache" in capsys.readouterr().out
    evals = [m for m in read_metrics(run) if m["kind"] == "eval"]
    assert [m["step"] for m in evals] == [1, 2]
    # A block at every eligible position of the eval cache's 4 samples (positions n//4 .. n-2 of
    # a sample of n tokens: completion tokens with a next one), however small max_anchors is.
    lengths = CacheSet([str(eval_cache)], max_seq_len=64).full_lengths.tolist()
    assert all(m["blocks"] == sum(n - 1 - n // 4 for n in lengths) > 4 * 4 for m in evals)


@pytest.mark.parametrize("source", ["last_hidden", "topk"])
def test_soft_label_training_from_an_extraction_runs_and_changes_the_objective(soft_caches, tmp_path, source):
    cache, target = soft_caches[source], soft_caches["target"]
    assert read_manifest(cache).store_last_hidden == (source == "last_hidden")
    runs = {w: tmp_path / f"w{w}" for w in (0.0, 0.5)}
    for w, run in runs.items():
        result = train(tiny_train_config(cache, target, run, max_steps=2, soft_label_weight=w))
        assert result.step == 2 and (run / "final" / "model.safetensors").exists()
    first = {w: read_metrics(run)[0]["loss"] for w, run in runs.items()}
    # Same init, same batch: the step-1 loss differs only by the KL term.
    assert all(torch.isfinite(torch.tensor(v)) for v in first.values()) and first[0.0] != first[0.5]
    ce, soft = final_weights(runs[0.0]), final_weights(runs[0.5])
    assert any(not torch.equal(ce[k], soft[k]) for k in ce)


def test_soft_labels_default_to_half_where_the_cache_stores_them_and_off_where_it_does_not(soft_caches, tmp_path,
                                                                                           capsys):
    """dflash-extract stores the target's top-8 by default; left out, --soft-label-weight is then
    0.5 (the run trains exactly what an explicit 0.5 trains, and records 0.5), and 0 on a cache
    extracted with --store-topk 0, whose startup summary says how to get them."""
    import json

    target = soft_caches["target"]
    default = extract(target, soft_caches["data"], tmp_path / "default")
    bare = extract(target, soft_caches["data"], tmp_path / "bare", store_topk=0)
    assert read_manifest(default).topk == 8 and read_manifest(bare).topk == 0

    def run(cache, name, **kw):
        out = tmp_path / name
        train(tiny_train_config(cache, target, out, max_steps=2, save_interval=2, **kw))
        meta = json.loads((sorted((out / "checkpoints").glob("step-*"))[-1] / "meta.json").read_text())
        return out, meta["config"]["soft_label_weight"], capsys.readouterr().out

    auto, weight, said = run(default, "auto")
    assert weight == 0.5 and "soft labels: weight 0.5, from the target's top-8 log-probs" in said
    explicit, weight, _ = run(default, "explicit", soft_label_weight=0.5)
    assert_same_weights(final_weights(auto), final_weights(explicit))
    off, weight, said = run(default, "off", soft_label_weight=0.0)
    assert weight == 0.0 and "soft labels: off (--soft-label-weight 0)" in said
    assert any(not torch.equal(a, b) for a, b in zip(final_weights(off).values(), final_weights(auto).values()))
    _, weight, said = run(bare, "bare")
    assert weight == 0.0 and "the cache stores no top-k log-probs" in said and "--store-topk" in said


def test_a_dflash2_run_on_a_default_extraction_trains_with_the_soft_labels_beside_its_selector(soft_caches, tmp_path):
    """DFlash2 on dflash-extract's default cache (top-8): the KL of the soft labels joins the
    selector's loss; the run trains, records weight 0.5, and moves other weights than without."""
    import json

    cache = extract(soft_caches["target"], soft_caches["data"], tmp_path / "cache")
    runs = {}
    for name, kw in {"auto": {}, "off": {"soft_label_weight": 0.0}}.items():
        runs[name] = tmp_path / name
        result = train(tiny_train_config(cache, soft_caches["target"], runs[name], max_steps=2, save_interval=2,
                                         drafter_type="dflash2", selector_rank=8, selector_top_k=4,
                                         conv_group_size=8, **kw))
        assert result.exit_status == 0
    meta = json.loads((runs["auto"] / "checkpoints" / "step-000002" / "meta.json").read_text())
    assert meta["config"]["soft_label_weight"] == 0.5
    losses = {n: [m["loss"] for m in read_metrics(r) if m["kind"] == "train"] for n, r in runs.items()}
    assert all(torch.isfinite(torch.tensor(v)).all() for v in losses.values()) and losses["auto"] != losses["off"]


def test_gradient_checkpointing_trains_the_same_weights(tiny_world, tmp_path):
    runs = {flag: tmp_path / f"gc-{flag}" for flag in (False, True)}
    for flag, run in runs.items():
        train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=3, save_interval=3,
                                gradient_checkpointing=flag))
    # Recomputing a layer's forward in the backward gives the same gradients, to the bit.
    assert_same_weights(final_weights(runs[True]), final_weights(runs[False]))


@pytest.mark.slow
def test_compile_on_cpu_trains_what_eager_trains(tiny_world, tmp_path):
    """torch.compile (inductor, C++ on a CPU) of each draft layer: one step, compared with eager."""
    from torch._dynamo.utils import counters

    counters.clear()
    runs = {flag: tmp_path / f"compile-{flag}" for flag in (False, True)}
    for flag, run in runs.items():
        train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, max_steps=1, save_interval=1,
                                compile=flag))
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo captured the layers (no silent eager run)
    eager, compiled = final_weights(runs[False]), final_weights(runs[True])
    assert read_metrics(runs[True])[0]["loss"] == pytest.approx(read_metrics(runs[False])[0]["loss"], rel=1e-4)
    for k in eager:  # fused kernels sum in another order: equal up to float32 rounding
        torch.testing.assert_close(compiled[k], eager[k], rtol=1e-4, atol=1e-5)


def test_force_given_to_two_ranks_wipes_the_old_cache_once(soft_caches, tmp_path):
    """Rank 0 deletes the cache written with other settings; rank 1's --force must not delete the
    parts rank 0 has committed since: together they hold what one clean run writes."""
    target, data = soft_caches["target"], soft_caches["data"]
    out = extract(target, write_jsonl(tmp_path / "old.jsonl", random_records(6, seed=8)), tmp_path / "cache")
    clean = extract(target, data, tmp_path / "clean")
    first = extract(target, data, out, force=True, rank=0, world_size=2)
    rank0_parts = {p.name for p in read_manifest(first).parts}
    assert rank0_parts and all(int(p[-6:]) % 2 == 0 for p in rank0_parts)
    extract(target, data, out, force=True, rank=1, world_size=2)
    assert rank0_parts < {p.name for p in read_manifest(out).parts}
    assert_same_contents(cache_contents(out), cache_contents(clean))


def test_acceptance_loss_weighting_and_wsd_schedule_train_and_change_the_run(tiny_world, tmp_path):
    runs = {"decay": {"loss_weighting": "decay", "lr_schedule": "cosine"}, "acceptance": {"lr_schedule": "cosine"},
            "wsd": {"loss_weighting": "decay"}}  # acceptance weighting and wsd are the defaults
    records = {}
    for name, options in runs.items():
        train(tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / name, max_steps=4,
                                eval_fraction=0.0, **options))
        records[name] = [r for r in read_metrics(tmp_path / name) if r["kind"] == "train"]
    # --gamma belongs to the decay weighting: with the default (acceptance) it is refused, not ignored.
    with pytest.raises(TrainConfigError) as refused:
        tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "g", gamma=3.0)
    assert refused.value.code == "train.gamma-without-decay" and refused.value.fields["gamma"] == 3.0
    assert tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "g", gamma=3.0,
                             loss_weighting="decay").objective.gamma == 3.0
    # Same init, same batches: the weighting changes the first step's loss, the schedule its lr.
    assert records["acceptance"][0]["loss"] != records["decay"][0]["loss"]
    assert records["wsd"][0]["loss"] == records["decay"][0]["loss"]
    assert records["wsd"][2]["lr"] > records["decay"][2]["lr"]  # held at the peak, not decaying yet


def test_the_target_label_trains_from_a_default_extraction_and_is_refused_without_a_top1(soft_caches, tmp_path,
                                                                                          capsys):
    """--hard-label target on dflash-extract's default cache (its top-8): the run trains other
    weights than the sample labels, records the setting and says where its labels come from; on
    a cache with neither top-k nor top-1 it stops before training, naming both fixes."""
    import json

    from dflash.runtime.errors import InputError

    target = soft_caches["target"]
    default = extract(target, soft_caches["data"], tmp_path / "default")
    runs = {label: tmp_path / label for label in ("sample", "target")}
    for label, out in runs.items():
        train(tiny_train_config(default, target, out, max_steps=2, save_interval=2, hard_label=label))
    said = capsys.readouterr().out
    assert "hard labels: the target's top-1 (the first of its top-8 in the cache)" in said
    meta = json.loads((runs["target"] / "checkpoints" / "step-000002" / "meta.json").read_text())
    assert meta["config"]["hard_label"] == "target"
    assert any(not torch.equal(a, b) for a, b in zip(final_weights(runs["sample"]).values(),
                                                     final_weights(runs["target"]).values()))
    bare = extract(target, soft_caches["data"], tmp_path / "bare", store_topk=0, store_top1=False)
    # The held-out evaluation scores the same labels (an eval cache shares the training caches'
    # top-k, or is refused as another extraction) and walks greedy verification as ever.
    evaluated = tmp_path / "evaluated"
    train(tiny_train_config(default, target, evaluated, max_steps=2, eval_interval=1, hard_label="target",
                            eval_fraction=0.25))
    evals = [m for m in read_metrics(evaluated) if m["kind"] == "eval"]
    assert len(evals) == 2 and all(m["heldout_tau"] >= 1.0 and m["estimator"] for m in evals)
    with pytest.raises(InputError) as e:
        train(tiny_train_config(bare, target, tmp_path / "bare-run", max_steps=2, hard_label="target"))
    assert e.value.code == "train.hard-label-target-without-top1"  # renders the fixes: --hard-label sample, extract
    assert e.value.fields == {"cache": str(bare), "flag": "--hard-label"}
    assert not (tmp_path / "bare-run" / "checkpoints").exists()


DFLASH2_TINY = dict(drafter_type="dflash2", selector_rank=8, selector_top_k=4, conv_group_size=8, conv_kernel_size=2)


def test_a_dflash2_run_trains_toward_the_targets_top1_by_default_where_the_cache_has_it(soft_caches, tmp_path,
                                                                                         capsys):
    """The default --hard-label: target for DFlash2 on a cache with the target's top-k (what it
    records, trains and says), sample for DFlash and for a DFlash2 on a cache without a top-1 (not
    refused); a DFlash2 run begun under the former default (sample) and resumed by the same command
    is told how to finish as it started."""
    import json

    target = soft_caches["target"]
    default = extract(target, soft_caches["data"], tmp_path / "default")
    bare = extract(target, soft_caches["data"], tmp_path / "bare", store_topk=0, store_top1=False)
    runs = {"dflash2": (default, DFLASH2_TINY), "dflash2-bare": (bare, DFLASH2_TINY), "dflash": (default, {"drafter_type": "dflash"}),
            "dflash2-sample": (default, {**DFLASH2_TINY, "hard_label": "sample"})}
    said = {}
    for name, (cache, kw) in runs.items():
        train(tiny_train_config(cache, target, tmp_path / name, max_steps=2, save_interval=2, **kw))
        said[name] = capsys.readouterr().out
    recorded = {name: json.loads((tmp_path / name / "checkpoints" / "step-000002" / "meta.json").read_text())
                ["config"]["hard_label"] for name in runs}
    assert recorded == {"dflash2": "target", "dflash2-bare": "sample", "dflash": "sample", "dflash2-sample": "sample"}
    assert "hard labels: the target's top-1" in said["dflash2"]
    assert all("hard labels" not in said[name] for name in ("dflash2-bare", "dflash", "dflash2-sample"))
    # The default's labels are the explicit target's: the same weights as --hard-label target.
    train(tiny_train_config(default, target, tmp_path / "explicit", max_steps=2, save_interval=2, hard_label="target",
                            **DFLASH2_TINY))
    capsys.readouterr()
    assert_same_weights(final_weights(tmp_path / "explicit"), final_weights(tmp_path / "dflash2"))
    assert any(not torch.equal(a, b) for a, b in zip(final_weights(tmp_path / "dflash2").values(),
                                                     final_weights(tmp_path / "dflash2-sample").values()))
    with collected() as resumed:
        train(tiny_train_config(default, target, tmp_path / "dflash2-sample", max_steps=3, save_interval=3,
                                **DFLASH2_TINY))
    changed = [f.fields for f in resumed if f.code == "train.resume-settings-changed"]
    assert len(changed) == 1 and ["hard_label", "sample", "target"] in changed[0]["changes"]
    assert ["hard_label", "sample"] in changed[0]["former_defaults"]  # rendered: rerun with --hard-label sample


def test_a_run_says_which_drafter_it_trains_and_how_the_engines_load_it(tiny_world, tmp_path, capsys):
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "default", max_steps=1))
    default = capsys.readouterr().out
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "dflash", max_steps=1,
                            drafter_type="dflash"))
    plain = capsys.readouterr().out
    assert "drafter: DFlash2 (1 layer(s), block 4, target layers [1, 2]), exported as DFlash2DraftModel" in default
    assert "convolutions of 2 taps, group 16; selector top-16, rank 256" in default
    assert "drafter: DFlash (1 layer(s), block 4, target layers [1, 2]), exported as DFlashDraftModel" in plain
    assert "DFlash2" not in plain.split("drafter: ", 1)[1].splitlines()[0]


def test_the_default_loader_workers_fit_the_cores_each_process_may_use(monkeypatch):
    from dflash.train.config import TrainConfig, default_num_workers

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(2)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert TrainConfig.from_dict(dict(cache=["c"], target_model="m", output_dir="o")).data.num_workers == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    assert default_num_workers() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")  # 4 cores per process under torchrun
    assert default_num_workers() == 3
    assert TrainConfig.from_dict(dict(cache=["c"], target_model="m", output_dir="o", num_workers=0)).data.num_workers == 0
