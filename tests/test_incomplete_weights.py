"""A target whose weight files lack tensors its config needs is refused by name: transformers
would fill them with random values and go on, and every hidden state after it would be a
half-random model's."""

from __future__ import annotations

from conftest import random_records, write_jsonl
from dflash.runtime.safetensors_files import IncompleteWeightsError, refuse_incomplete_weights
from extract_utils import make_target, run_cli
from safetensors.torch import load_file, save_file


def test_an_extraction_from_a_target_missing_a_tensor_is_refused_naming_it(tmp_path):
    target = make_target(tmp_path / "model", "qwen3", layers=4)
    weights = target / "model.safetensors"
    tensors = load_file(weights)
    dropped = next(k for k in tensors if "layers.1.mlp" in k)
    del tensors[dropped]
    save_file(tensors, weights, metadata={"format": "pt"})
    data = write_jsonl(tmp_path / "data.jsonl", random_records(4, seed=1))
    res = run_cli(["--target-model", target, "--data", data, "--output", tmp_path / "cache", "--dtype", "fp32",
                   "--target-layer-ids", "0,2", "--num-writers", "0"])
    assert res.exit_code != 0 and res.exit_code != 1, res.output  # a refusal, not a crash
    assert "do not hold every tensor" in res.output and dropped in res.output, res.output
    assert not (tmp_path / "cache" / "manifest.parts.jsonl").exists()


def test_the_loading_report_is_read_for_missing_and_reshaped_tensors_alike():
    refuse_incomplete_weights("m", {"missing_keys": [], "mismatched_keys": []})  # complete: nothing said
    refuse_incomplete_weights("m", None)
    for info, missing, mismatched in (({"missing_keys": ["a.weight"]}, ["a.weight"], []),
                                      ({"mismatched_keys": [("b.weight", (2, 3), (3, 2))]}, [], ["b.weight"])):
        try:
            refuse_incomplete_weights("m", info)
        except IncompleteWeightsError as e:
            assert e.code == "runtime.weights-incomplete"
            assert (e.fields["dir"], e.fields["missing"], e.fields["mismatched"]) == ("m", missing, mismatched)
        else:
            raise AssertionError("not refused")
