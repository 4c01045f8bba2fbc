"""The cache format layer starts without torch: `import dflash.cache_tools`, its codecs and
manifest, and `dflash-cache info` (which reads the manifest only)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import write_tiny_cache

SCRIPT = """
import contextlib, io, json, sys
{body}
print(json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
"""


def _loaded(body: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(body=body)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_format_layer_does_not_import_torch():
    assert _loaded("import dflash.cache_tools, dflash.cache_tools.codecs, dflash.cache_tools.manifest, "
                   "dflash.cache_tools.summary") == []


def test_cache_info_does_not_import_torch(tmp_path):
    cache = write_tiny_cache(tmp_path / "cache", samples=4, parts=2)
    body = ("from dflash.cache_tools.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
            f"    main(['info', {str(cache)!r}, '--json'])\n"
            "assert json.loads(out.getvalue())['samples'] == 4, out.getvalue()")
    assert _loaded(body) == []


def test_the_check_sees_torch_when_it_is_imported():
    assert _loaded("import dflash.cache_tools.reader") == ["torch"]
