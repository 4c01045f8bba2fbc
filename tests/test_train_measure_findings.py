"""dflash-compare's and dflash-train estimate's refusals are findings: a code and the flag or value
they are about (the words are train/measure/messages.py's, tested by tests/test_findings.py)."""

from __future__ import annotations

import pytest
from dflash.runtime.errors import InputError
from dflash.train.config import TrainConfigError
from dflash.train.measure.compare import CompareConfig, plan_compare, run_figures


@pytest.mark.parametrize("settings, code, fields", [
    ({"heads": ("dflash", "nope")}, "train.compare-heads-unknown", {"unknown": ["nope"]}),
    ({"heads": ("dflash",), "fraction": 1.5}, "train.compare-fraction", {"fraction": 1.5}),
    ({"heads": ("dflash",), "fraction": 0.0}, "train.compare-fraction", {"fraction": 0.0}),
])
def test_a_comparison_of_unknown_heads_or_a_fraction_outside_0_1_is_refused_naming_it(settings, code, fields):
    with pytest.raises(TrainConfigError) as e:
        CompareConfig(**settings)
    assert e.value.code == code and fields.items() <= e.value.fields.items()


def test_a_comparison_that_names_the_head_itself_or_runs_under_torchrun_is_refused(monkeypatch):
    compare = CompareConfig(heads=("dflash",))
    with pytest.raises(TrainConfigError) as e:
        plan_compare({"drafter_type": "dflash2"}, compare)
    assert (e.value.code, e.value.fields) == ("train.compare-drafter-type", {"drafter_type": "dflash2"})
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TrainConfigError) as e:
        plan_compare({}, compare)
    assert (e.value.code, e.value.fields) == ("train.compare-torchrun", {"world_size": 2})


def test_a_candidate_without_an_evaluation_names_its_metrics_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\n{"torn')
    with pytest.raises(InputError) as e:
        run_figures(tmp_path)
    assert e.value.code == "train.compare-no-evaluation"
    assert e.value.fields == {"file": str(tmp_path / "metrics.jsonl"), "run_dir": str(tmp_path)}


def test_an_estimate_of_a_directory_that_is_no_export_names_it(tmp_path):
    from dflash.train.measure.estimate import estimate_drafter

    with pytest.raises(InputError) as e:
        estimate_drafter(str(tmp_path), {"cache": [str(tmp_path / "cache")], "target_model": str(tmp_path)})
    assert (e.value.code, e.value.fields) == ("train.estimate-not-export", {"dir": str(tmp_path)})


def test_dflash_train_compare_is_a_usage_error_naming_dflash_compare():
    from click.testing import CliRunner
    from dflash.runtime.errors import UsageError
    from dflash.train.cli import main

    with pytest.raises(UsageError) as e:
        main.main(["compare", "--heads", "dflash"], standalone_mode=False)
    assert (e.value.code, e.value.fields) == ("train.compare-moved", {"command": "dflash-compare"})
    assert CliRunner().invoke(main, ["compare"]).exit_code == 2
