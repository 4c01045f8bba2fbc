"""The cache format layer starts without torch: `import dflash.cache_tools` and every module of
it, and `dflash-cache info` (which reads the manifest only). The importers read other
trainers' torch files, and import torch only inside the functions that do."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from conftest import write_tiny_cache

ROOT = Path(__file__).resolve().parents[1]
CACHE_TOOLS = sorted(p.stem for p in (ROOT / "cache_tools").glob("*.py") if p.stem != "__init__")
LAZY_TORCH = ("importers", "importing")  # torch inside functions, for other trainers' files

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


def _module_level_torch_imports(path: Path) -> list[int]:
    """Lines of `path` that import torch outside any function."""
    tree = ast.parse(path.read_text(), str(path))
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if id(node) in inside:
            continue
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n == "torch" or n.startswith("torch.") for n in names):
            found.append(node.lineno)
    return found


def test_importing_every_module_of_the_format_layer_does_not_import_torch():
    assert "reader" in CACHE_TOOLS and "writer" in CACHE_TOOLS and "cache_set" in CACHE_TOOLS
    body = "import dflash.cache_tools\n" + "".join(f"import dflash.cache_tools.{m}\n" for m in CACHE_TOOLS)
    assert _loaded(body) == []


def test_the_importers_import_torch_only_inside_functions():
    for name in LAZY_TORCH:
        assert _module_level_torch_imports(ROOT / "cache_tools" / f"{name}.py") == [], name


def test_the_source_check_sees_a_module_level_torch_import(tmp_path):
    (tmp_path / "m.py").write_text("import numpy\nfrom torch import nn\n\ndef f():\n    import torch\n")
    assert _module_level_torch_imports(tmp_path / "m.py") == [2]


def test_cache_info_does_not_import_torch(tmp_path):
    cache = write_tiny_cache(tmp_path / "cache", samples=4, parts=2)
    body = ("from dflash.cache_tools.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
            f"    main(['info', {str(cache)!r}, '--json'])\n"
            "assert json.loads(out.getvalue())['samples'] == 4, out.getvalue()")
    assert _loaded(body) == []


def test_the_check_sees_torch_when_it_is_imported():
    assert _loaded("import dflash.train.data.loader") == ["torch"]
