"""recompress and merge into an existing destination of other settings: the refusal names the
command that writes it (not "this extraction"), with the same exit status."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from dflash.cache_tools.cli import main
from dflash.cache_tools.errors import ConfigMismatchError
from dflash.cache_tools.rewrite import merge_caches, recompress_cache

from tests.test_cache_maintenance import make_cache


def _cli(*args) -> tuple[int, str]:
    res = CliRunner().invoke(main, [str(a) for a in args])
    return res.exit_code, " ".join(res.output.split())


def test_recompress_into_a_destination_of_other_settings_names_recompress(tmp_path):
    make_cache(tmp_path / "src", parts=1)
    recompress_cache(tmp_path / "src", tmp_path / "dst", codec="fp8", progress=False)
    with pytest.raises(ConfigMismatchError) as err:
        recompress_cache(tmp_path / "src", tmp_path / "dst", codec="raw", progress=False)
    assert err.value.code == "cache.settings-differ" and err.value.fields["purpose"] == "recompress"
    assert err.value.fields["cache"] == str(tmp_path / "dst")
    code, out = _cli("recompress", tmp_path / "src", tmp_path / "dst", "--codec", "raw")
    assert code == 2 and "this recompression" in out and "extraction" not in out


def test_merge_into_a_destination_of_other_settings_names_merge(tmp_path):
    make_cache(tmp_path / "a", parts=1, seed=1)
    make_cache(tmp_path / "b", parts=1, seed=2, first_id=100)
    recompress_cache(tmp_path / "a", tmp_path / "dst", codec="fp8", progress=False)
    with pytest.raises(ConfigMismatchError) as err:
        merge_caches(tmp_path / "dst", [tmp_path / "a", tmp_path / "b"], progress=False)
    assert err.value.code == "cache.settings-differ" and err.value.fields["purpose"] == "merge"
    assert ["hidden.codec.name", "'fp8'", "'bf16'"] in err.value.fields["differences"]
    code, out = _cli("merge", tmp_path / "dst", tmp_path / "a", tmp_path / "b")
    assert code == 2 and "this merge" in out and "extraction" not in out
