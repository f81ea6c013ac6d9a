"""Structure numbers of the source packages (flows, tasks, strategies, dllm_common) and benchmarks/, as a table.

Longest function, functions over 60 lines, functions with more than 6 parameters, imports inside
functions, modules over 400 and 500 lines, test files over 800 lines, private names imported from another module,
import cycles inside a package and the strategy-name branches in `flows/` and `tasks/`. Run
`python benchmarks/code_structure.py [--list]` before and after a change.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "strategies", "dllm_common")
STRATEGY_LITERAL = re.compile(r'"(dflash|block_diffusion|mdlm|scdd|hybrid|idlm)"')


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _param_count(fn) -> int:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return len([n for n in names if n not in ("self", "cls")])


def _nested_imports(tree) -> int:
    count = 0
    for fn in _functions(tree):
        for node in ast.walk(fn):
            if isinstance(node, ast.Import | ast.ImportFrom):
                count += 1
    return count


def module_imports(path: Path, package: str) -> set[str]:
    """Modules of `package` that `path` imports (anywhere in the file)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out |= {n for n in names if n.split(".")[0] == package and _is_module(n)}
    return out


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def import_cycles(package: str) -> list[list[str]]:
    graph = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mod = mod.removesuffix(".__init__")
        graph[mod] = module_imports(path, package) - {mod}
    cycles, state, stack = [], {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node)
    return cycles


def private_imports(tree, rel: str) -> list[str]:
    """`from module import _name` of a first-party module: a private name used outside the module defining it."""
    return [
        f"{rel}:{node.lineno} {node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def test_files_over(limit: int) -> list[str]:
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        lines = path.read_text().count("\n")
        if lines > limit:
            found.append(f"{path.relative_to(ROOT)} ({lines})")
    return found


def measure() -> dict:
    funcs, nested, big_modules, branches, cycles, private = [], 0, [], [], [], []
    for package in (*PACKAGES, "benchmarks"):
        cycles += import_cycles(package) if package != "benchmarks" else []
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            tree = ast.parse(text)
            rel = str(path.relative_to(ROOT))
            lines = text.count("\n")
            if lines > 400:
                big_modules.append((rel, lines))
            nested += _nested_imports(tree)
            private += private_imports(tree, rel)
            for fn in _functions(tree):
                funcs.append((rel, fn.name, fn.end_lineno - fn.lineno + 1, _param_count(fn)))
            if package in ("flows", "tasks"):
                branches += [
                    f"{rel}:{i}" for i, line in enumerate(text.splitlines(), 1) if STRATEGY_LITERAL.search(line)
                ]
    longest = max(funcs, key=lambda f: f[2])
    return {
        "functions": len(funcs),
        "longest function": f"{longest[1]} ({longest[0]}, {longest[2]} lines)",
        "functions over 60 lines": [f"{f[0]}:{f[1]} ({f[2]})" for f in funcs if f[2] > 60],
        "functions with more than 6 parameters": [f"{f[0]}:{f[1]} ({f[3]})" for f in funcs if f[3] > 6],
        "imports inside functions": nested,
        "modules over 400 lines": [f"{m} ({n})" for m, n in big_modules],
        "modules over 500 lines (benchmarks/ included)": [f"{m} ({n})" for m, n in big_modules if n > 500],
        "test files over 800 lines": test_files_over(800),
        "private names imported across modules (tests excepted)": private,
        "import cycles": [" -> ".join(c) for c in cycles],
        "strategy-name literals in flows/ and tasks/": branches,
    }


def main() -> None:
    show = "--list" in sys.argv
    for name, value in measure().items():
        if isinstance(value, list):
            print(f"{name}: {len(value)}")
            if show:
                print("".join(f"    {v}\n" for v in value), end="")
        else:
            print(f"{name}: {value}")


if __name__ == "__main__":
    main()
