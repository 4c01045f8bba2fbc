"""One layer rule for both stages: ids the engines can capture, or a clear refusal."""

from __future__ import annotations

import pytest
from conftest import random_records, tiny_train_config, write_jsonl, write_tiny_cache
from dflash.cache_tools.layers import (
    LayerIdsError,
    default_target_layer_ids,
    validate_target_layer_ids,
)
from dflash.train.run.loop import train
from extract_utils import make_target, run_cli

CONSTRAINT = "strictly increasing, unique and at most N-2"


def test_the_rule_matches_the_reference_for_real_targets():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # Llama-3.1-8B
    assert default_target_layer_ids(36, 1) == [18]


def test_the_rule_never_returns_ids_the_check_refuses():
    for n in range(1, 70):
        for k in range(1, 9):
            try:
                ids = default_target_layer_ids(n, k)
            except LayerIdsError as e:
                assert e.code == "cache.layer-rule-too-shallow" and e.fields == {"count": k, "layers": n}
                assert n < k + 3 or (k == 1 and n < 3), (n, k)  # only targets too shallow for it
                continue
            assert len(ids) == k
            assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] <= n - 2, (n, k, ids)
            assert validate_target_layer_ids(ids, n) == ids


@pytest.mark.parametrize("n, k", [(6, 5), (4, 5), (2, 1)])
def test_the_rule_refuses_targets_too_shallow_to_repeat_no_id(n, k):
    """Before, a 6-layer target gave [1, 2, 2, 2, 3] and a 2-layer one [1] (its last layer)."""
    with pytest.raises(LayerIdsError) as err:
        default_target_layer_ids(n, k)
    assert err.value.code == "cache.layer-rule-too-shallow" and err.value.fields == {"count": k, "layers": n}


@pytest.mark.parametrize("ids, problem, value", [
    ([2, 1], "unordered", True), ([1, 1, 2], "repeated", [1]), ([1, 5], "above", [5]),
    ([-1, 2], "negative", [-1]), ([], "empty", True),
])
def test_the_check_names_the_problem_and_the_engine_constraint(ids, problem, value):
    with pytest.raises(LayerIdsError) as err:
        validate_target_layer_ids(ids, 6)
    assert err.value.code == "cache.layer-ids-unusable"
    assert err.value.fields["ids"] == ids and err.value.fields["layers"] == 6
    assert {k for k in ("empty", "repeated", "unordered", "negative", "above") if err.value.fields[k]} == {problem}
    assert err.value.fields[problem] == value  # (rendered with the engines' constraint, CONSTRAINT)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_target(tmp_path_factory.mktemp("layers") / "model", "qwen3", layers=4)


@pytest.mark.parametrize("ids, problem", [("2,1", "ascending"), ("1,1", "more than once"),
                                          ("1,3", "above N-2 = 2")])
def test_extraction_refuses_ids_the_engines_cannot_capture(target, tmp_path, ids, problem):
    data = write_jsonl(tmp_path / "data.jsonl", random_records(2, seed=0, max_len=10))
    res = run_cli(["--target-model", target, "--data", data, "--output", tmp_path / "cache", "--dtype", "fp32",
                   "--target-layer-ids", ids])
    assert res.exit_code == 2  # bad input
    assert problem in res.output and CONSTRAINT in res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "cache" / "manifest.json").exists()  # refused before anything is written


def test_extraction_refuses_the_default_rule_on_a_shallow_target(target, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", random_records(2, seed=0, max_len=10))
    res = run_cli(["--target-model", target, "--data", data, "--output", tmp_path / "cache", "--dtype", "fp32"])
    assert res.exit_code == 2 and "--target-layer-ids" in res.output and "cannot pick 5" in res.output


@pytest.mark.parametrize("layers, problem", [((2, 1), "unordered"), ((1, 1), "repeated"), ((1, 3), "above")])
def test_training_refuses_a_cache_with_such_ids(tiny_world, tmp_path, layers, problem):
    """Caches written before the check (e.g. the old rule's repeated ids) are refused by the trainer."""
    model = tiny_world["target"]  # 4 layers, like the cache's header
    cache = write_tiny_cache(tmp_path / "cache", samples=4, parts=1, layers=layers)
    with pytest.raises(LayerIdsError) as err:
        train(tiny_train_config(cache, model, tmp_path / "run", max_steps=1))
    assert err.value.code == "cache.layer-ids-unusable" and err.value.fields[problem]
    # purpose cache: the renderer says a cache's ids are fixed (re-extract it)
    assert (err.value.fields["purpose"], err.value.fields["cache"]) == ("cache", str(cache))


def test_extraction_refuses_unsorted_or_repeated_ids_before_loading_a_target(tmp_path):
    """Order and repeats need no target: they are refused when the settings are read (a large
    target takes minutes to load), the bound N-2 once the target is known."""
    from dflash.extract.config import ExtractConfig

    for ids, problem in (([9, 1], "unordered"), ([1, 1], "repeated")):
        with pytest.raises(LayerIdsError) as err:
            ExtractConfig(target_model=str(tmp_path / "no-such-model"), data="d.jsonl", output="out",
                          target_layer_ids=ids)
        assert err.value.fields[problem] and err.value.fields["layers"] is None


@pytest.mark.parametrize("purpose, of, named, fix", [
    (None, {}, "target_layer_ids [1, 5] cannot", "Pass --target-layer-ids"),
    ("extract", {}, "of this extraction", "Pass --target-layer-ids"),
    ("flag", {}, "of --target-layer-ids", "Pass --target-layer-ids"),
    ("cache", {"cache": "runs/c"}, "of the cache at runs/c", "Re-extract the cache with --target-layer-ids"),
    ("source-flag", {"source": "specforge", "source_ids": [2, 6], "offset": 1},
     "of --source-layer-ids [2, 6] (specforge numbers our layer id l as l + 1)", "Pass --source-layer-ids with the ids "
     "specforge captured (specforge numbers"),
])
def test_whose_ids_are_refused_is_data_and_the_renderer_names_them_and_the_fix(purpose, of, named, fix):
    with pytest.raises(LayerIdsError) as err:
        validate_target_layer_ids([1, 5], 6, purpose=purpose, **of)
    assert err.value.fields["purpose"] == purpose and {k: err.value.fields[k] for k in of} == of
    assert named in str(err.value) and fix in str(err.value)


def test_a_layer_ids_purpose_with_no_words_is_a_bug():
    with pytest.raises(ValueError):
        validate_target_layer_ids([1, 2], 6, purpose="the cache at x")
