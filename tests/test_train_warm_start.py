"""--init-drafter: a run starts from an exported drafter's weights (a warm start), and refuses one
of another shape with the flag to change."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_train_config
from dflash.runtime.errors import InputError
from dflash.runtime.findings import Finding, collected


@pytest.fixture(scope="module")
def exported(tiny_world, tmp_path_factory):
    """A drafter trained a few steps and exported (the run's final/)."""
    from dflash.train.run.loop import train

    out = tmp_path_factory.mktemp("first") / "run"
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, max_steps=3, eval_fraction=0.3))
    assert result.exit_status == 0 and (out / "final" / "model.safetensors").is_file()
    return out / "final"


def built(tiny_world, tmp_path, **overrides):
    from dflash.train.data.caches import open_training_data
    from dflash.train.run.loop import build_drafter

    cfg = tiny_train_config(tiny_world["cache"], tiny_world["target"], tmp_path / "run", compile=False, **overrides)
    data = open_training_data(cfg, rank=0, world_size=1, pin_memory=False)
    try:
        notes = []
        return build_drafter(cfg, data, announce=notes.append), notes
    finally:
        data.loader.close()


def test_the_run_starts_from_the_exported_weights(tiny_world, tmp_path, exported):
    from dflash.train.exports.export import read_export_weights

    fresh, _ = built(tiny_world, tmp_path)
    warm, notes = built(tiny_world, tmp_path, init_drafter=str(exported))
    saved = read_export_weights(exported)
    own = warm.state_dict()
    assert saved and all(torch.equal(own[k], v.to(own[k].dtype)) for k, v in saved.items())
    assert any(not torch.equal(fresh.state_dict()[k], own[k]) for k in saved)  # not the random init
    assert any("warm start" in n and str(exported) in n for n in notes)


def test_a_warm_started_run_trains_and_exports(tiny_world, tmp_path, exported):
    from dflash.train.run.loop import train

    out = tmp_path / "warm"
    result = train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, max_steps=2, eval_fraction=0.3,
                                     init_drafter=str(exported)))
    assert result.exit_status == 0 and (out / "final" / "config.json").is_file()


@pytest.mark.parametrize("overrides, said", [
    ({"num_draft_layers": 2}, ("--num-draft-layers", 2, 1)),
    ({"mask_token_id": 5}, ("--mask-token-id", 5)),  # the block size may differ (tests/test_warm_start_layouts.py)
    ({"drafter_type": "dflash"}, ("--drafter-type", "dflash", "dflash2")),  # the export is of the default type
])
def test_an_export_of_another_shape_is_refused_with_the_flag_to_change(tiny_world, tmp_path, exported, overrides, said):
    with pytest.raises(InputError) as e:
        built(tiny_world, tmp_path, init_drafter=str(exported), **overrides)
    assert e.value.code == "train.init-drafter-misfit" and e.value.fields["init"] == str(exported)
    assert [tuple(s)[:len(said)] for s in e.value.fields["settings"]] == [said]


def test_a_directory_that_is_no_export_says_how_to_make_one(tiny_world, tmp_path):
    (tmp_path / "checkpoint").mkdir()
    with pytest.raises(InputError) as e:
        built(tiny_world, tmp_path, init_drafter=str(tmp_path / "checkpoint"))
    assert e.value.code == "train.init-drafter-missing" and e.value.fields["init"] == str(tmp_path / "checkpoint")
    assert e.value.fields["cause"] == Finding("train.drafter-no-config", dir=str(tmp_path / "checkpoint"))
    # (train.init-drafter-missing renders how to make an export: dflash-train export CHECKPOINT OUT_DIR)


def test_a_dflash2_run_starts_from_a_dflash2_export(tiny_world, tmp_path):
    from dflash.train.exports.export import read_export_weights
    from dflash.train.run.loop import train

    d2 = {"drafter_type": "dflash2", "selector_rank": 8, "selector_top_k": 4, "conv_group_size": 8}
    out = tmp_path / "d2"
    assert train(tiny_train_config(tiny_world["cache"], tiny_world["target"], out, max_steps=2, eval_fraction=0.3,
                                   **d2)).exit_status == 0
    warm, _ = built(tiny_world, tmp_path, init_drafter=str(out / "final"), **d2)
    saved, own = read_export_weights(out / "final"), warm.state_dict()
    assert any("candidate_selector" in k for k in saved) and any("conv" in k for k in saved)
    assert all(torch.equal(own[k], v.to(own[k].dtype)) for k, v in saved.items())


def test_a_dflash2_run_starts_from_a_dflash_drafter_with_exactly_its_predictions(tiny_world, tmp_path):
    """The DFlash2 parts start where a fresh DFlash2 starts (identity convolutions, selector edges
    at 0): a warm start from a DFlash export gives that export's logits, and its selector's walk
    picks the backbone's top-1."""
    from conftest import HIDDEN, LAYERS, WORLD_VOCAB
    from dflash.train.exports.export import load_drafter
    from dflash.train.run.loop import train
    from test_drafter_export import block_logits

    run = tmp_path / "dflash"
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], run, drafter_type="dflash", max_steps=3,
                            eval_fraction=0.3))
    upgraded, notes = built(tiny_world, tmp_path, init_drafter=str(run / "final"))
    assert upgraded.config.drafter_type == "dflash2" and upgraded.candidate_selector is not None
    assert any("a DFlash drafter" in n and "starts from that drafter's predictions" in n for n in notes)
    theirs = load_drafter(run / "final", tiny_world["target"], attention_backend="sdpa")
    g = torch.Generator().manual_seed(3)
    batch = {"hidden": torch.randn(2, 16, len(LAYERS) * HIDDEN, generator=g),
             "input_ids": torch.randint(0, WORLD_VOCAB, (2, 16), generator=g),
             "loss_mask": torch.ones(2, 16, dtype=torch.long), "lengths": torch.tensor([16, 11])}
    assert torch.equal(block_logits(upgraded.float(), batch), block_logits(theirs.float(), batch))
    # the other way round keeps the refusal: a DFlash run cannot drop a DFlash2 drafter's parts
    dflash2_run = tmp_path / "dflash2"
    train(tiny_train_config(tiny_world["cache"], tiny_world["target"], dflash2_run, max_steps=2, eval_fraction=0.3))
    with pytest.raises(InputError) as e:
        built(tiny_world, tmp_path, init_drafter=str(dflash2_run / "final"), drafter_type="dflash")
    assert [tuple(s) for s in e.value.fields["settings"]] == [("--drafter-type", "dflash", "dflash2")]


@pytest.mark.parametrize("other, differs", [
    ({"seed": 1}, "weights_hash"),  # the same config.json, other weights (a fine-tune of the target, say)
    ({"rms_norm_eps": 1e-5}, "config_hash"),  # another config of the same shapes
])
def test_an_export_of_another_target_still_loads_and_the_startup_names_both_targets(
        tiny_world, tmp_path, exported, other, differs):
    from conftest import HIDDEN, TARGET_LAYERS, WORLD_VOCAB, make_tiny_target
    from dflash.train.exports.export import read_export_weights

    target = make_tiny_target(tmp_path / "other-target", hidden=HIDDEN, layers=TARGET_LAYERS, vocab=WORLD_VOCAB,
                              heads=2, kv_heads=1, **other)
    with collected() as found:
        warm, notes = built(tiny_world, tmp_path, init_drafter=str(exported), target_model=str(target))
    own = warm.state_dict()
    assert all(torch.equal(own[k], v.to(own[k].dtype)) for k, v in read_export_weights(exported).items())
    said = [f for f in found if f.code == "train.init-other-target"]
    assert len(said) == 1 and len(found) == 1, found
    assert said[0].fields["init"] == str(exported) and said[0].fields["trained"] == str(tiny_world["target"].resolve())
    assert said[0].fields["here"] == str(target.resolve()) and [d[0] for d in said[0].fields["differences"]] == [differs]
    assert [n for n in notes if n.startswith("Note: --init-drafter")] == [f"Note: {said[0]}"]  # in the run's log
    # a warm start from an export of this run's own target says nothing of the kind
    with collected() as same:
        built(tiny_world, tmp_path, init_drafter=str(exported))
    assert not same, same


def test_an_export_that_records_no_target_loads_and_says_only_that_it_is_not_checked(tiny_world, tmp_path, exported):
    import json
    import shutil

    plain = shutil.copytree(exported, tmp_path / "plain")  # as another trainer, or an older export, writes it
    config = json.loads((plain / "config.json").read_text())
    del config["dflash_training"]
    (plain / "config.json").write_text(json.dumps(config))
    with collected() as found:
        _, notes = built(tiny_world, tmp_path, init_drafter=str(plain))
    assert [(f.code, f.fields) for f in found] == [("train.init-drafter-target-unrecorded", {"init": str(plain)})]
    assert len([n for n in notes if "warm start" in n]) == 1
