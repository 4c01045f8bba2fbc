"""runtime/: the device and dtype choice, a damaged safetensors file and a drafter given as the
target are refused with their code and fields (the words are runtime/messages.py's)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from dflash.runtime.devices import dtype_name, resolve_device
from dflash.runtime.errors import CorruptDataError, InputError, SettingError
from dflash.runtime.findings import Finding, render
from dflash.runtime.safetensors_files import (
    WEIGHT_PURPOSES,
    WeightsFileError,
    check_safetensors,
    refuse_drafter_as_target,
    safetensors_problem,
)
from safetensors.torch import save_file


def test_an_unknown_dtype_names_its_flag_value_and_choices():
    with pytest.raises(SettingError) as e:
        dtype_name("int8", ("bf16", "fp32"), flag="--storage-dtype")
    assert e.value.code == "runtime.dtype-unknown"
    assert e.value.fields == {"flag": "--storage-dtype", "value": "int8", "allowed": ["bf16", "fp32"]}
    assert dtype_name("bfloat16") == "bf16"


def test_a_device_that_is_not_one_or_absent_cuda_is_a_setting_error_naming_the_flag():
    with pytest.raises(SettingError) as e:
        resolve_device("gpu0")
    assert e.value.code == "runtime.device-invalid" and e.value.fields["value"] == "gpu0"
    if not torch.cuda.is_available():
        with pytest.raises(SettingError) as e:
            resolve_device("cuda:1")
        assert e.value.code == "runtime.cuda-unavailable" and e.value.fields == {"flag": "--device", "value": "cuda:1"}


def _weights(path):
    save_file({"w": torch.zeros(16, 16)}, str(path))
    return path


def test_each_way_a_safetensors_file_is_damaged_is_its_own_reason(tmp_path):
    good = _weights(tmp_path / "good.safetensors")
    assert safetensors_problem(good) is None
    data = good.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    cases = {
        "runtime.safetensors-short": data[:5],
        "runtime.safetensors-header-size": data[:8 + n - 3],
        "runtime.safetensors-data-size": data[:-100],
        "runtime.safetensors-header-not-object": struct.pack("<Q", 2) + b"[]",
    }
    for code, damaged in cases.items():
        path = tmp_path / f"{code}.safetensors"
        path.write_bytes(damaged)
        assert safetensors_problem(path).code == code, code
    assert safetensors_problem(tmp_path / "runtime.safetensors-data-size.safetensors").fields == {
        "needed": 16 * 16 * 4, "holds": 16 * 16 * 4 - 100}
    with pytest.raises(WeightsFileError) as e:
        check_safetensors(tmp_path / "runtime.safetensors-short.safetensors", purpose="resume")
    assert isinstance(e.value, CorruptDataError) and e.value.code == "runtime.weights-file-damaged"
    assert e.value.fields["file"] == str(tmp_path / "runtime.safetensors-short.safetensors")
    assert e.value.fields["problem"].code == "runtime.safetensors-short" and e.value.fields["purpose"] == "resume"
    with pytest.raises(ValueError):  # a purpose with no words is a bug
        check_safetensors(tmp_path / "good.safetensors", purpose="Copy it again.")


def test_each_weights_purpose_renders_its_own_fix():
    texts = {render(Finding("runtime.weights-file-damaged", file="m.safetensors", problem="truncated",
                            purpose=purpose)) for purpose in WEIGHT_PURPOSES}
    assert len(texts) == len(WEIGHT_PURPOSES) and all(t.startswith("m.safetensors is not a complete") for t in texts)


def test_a_drafter_export_given_as_the_target_names_its_architectures_and_flag(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    with pytest.raises(InputError) as e:
        refuse_drafter_as_target(tmp_path, flag="--target")
    assert e.value.code == "runtime.drafter-as-target"
    assert e.value.fields == {"dir": str(tmp_path), "architectures": ["DFlashDraftModel"], "flag": "--target"}
