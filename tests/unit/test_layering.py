"""The one direction of imports (flows → tasks → strategies → dllm_common), no import cycle inside a package,
and a CUDA-free flows layer."""

import ast
import subprocess
import sys

import pytest

try:
    from conftest import ROOT
except ModuleNotFoundError:  # run as a script: python tests/unit/test_layering.py [ROOT]
    from pathlib import Path

    ROOT = Path(__file__).resolve().parents[2]

LAYERS = ["flows", "tasks", "strategies", "dllm_common"]


def _imported_packages(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


def test_imports_only_point_down_the_layers():
    violations = []
    for rank, layer in enumerate(LAYERS):
        forbidden = set(LAYERS[:rank])
        for path in (ROOT / layer).rglob("*.py"):
            bad = forbidden & set(_imported_packages(path))
            violations += [f"{path.relative_to(ROOT)} imports {b}" for b in sorted(bad)]
    assert violations == []


def test_layering_check_would_catch_an_upward_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from flows.pipeline import dllm_pipeline\n")
    assert "flows" in set(_imported_packages(f))


def _module_name(path, root):
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _is_module(root, name):
    p = root.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def import_graph(root, package):
    """{module: modules of `package` it imports}, from every import statement in the file (functions included).

    `from a.b import c` counts a.b, and a.b.c too where that is a module; relative imports are resolved."""
    graph = {}
    for path in sorted((root / package).rglob("*.py")):
        mod = _module_name(path, root)
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".")[: len(mod.split(".")) - node.level + (path.name == "__init__.py")]
                    base = ".".join([*anchor, *filter(None, [base])])
                names |= {base, *(f"{base}.{alias.name}" for alias in node.names)}
        graph[mod] = {n for n in names if n.split(".")[0] == package and _is_module(root, n)} - {mod}
    return graph


def import_cycles(graph):
    """The cycles a depth-first search closes, each as [a, b, ..., a] (empty iff the graph is acyclic)."""
    cycles, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


@pytest.mark.parametrize("package", LAYERS)
def test_no_import_cycle_inside_a_package(package):
    cycles = import_cycles(import_graph(ROOT, package))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def strategy_package_imports(root):
    """`strategies.<name>.…` modules that import another strategy's package: a strategy is one package
    (`strategies/<name>/`) that may use the shared modules of `strategies/`, never another strategy's."""
    packages = {p.parent.name for p in (root / "strategies").glob("*/__init__.py")}

    def package_of(module):
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in packages else None

    bad = []
    for mod, imported in import_graph(root, "strategies").items():
        if package_of(mod) is not None:
            others = {package_of(n) for n in imported} - {None, package_of(mod)}
            bad += [f"{mod} imports strategies.{other}" for other in sorted(others)]
    return bad


def test_no_strategy_package_imports_another():
    assert strategy_package_imports(ROOT) == []


def test_the_package_check_would_catch_one_strategy_importing_another(tmp_path):
    for name in ("a", "b"):
        (tmp_path / "strategies" / name).mkdir(parents=True)
        (tmp_path / "strategies" / name / "__init__.py").write_text("")
    (tmp_path / "strategies" / "__init__.py").write_text("")
    (tmp_path / "strategies" / "shared.py").write_text("")
    (tmp_path / "strategies" / "a" / "strategy.py").write_text("from strategies.shared import x\nfrom . import y\n")
    (tmp_path / "strategies" / "b" / "strategy.py").write_text("def f():\n    from strategies.a.strategy import S\n")
    assert strategy_package_imports(tmp_path) == ["strategies.b.strategy imports strategies.a"]


def test_cycle_check_would_catch_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")  # a.b.c form: `b` is a module
    (pkg / "sub" / "b.py").write_text("def f():\n    import pkg.c\n")  # inside a function
    (pkg / "c.py").write_text("from . import a\nimport os\n")  # relative
    (pkg / "d.py").write_text("from pkg.a import thing\n")  # imports into the cycle, not part of it
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.d"] == {"pkg.a"} and graph["pkg.c"] == {"pkg", "pkg.a"}
    assert [" -> ".join(c) for c in import_cycles(graph)] == ["pkg.a -> pkg.sub.b -> pkg.c -> pkg.a"]
    (pkg / "c.py").write_text("import os\n")
    assert import_cycles(import_graph(tmp_path, "pkg")) == []


BLOCK_TORCH = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, Block())
import flows.pipeline, flows.cli
assert "torch" not in sys.modules
print("ok")
"""


def test_flows_import_with_torch_blocked():
    out = subprocess.run([sys.executable, "-c", BLOCK_TORCH], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


# ---------------------------------------------------------------- the layout as a table

MAX_MODULE_LINES = 500  # a longer module is several modules (split it along its seams)


def layout_table(root) -> list[tuple[str, int, int, str, str]]:
    """One row per folder of the four layers: (folder, modules, lines, its longest module with its line count,
    the other folders of the project its modules import). `python tests/unit/test_layering.py [ROOT]` prints it:
    the structure drawing of a checkout, as text."""
    from collections import defaultdict

    folders = defaultdict(list)
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            folders[path.parent.relative_to(root).as_posix()].append(path)
    rows = []
    for folder, paths in sorted(folders.items()):
        sizes = {p.name: len(p.read_text().splitlines()) for p in paths}
        longest = max(sizes, key=sizes.get)
        layer = folder.split("/")[0]
        graph = import_graph(root, layer)
        own = {_module_name(p, root) for p in paths}
        targets = set()
        for mod in own:
            for name in graph.get(mod, ()):
                package = (root / name.replace(".", "/")).is_dir()
                target = (name if package else name.rpartition(".")[0]).replace(".", "/")
                if not (package and folder.startswith(target + "/")):  # a parent package runs, it is not used
                    targets.add(target)
        for path in paths:  # the layers below, by package
            targets |= {pkg for pkg in _imported_packages(path) if pkg in LAYERS and pkg != layer}
        targets = sorted(t for t in targets if t and t != folder and t in folders)
        rows.append((folder, len(paths), sum(sizes.values()), f"{longest} {sizes[longest]}", ", ".join(targets)))
    return rows


def format_layout(rows) -> str:
    header = ("folder", "modules", "lines", "longest module", "imports")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows])


def test_the_layout_table_covers_every_module_and_none_is_too_long():
    rows = layout_table(ROOT)
    modules = [p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")]
    assert sum(r[1] for r in rows) == len(modules)
    assert sum(r[2] for r in rows) == sum(len(p.read_text().splitlines()) for p in modules)
    too_long = [f"{r[0]}/{r[3]}" for r in rows if int(r[3].split()[-1]) > MAX_MODULE_LINES]
    assert too_long == []


if __name__ == "__main__":
    from pathlib import Path

    print(format_layout(layout_table(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)))
