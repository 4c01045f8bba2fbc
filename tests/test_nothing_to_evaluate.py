"""Held-out samples without a completion token to draft are refused at the evaluation, naming
where they come from: a tau of 1.0 and a loss of 0 would read as a measurement of any drafter."""

from __future__ import annotations

import pytest
from conftest import tiny_train_config, write_jsonl
from dflash.runtime.errors import InputError
from dflash.train.measure.estimate import estimate_drafter
from dflash.train.run.loop import train
from extract_utils import make_target, run_cli


def test_an_eval_cache_without_completion_tokens_is_refused_by_training_and_estimate(tmp_path):
    target = make_target(tmp_path / "model", "qwen3", layers=4)

    def extract(name: str, completion: int) -> str:
        records = [{"input_ids": [1 + (k * 5 + j) % 90 for j in range(12)],
                    "loss_mask": [0] * (12 - completion) + [1] * completion} for k in range(12)]
        data = write_jsonl(tmp_path / f"{name}.jsonl", records)
        res = run_cli(["--target-model", target, "--data", data, "--output", tmp_path / name, "--dtype", "fp32",
                       "--target-layer-ids", "0,2", "--num-writers", "0"])
        assert res.exit_code == 0, res.output
        return str(tmp_path / name)

    cache, empty = extract("cache", 8), extract("empty", 1)  # one loss token: no block to draft
    cfg = tiny_train_config(cache, target, tmp_path / "run", eval_cache=[empty], eval_interval=1, max_steps=2)
    with pytest.raises(InputError) as e:
        train(cfg)
    assert e.value.code == "train.nothing-to-evaluate"
    assert e.value.fields == {"samples": 12, "eval_caches": [empty]}
    ok = train(tiny_train_config(cache, target, tmp_path / "ok", eval_fraction=0.3, eval_interval=1, max_steps=2))
    with pytest.raises(InputError) as e:
        estimate_drafter(str(ok.final_dir), {"cache": [empty], "target_model": str(target), "num_workers": 0,
                                             "block_size": 4})
    assert e.value.code == "train.nothing-to-evaluate" and e.value.fields["samples"] == 12
