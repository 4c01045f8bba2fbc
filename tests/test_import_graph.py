"""The project's modules import each other without a circle, and never another module's private
names; both read from the source (every import, also those inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "cache_tools", "prepare", "extract", "train", "eval", "demo")  # dflash.<dir>


def project_modules() -> dict[str, Path]:
    """{"dflash.train.run.loop": path, "dflash.train": path of its __init__, ...}."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("dflash", *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


def _base(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = module if is_package else module.rsplit(".", 1)[0]
    for _ in range(node.level - 1):
        package = package.rsplit(".", 1)[0]
    return f"{package}.{node.module}" if node.module else package


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str | None, str, int]]:
    """(imported project module, imported name or None for the module itself, the name it is
    bound to, line) of every import in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, a.asname or a.name, node.lineno) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node, path.name == "__init__.py")
            for alias in node.names:
                bound = alias.asname or alias.name
                if f"{base}.{alias.name}" in modules:  # `from package import module`
                    found.append((f"{base}.{alias.name}", None, bound, node.lineno))
                elif base in modules:
                    found.append((base, alias.name, bound, node.lineno))
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for target, _, _, _ in imports_of(name, path, modules):
            if target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_the_graph_sees_relative_absolute_and_function_local_imports():
    graph = import_graph()
    assert "dflash.cache_tools.codecs" in graph["dflash.cache_tools.manifest"]  # from .codecs import ...
    assert "dflash.cache_tools.sources" in graph["dflash.train.data.loader"]  # from dflash.cache_tools.sources import
    assert "dflash.cache_tools.maintenance" in graph["dflash.cache_tools.cli"]  # inside a command function
    assert "dflash.cache_tools.sources" in graph["dflash.train.data.heldout"]  # under TYPE_CHECKING


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_the_project_modules():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_imports_another_modules_private_names():
    modules = project_modules()
    found = []
    for name, path in modules.items():
        bound_modules = {}
        for target, imported, bound, line in imports_of(name, path, modules):
            if target == name:
                continue
            if imported is None:
                bound_modules[bound] = target
            elif _private(imported):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {target}.{imported}")
        for node in ast.walk(ast.parse(path.read_text())):  # module._name
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in bound_modules and _private(node.attr)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {bound_modules[node.value.id]}.{node.attr}")
    assert not found, "\n".join(found)


# The layers, lowest first: a module may import its own package and the packages of lower
# layers only (extract, prepare and train share a layer and do not import each other).
LAYERS = (("runtime",), ("cache_tools",), ("extract", "prepare", "train"), ("eval",), ("demo",))


def layer_violations(modules: dict[str, Path], layers=LAYERS) -> list[tuple[str, str, int]]:
    """(module, imported module, line) of every import against the layer order."""
    rank = {package: i for i, group in enumerate(layers) for package in group}
    found = []
    for name, path in modules.items():
        package = name.split(".")[1]
        for target, _, _, line in imports_of(name, path, modules):
            other = target.split(".")[1]
            if other != package and rank[other] >= rank[package]:
                found.append((name, target, line))
    return found


def test_the_layer_check_finds_upward_and_sideways_imports_and_allows_downward_ones(tmp_path):
    sources = {"runtime.fsio": "from dflash.cache_tools import codecs\n",  # upward
               "cache_tools.codecs": "import dflash.runtime.fsio\n",  # downward
               "train.loop": "def f():\n    from dflash.extract.engine import x\n",  # sideways, in a function
               "extract.engine": "",
               "eval.run": "from dflash.train import loop\n"}  # downward
    modules = {}
    for module, source in sources.items():
        path = tmp_path / f"{module}.py"
        path.write_text(source)
        modules[f"dflash.{module}"] = path
    assert sorted((a, b) for a, b, _ in layer_violations(modules)) == [
        ("dflash.runtime.fsio", "dflash.cache_tools.codecs"), ("dflash.train.loop", "dflash.extract.engine")]


def test_no_module_imports_against_the_layer_order():
    found = [f"{name} imports {target} (line {line})" for name, target, line in layer_violations(project_modules())]
    assert not found, "imports against runtime < cache_tools < (extract, prepare, train) < eval < demo:\n" + "\n".join(found)
