"""The fault tests' slow points live in the tests (site/fault_points.py), not in the product:
each wraps its product function in a run's interpreter, and no product module reads them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .helpers import SITE_DIR
from .site.fault_points import PATCHES, POINTS

ROOT = Path(__file__).resolve().parents[2]
CHECK = """
import json, sys
import dflash.extract.loop, dflash.extract.engine, dflash.cache_tools.writer, dflash.train.data.loader
import dflash.train.run.checkpoint as checkpoint
wrapped = {
    "DFLASH_TEST_SLEEP_PER_PART": dflash.extract.loop.ExtractionLoop._submit,
    "DFLASH_TEST_SLEEP_PER_FORWARD": dflash.extract.engine.ExtractionEngine.launch,
    "DFLASH_TEST_SLEEP_BEFORE_COMMIT": dflash.cache_tools.writer.write_part_group,
    "DFLASH_TEST_SLEEP_PER_BATCH": dflash.train.data.loader.read_batch,
    "DFLASH_TEST_SLEEP_IN_WORKER_INIT": dflash.train.data.loader.worker_init,
    "DFLASH_TEST_SLEEP_IN_CHECKPOINT": checkpoint.staged_dir,
    "DFLASH_TEST_HOLD_AT": checkpoint.Checkpointer.save,
}
print(json.dumps({k: getattr(f, "fault_point", False) for k, f in wrapped.items()}))
"""


def _wrapped(env: dict[str, str]) -> dict[str, bool]:
    env = {**{k: v for k, v in os.environ.items() if k not in POINTS}, **env,
           "PYTHONPATH": os.pathsep.join(p for p in (str(SITE_DIR), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


SLOW_POINTS = POINTS[:7]  # the sleeps and the hold, whose wrapped functions CHECK lists


def test_a_fresh_interpreter_wraps_exactly_the_points_its_environment_names():
    assert set(PATCHES) == set(POINTS)
    assert _wrapped({}) == dict.fromkeys(SLOW_POINTS, False)
    every = {p: "checkpoint-saved:3" if p.endswith("HOLD_AT") else "0.01" for p in SLOW_POINTS}
    assert _wrapped(every) == dict.fromkeys(SLOW_POINTS, True)
    assert _wrapped({SLOW_POINTS[2]: "0.01"}) == {p: p == SLOW_POINTS[2] for p in SLOW_POINTS}


def test_no_product_module_reads_a_test_hook():
    packages = ("runtime", "cache_tools", "prepare", "extract", "train", "eval", "demo")
    hits = [str(p.relative_to(ROOT)) for pkg in packages for p in (ROOT / pkg).rglob("*.py")
            if "DFLASH_TEST" in p.read_text()]
    assert hits == []
