"""Part metadata is checked against the manifest when a part is opened (issue #33, bug 3): a
trainer on a cache whose parts and manifest disagree names the part, the array and both
shapes, exit 2, as verify does (it was numpy's broadcast traceback)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from dflash.cache_tools.cli import main as cache_main
from dflash.train.cli import main as train_main

from .helpers import train_config_file

# Each edit keeps the header consistent in itself (one that is not is refused as the damaged
# file first: tests/test_cache_hand_edits.py), so that only the parts disagree with it.
EDITS = {
    "layers": lambda h: (h.update(target_layer_ids=h["target_layer_ids"][:1]),  # hidden half as wide
                         h["hidden"].update(num_layers=1)),
    "codec": lambda h: (h["hidden"]["codec"].update(name="fp8"),  # other dtype, scales missing
                        h["hidden"].update(storage_dtype="uint8")),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_manifest_that_disagrees_with_its_parts_is_named_by_the_trainer_like_verify(world, tmp_path, edit):
    cache = Path(shutil.copytree(world["cache"], tmp_path / "cache"))
    header = json.loads((cache / "manifest.json").read_text())
    EDITS[edit](header)
    (cache / "manifest.json").write_text(json.dumps(header))
    verify = CliRunner().invoke(cache_main, ["verify", str(cache)])
    assert verify.exit_code == 1 and "expected" in verify.output and "from the manifest" in verify.output
    config = train_config_file(tmp_path / "train.json", cache, world["target"])
    result = CliRunner().invoke(train_main, ["--config", str(config), "--output-dir", str(tmp_path / "run")])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "cache part 'part-0000" in text and "its metadata says shape" in text and "manifest expects" in text
    assert "dflash-cache verify" in text and "Traceback" not in result.output
