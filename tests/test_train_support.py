"""Tests of the trainer's pure pieces: batch plans, the resumable loader position, the schedule and
the config file (the tiny targets and caches come from conftest.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from dflash.cache_tools.cache_set import CacheSet
from dflash.train.config import DataConfig, TrainConfigError, load_config_file, make_config
from dflash.train.data.heldout import eval_split
from dflash.train.data.loader import TrainLoader
from dflash.train.data.plans import plan_epoch
from dflash.train.run.loop import lr_multiplier

# -- batch plans and the loader position --------------------------------------------------------


def _loader_config(**kw) -> DataConfig:
    return DataConfig(**{**dict(cache=["unused"], token_budget=128, max_batch_size=4, max_seq_len=64,
                                shuffle_window=16, num_workers=0), **kw})


def test_epoch_plans_are_a_pure_function_of_seed_epoch_and_lengths():
    lengths = np.random.default_rng(0).integers(5, 64, size=200)
    index = np.arange(200)
    config = _loader_config()
    a, b = plan_epoch(index, lengths, config, 1, seed=3), plan_epoch(index, lengths, config, 1, seed=3)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    other_epoch = plan_epoch(index, lengths, config, 2, seed=3)
    other_seed = plan_epoch(index, lengths, config, 1, seed=4)
    assert [x.tolist() for x in a] != [x.tolist() for x in other_epoch]
    assert [x.tolist() for x in a] != [x.tolist() for x in other_seed]
    # every sample exactly once, each batch under the token budget and the size limit
    assert sorted(np.concatenate(a).tolist()) == list(range(200))
    assert all(len(x) * lengths[x].max() <= 128 and len(x) <= 4 for x in a)


def test_length_bucketing_keeps_padding_low():
    lengths = np.random.default_rng(1).integers(8, 512, size=4000)
    config = _loader_config(token_budget=2048, max_batch_size=64, max_seq_len=512, shuffle_window=1024)
    batches = plan_epoch(np.arange(4000), lengths, config, 0, seed=3)
    padded = sum(len(x) * lengths[x].max() for x in batches)
    assert lengths.sum() / padded > 0.9


def test_resumed_loader_yields_exactly_the_remaining_batches(tiny_world):
    caches = CacheSet([str(tiny_world["cache"])], max_seq_len=64)
    index = np.arange(len(caches))

    def loader() -> TrainLoader:
        return TrainLoader(caches, index, _loader_config(), seed=3, epochs=3, grad_accum=2)

    full = loader()
    total = 2 * sum(full.steps_per_epoch)
    reference = [full.next_batch()["sample_ids"].tolist() for _ in range(total)]
    first = loader()
    for _ in range(2 * (full.steps_per_epoch[0] + 1)):  # into the second epoch
        first.next_batch()
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    rest = [resumed.next_batch()["sample_ids"].tolist() for _ in range(total - 2 * (full.steps_per_epoch[0] + 1))]
    assert rest == reference[len(reference) - len(rest):]


def test_ranks_split_each_step_of_the_global_batch_list(tiny_world):
    caches = CacheSet([str(tiny_world["cache"])], max_seq_len=64)
    index = np.arange(len(caches))
    single = TrainLoader(caches, index, _loader_config(), seed=3, epochs=1, grad_accum=2)
    ranks = [TrainLoader(caches, index, _loader_config(), seed=3, epochs=1, rank=r, world_size=2) for r in range(2)]
    assert single.steps_per_epoch == ranks[0].steps_per_epoch
    for _ in range(single.steps_per_epoch[0]):
        one = {tuple(single.next_batch()["sample_ids"].tolist()) for _ in range(2)}
        two = {tuple(r.next_batch()["sample_ids"].tolist()) for r in ranks}
        assert one == two


def test_eval_split_is_stable_and_disjoint(tiny_world):
    caches = CacheSet([str(tiny_world["cache"])], max_seq_len=64)
    train_a, eval_a = eval_split(caches, 0.25)
    train_b, eval_b = eval_split(caches, 0.25)
    assert np.array_equal(eval_a, eval_b) and 0 < len(eval_a) < len(caches)
    assert not set(train_a.tolist()) & set(eval_a.tolist())


def test_schedule_warms_up_then_decays_to_the_floor():
    f = [lr_multiplier(s, total_steps=100, warmup_ratio=0.04, min_lr_ratio=0.1) for s in range(101)]
    assert f[0] == 0.25 and f[3] == 1.0 and f[4] == 1.0
    assert all(a >= b for a, b in zip(f[4:], f[5:]))
    assert abs(f[100] - 0.1) < 1e-9


def test_wsd_schedule_holds_the_peak_then_decays_linearly_over_its_last_steps():
    f = [lr_multiplier(s, total_steps=100, warmup_ratio=0.04, min_lr_ratio=0.1, schedule="wsd", decay_ratio=0.2)
         for s in range(101)]
    assert f[0] == 0.25 and f[3] == 1.0
    assert all(v == 1.0 for v in f[4:81])  # stable until the last 20 steps
    assert f[90] == pytest.approx(1 - 0.9 * 0.5) and f[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[80:], f[81:]))


def test_acceptance_weights_are_the_probability_of_reaching_each_slot():
    from dflash.train.loss.objective import acceptance_weights

    # One block of 4 slots (3 scored), label probabilities 0.5, 0.4, 0.9: reached with 1, 0.5, 0.2.
    b, a, k = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), torch.arange(3)
    logp = torch.log(torch.tensor([0.5, 0.4, 0.9])).requires_grad_()
    w = acceptance_weights(logp, b, a, k, torch.Size([1, 1, 3]))
    assert torch.allclose(w, torch.tensor([1.0, 0.5, 0.2])) and not w.requires_grad  # detached
    # A block whose first slot is not scored: its second slot counts as reached from the start.
    w = acceptance_weights(torch.log(torch.tensor([0.3])), torch.tensor([0]), torch.tensor([0]), torch.tensor([1]),
                           torch.Size([1, 1, 3]))
    assert torch.allclose(w, torch.tensor([1.0]))


def test_config_file_values_are_overridden_by_flags_and_unknown_keys_are_errors(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"cache": "c", "target-model": "t", "output_dir": "o", "lr": "3e-4",
                                "adam_betas": [0.9, 0.95], "compile": "false"}))
    config = make_config(load_config_file(path), {"lr": 1e-3, "seed": None})
    assert config.optimization.lr == 1e-3 and config.optimization.adam_betas == (0.9, 0.95)
    assert config.runtime.compile is False and config.data.cache == ["c"]
    path.write_text(json.dumps({"cache": "c", "learning_rate": 1}))
    with pytest.raises(TrainConfigError) as err:
        load_config_file(path)
    assert err.value.code == "runtime.config-unknown-keys" and err.value.fields["unknown"] == ["learning_rate"]
    path.write_text(json.dumps({"cache": "c", "target_model": "t", "output_dir": "o", "epochs": "many"}))
    with pytest.raises(TrainConfigError) as err:
        make_config(load_config_file(path), {})
    assert err.value.code == "runtime.setting-invalid"
    assert {k: err.value.fields[k] for k in ("file", "key", "flag", "value")} == dict(
        file=str(path), key="epochs", flag="--epochs", value="many")
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text("cache: [a, b]\ntarget-model: t\noutput_dir: o\nmax_steps: 5\n")
    pytest.importorskip("yaml")
    assert make_config(load_config_file(yaml_path), {}).data.cache == ["a", "b"]
    # a key given twice is refused, in YAML and JSON alike (the parsers would keep the last silently)
    yaml_path.write_text("cache: [a]\ntoken_budget: 4096\ntoken_budget: 8192\n")
    with pytest.raises(TrainConfigError) as err:
        load_config_file(yaml_path)
    assert err.value.code == "runtime.config-repeated-key" and err.value.fields["key"] == "token_budget"
    path.write_text('{"cache": "c", "lr": 1e-3, "lr": 2e-3}')
    with pytest.raises(TrainConfigError) as err:
        load_config_file(path)
    assert err.value.code == "runtime.config-repeated-key" and err.value.fields == {"file": str(path), "key": "lr"}


def test_the_data_summary_names_the_chat_template_and_warns_when_caches_differ():
    from dflash.train.data.caches import chat_templates_differ, rendering_summary

    def header(sha, kwargs):
        return {"data": {"files": [{"path": "a.jsonl", "rendering": {"chat_template_sha256": sha,
                                                                     "chat_template_kwargs": kwargs}}]}}

    raw = [{"data": {"files": [{"path": "raw.jsonl"}]}}]
    assert rendering_summary(raw) is None and chat_templates_differ(raw) is None  # tokenized data: nothing to say
    one = [header("ab" * 32, {"enable_thinking": False})] * 2
    assert "chat template sha256 abababababab" in rendering_summary(one) and chat_templates_differ(one) is None
    two = [header("ab" * 32, {"enable_thinking": False}), header("ab" * 32, {"enable_thinking": True})]
    assert rendering_summary(two) is None
    warned = chat_templates_differ(two)
    assert warned.code == "train.chat-templates-differ"
    assert warned.fields["templates"] == [["abababababab", {"enable_thinking": False}],
                                          ["abababababab", {"enable_thinking": True}]]
