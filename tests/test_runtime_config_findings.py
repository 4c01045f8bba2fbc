"""A config file's refusals and notices are findings: the file and the key are fields, and a
deprecated key is a collected notice, not only a line of text."""

from __future__ import annotations

import json

import pytest
from dflash.runtime.config import read_config_file
from dflash.runtime.errors import SettingError
from dflash.runtime.findings import collected


def test_a_deprecated_key_is_a_notice_naming_the_file_the_key_and_its_new_name(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"lr": 1e-3}))
    with collected(echo=False) as found:
        assert read_config_file(path, ["learning_rate"], aliases={"lr": "learning_rate"}) == {"learning_rate": 1e-3}
    assert [(f.code, f.fields) for f in found] == [
        ("runtime.config-key-deprecated", {"file": str(path), "key": "lr", "now": "learning_rate"})]


@pytest.mark.parametrize("text,code", [
    ("[1, 2]", "runtime.config-not-mapping"),
    ('{"a": 1,', "runtime.config-not-parsed"),
    ('{"a": 1, "b": 2}', "runtime.config-unknown-keys"),
    ('{"a_b": 1, "a-b": 2}', "runtime.config-key-twice"),
])
def test_a_config_file_that_cannot_be_used_is_refused_naming_it(tmp_path, text, code):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(SettingError) as err:
        read_config_file(path, ["a"])
    assert err.value.code == code and err.value.fields["file"] == str(path)
    with pytest.raises(SettingError) as err:
        read_config_file(tmp_path / "none.json", ["a"])
    assert err.value.code == "runtime.config-missing"
