"""The record reader's refusals are findings: each bad record names its code and the values
that matter (the key, the token, the counts), which the stages add a location and a fix to."""

from __future__ import annotations

import pickle

import pytest
from dflash.runtime.records import BadRecord, NotJson, parse_sample

BAD = [  # (line, code, fields that matter)
    (b"{not json", "runtime.record-not-json", {"column": 2}),
    (b'{"input_ids": [1], "id": "\xff"}', "runtime.record-not-utf8", {"offset": 26}),
    (b'"just a string"', "runtime.record-not-object", {}),
    (b'{"loss_mask": [1]}', "runtime.record-no-input-ids", {}),
    (b'{"input_ids": "1 2", "loss_mask": [1, 1]}', "runtime.record-not-int-list", {"key": "input_ids", "got": "str"}),
    (b'{"input_ids": [1, 2.5], "loss_mask": [1, 1]}', "runtime.record-not-flat", {"key": "input_ids"}),
    (b'{"input_ids": [], "loss_mask": []}', "runtime.record-empty", {}),
    (b'{"input_ids": [1, -3], "loss_mask": [1, 1]}', "runtime.record-token-negative", {"token": -3}),
    (b'{"input_ids": [1, 128], "loss_mask": [1, 1]}', "runtime.record-token-out-of-vocab",
     {"token": 128, "vocab_size": 128}),
    (b'{"input_ids": [1], "id": 1.5, "prompt_len": 0}', "runtime.record-id-type", {}),
    (b'{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}', "runtime.record-length-mismatch",
     {"key": "loss_mask", "entries": 2, "tokens": 3}),
    (b'{"input_ids": [1, 2, 3], "labels": [-100, 2]}', "runtime.record-length-mismatch",
     {"key": "labels", "entries": 2, "tokens": 3}),
    (b'{"input_ids": [1, 2, 3], "loss_mask": [1, 2, 1]}', "runtime.record-mask-values", {}),
    (b'{"input_ids": [1, 2, 3], "prompt_len": 4}', "runtime.record-prompt-len", {"tokens": 3}),
    (b'{"input_ids": [1, 2]}', "runtime.record-no-loss-mask", {}),
]


@pytest.mark.parametrize("line,code,fields", BAD, ids=[c for _l, c, _f in BAD])
def test_a_bad_record_is_refused_with_its_code_and_values(line, code, fields):
    with pytest.raises(BadRecord) as err:
        parse_sample(line, 128)
    assert err.value.code == code
    assert {k: err.value.fields[k] for k in fields} == fields
    assert str(err.value) and "\n" not in str(err.value)


def test_a_line_that_is_not_json_keeps_the_decoders_detail_and_pickles():
    with pytest.raises(NotJson) as err:
        parse_sample(b'{"input_ids": [1, 2', 10)
    assert err.value.detail and err.value.code == "runtime.record-not-json"
    back = pickle.loads(pickle.dumps(BadRecord(err.value.finding)))
    assert back.code == err.value.code and str(back) == str(err.value)


def test_a_bad_record_built_from_text_still_reads_as_its_text():
    assert str(BadRecord("a reason")) == "a reason" and BadRecord("a reason").code is None
