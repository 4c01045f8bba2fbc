"""`dflash-cache verify` and `info` tell what is on disk: verify names the parts evicted under a
disk budget (not checked, no damage), info says which codecs a recompressed cache came through
(issue 52)."""

from __future__ import annotations

import json

from cache_utils import make_cache
from click.testing import CliRunner
from dflash.cache_tools.cli import main as cache_main
from dflash.cache_tools.eviction import evict_part
from dflash.cache_tools.manifest import read_manifest
from dflash.cache_tools.rewrite import recompress_cache


def test_verify_names_the_evicted_parts_and_still_passes(tmp_path):
    """It said "OK: 3 parts, ... no problems found" with a count of evicted parts and no name."""
    cache = tmp_path / "c"
    make_cache(cache, parts=3, length=20)
    evict_part(cache, read_manifest(cache).parts[1], 0)
    for args in ([], ["--fast"]):
        res = CliRunner().invoke(cache_main, ["verify", str(cache), *args])
        assert res.exit_code == 0, res.output
        ok_line = next(line for line in res.output.splitlines() if line.startswith("OK:"))
        assert "1 of them evicted" in ok_line, res.output
        assert "part-000001" in res.output and "--follow-epochs" in res.output, res.output


def test_info_of_a_cache_recompressed_from_nf4_names_nf4_and_its_precision(tmp_path):
    """nf4 -> bf16 showed only "codec bf16": the values hold nf4's precision."""
    make_cache(tmp_path / "nf4", codec="nf4", parts=1, length=20)
    recompress_cache(tmp_path / "nf4", tmp_path / "bf16", codec="bf16", progress=False)
    recompress_cache(tmp_path / "bf16", tmp_path / "raw", codec="raw", progress=False)
    res = CliRunner().invoke(cache_main, ["info", str(tmp_path / "bf16")])
    codec_line = next(line for line in res.output.splitlines() if line.startswith("codec"))
    assert res.exit_code == 0 and "bf16" in codec_line and "recompressed from nf4" in codec_line, res.output
    as_json = json.loads(CliRunner().invoke(cache_main, ["info", str(tmp_path / "raw"), "--json"]).output)
    assert as_json["codec"]["name"] == "raw" and as_json["codec_history"] == ["nf4", "bf16"]
    plain = json.loads(CliRunner().invoke(cache_main, ["info", str(tmp_path / "nf4"), "--json"]).output)
    assert plain["codec_history"] == []
