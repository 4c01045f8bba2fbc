"""dflash-eval's refusals of a target whose cache cannot be decoded in batches or rolled back, and of
decoding settings out of range, are findings of the error family: a code and its fields, exit
status 2 (they were plain ValueErrors, which the command reported as a bug with a traceback)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from dflash.eval import run as eval_run
from dflash.eval.cli import main
from dflash.eval.config import EvalConfig, EvalError
from dflash.eval.speculative import DecodeConfig
from dflash.eval.target import RollbackUnsupportedError, TargetStateRollback, TargetUnbatchableError
from dflash.runtime.cli import EXIT_USAGE
from dflash.runtime.errors import EnvironmentFault, SettingError, UsageError


def cache_of(*layers: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(layers=list(layers))


def sliding(recording: bool = True) -> SimpleNamespace:
    layer = SimpleNamespace(is_sliding=True)
    if recording:
        layer.activate_past_recording = lambda: None
    return layer


@pytest.mark.parametrize(("layer", "kind"), [(sliding(), "sliding-window"),
                                            (SimpleNamespace(recurrent_states=None), "linear-attention")])
def test_a_target_whose_state_counts_columns_refuses_a_batch_naming_the_flag(layer, kind):
    with pytest.raises(TargetUnbatchableError) as refused:
        TargetStateRollback(cache_of(layer), batch=3)
    assert isinstance(refused.value, UsageError) and isinstance(refused.value, ValueError)
    assert refused.value.code == "eval.target-unbatchable"
    assert refused.value.fields == {"layers": kind, "flag": "--batch-size", "value": 3}
    TargetStateRollback(cache_of(layer), batch=1)  # one prompt per batch decodes


def test_a_sliding_window_target_with_a_transformers_that_cannot_roll_it_back_is_an_environment_fault():
    import transformers

    with pytest.raises(RollbackUnsupportedError) as refused:
        TargetStateRollback(cache_of(sliding(recording=False)), batch=1)
    assert isinstance(refused.value, EnvironmentFault) and isinstance(refused.value, ValueError)
    assert refused.value.code == "eval.transformers-too-old"
    assert refused.value.fields == {"version": transformers.__version__, "needed": "5"}


@pytest.mark.parametrize("batch", [1, 2])
def test_the_command_reports_the_target_refusals_with_exit_status_2_not_as_a_bug(batch, capsys):
    layer = sliding(recording=batch > 1)  # batch 2: the batch is refused; batch 1: transformers is
    assert main.run_reporting_errors(lambda: TargetStateRollback(cache_of(layer), batch=batch)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback" not in err and "This is a bug" not in err
    assert ("--batch-size 1" if batch > 1 else "transformers") in err


@pytest.mark.parametrize(("setting", "code", "fields"), [
    (dict(max_new_tokens=0), "eval.flag-below-one", {"flag": "--max-new-tokens", "value": 0}),
    (dict(temperature=-0.5), "eval.flag-out-of-range", {"flag": "--temperature", "value": -0.5, "low": 0,
                                                        "high": None}),
    (dict(block_size=1), "eval.flag-out-of-range", {"flag": "--block-size", "value": 1, "low": 2, "high": None}),
    (dict(confidence_threshold=1.5), "eval.flag-out-of-range", {"flag": "--confidence-threshold", "value": 1.5,
                                                               "low": 0, "high": 1}),
])
def test_decoding_settings_out_of_range_are_setting_findings(setting, code, fields):
    with pytest.raises(SettingError) as refused:  # a ValueError too, for library callers
        DecodeConfig(**setting)
    assert refused.value.code == code and refused.value.fields == fields


@pytest.mark.parametrize(("setting", "flag"), [(dict(temperature=-1.0), "--temperature"),
                                              (dict(max_new_tokens=0), "--max-new-tokens"),
                                              (dict(confidence_threshold=2.0), "--confidence-threshold")])
def test_dflash_eval_refuses_a_decoding_setting_with_its_finding(monkeypatch, setting, flag):
    model = SimpleNamespace(generation_config=None, config=SimpleNamespace(eos_token_id=2))
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=4))
    monkeypatch.setattr(eval_run, "load_models", lambda *args: (model, drafter, None))
    config = EvalConfig(target_model="target", drafter="drafter", prompts=["prompts.jsonl"], **setting)
    with pytest.raises(EvalError) as refused:
        eval_run.run_eval(config)
    assert refused.value.code is not None and refused.value.fields["flag"] == flag
    assert refused.value.fields["value"] == next(iter(setting.values()))


def test_a_confidence_threshold_for_a_drafter_without_confidence_is_a_setting_finding():
    import torch
    from dflash.eval.speculative import DrafterProposer, NoConfidenceError

    proposer = SimpleNamespace(confidence_threshold=0.5)
    with pytest.raises(NoConfidenceError) as refused:  # a SettingError, and a ValueError as before
        DrafterProposer._stop_where_unsure(proposer, torch.zeros((1, 3), dtype=torch.long), None)
    assert isinstance(refused.value, SettingError) and isinstance(refused.value, ValueError)
    assert refused.value.code == "eval.drafter-without-confidence"
    assert refused.value.fields == {"drafter": None, "flag": "--confidence-threshold"}
