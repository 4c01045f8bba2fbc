"""The refusals and notices of extract/, prepare/, eval/ and demo/ are findings: a code and the
fields that name the file, line, flag and values (their words are the renderers' own tests)."""

from __future__ import annotations

import json
import pickle

import pytest
from dflash.runtime.errors import InputError, SettingError
from dflash.runtime.findings import Finding


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_bad_chat_record_is_a_finding_naming_its_line_and_problem(tmp_path):
    from dflash.prepare.formats import iter_conversations

    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "bot", "content": "hi"}]}, {"text": "x"}])
    [(where1, role), (where2, shape)] = list(iter_conversations([data]))
    assert where1 == f"{data}, line 1" and role.code == "prepare.record-role"
    assert role.fields["message"] == 0 and role.fields["role"] == "bot"
    assert where2 == f"{data}, line 2" and shape == Finding("prepare.record-shape", keys=["text"])
    assert pickle.loads(pickle.dumps(role)) == role  # (--num-workers sends it between processes)


def test_a_scan_that_leaves_files_out_returns_a_finding_naming_them(tmp_path):
    from dflash.prepare.formats import list_chat_files

    (tmp_path / "d").mkdir()
    _jsonl(tmp_path / "d" / "a.jsonl", [])
    (tmp_path / "d" / "README.txt").write_text("about")
    notes: list = []
    assert [p.name for p in list_chat_files(tmp_path / "d", notes)] == ["a.jsonl"]
    assert notes == [Finding("prepare.data-files-left-out", dir=str(tmp_path / "d"), files=["README.txt"])]
    with pytest.raises(InputError) as missing:
        list_chat_files(tmp_path / "nope.jsonl")
    assert missing.value.code == "prepare.data-missing" and missing.value.fields["file"] == str(tmp_path / "nope.jsonl")


def test_a_bad_prepare_setting_names_its_flag_and_value():
    from dflash.prepare.pipeline import PrepareConfig

    with pytest.raises(SettingError) as bad:
        PrepareConfig(target_model="t", data="d", output="o", loss_on="some")
    assert bad.value.code == "prepare.flag-choice"
    assert bad.value.fields["flag"] == "--loss-on" and bad.value.fields["value"] == "some"


def test_a_bad_extract_setting_names_its_flag_and_value():
    from dflash.extract.config import ExtractConfig

    with pytest.raises(SettingError) as bad:
        ExtractConfig(target_model="t", data="d", output="o", part_tokens=0)
    assert bad.value.code == "extract.flag-below-minimum" and bad.value.fields == {
        "flag": "--part-tokens", "value": 0, "minimum": 1}
    with pytest.raises(SettingError) as rank:
        ExtractConfig(target_model="t", data="d", output="o", rank=2, world_size=2)
    assert rank.value.code == "extract.rank-out-of-range" and rank.value.fields == {"rank": 2, "world_size": 2}


def test_extract_input_without_data_files_names_the_directory_and_the_documents_it_left_out(tmp_path):
    from dflash.extract.data import list_data_files

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "stats.json").write_text(json.dumps({"a": 1}, indent=2))
    with pytest.raises(InputError) as none:
        list_data_files(tmp_path / "d")
    assert none.value.code == "extract.data-no-files" and none.value.fields["dir"] == str(tmp_path / "d")
    assert [name for name, _ in none.value.fields["documents"]] == ["stats.json"]


def test_eval_prompts_outside_the_vocabulary_name_the_line_and_the_tokens(tmp_path):
    from dflash.eval.run import load_prompts

    prompts = _jsonl(tmp_path / "p.jsonl", [{"prompt_ids": [1, 2]}, {"prompt_ids": [3, 99, 100]}])
    with pytest.raises(InputError) as bad:
        load_prompts(prompts, 32)
    assert bad.value.code == "eval.prompt-out-of-vocab"
    assert bad.value.fields["tokens"] == [99, 100] and bad.value.fields["vocab_size"] == 32
    assert bad.value.fields["where"].startswith(f"{prompts}, line 2")
    with pytest.raises(InputError) as missing:
        load_prompts(tmp_path / "none.jsonl", 32)
    assert missing.value.code == "eval.prompt-file-missing"
