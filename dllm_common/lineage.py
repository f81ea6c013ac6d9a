"""The code a stage runs, found from its imports: a stage's code version is a digest of its import closure.

A stage's cache key (`dllm_common.store.stage_key`) holds a digest of the source it ran, so editing that source
rebuilds the stage and everything downstream of it (docs/architecture.md, "Stage keys"). No list of modules is
kept by hand: `import_closure(entry)` follows, from the stage's own module, every import statement of every
first-party module it reaches — at module level and inside functions, absolute and relative — and every string
that names a first-party module (`"strategies.mdlm.strategy:MDLMStrategy"` registrations, `python -m
tasks.training.torchrun_entry`, `importlib.import_module(...)`). Importing `a.b.c` runs `a/__init__.py` and
`a/b/__init__.py`, so those packages are in the closure too.

First-party means: a top-level package that lives in the same folder as the entry's own top-level package
(the project's checkout, or wherever it was installed), so a copy of the project on `sys.path` is its own first
party. The closure over-approximates (an import inside a branch never taken still counts): a needless rebuild is
the price of never reusing a result whose code changed.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
from functools import cache, lru_cache
from pathlib import Path
from typing import NamedTuple

__all__ = ["code_digest", "import_closure", "module_file", "same_project"]

# a dotted name, optionally followed by ":attribute" (the registry's lazy "module:Class" form)
_MODULE_STRING = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?::[A-Za-z_][\w.]*)?$")


@cache
def _top_location(top: str) -> Path | None:
    """The folder that holds top-level package/module `top`, or None when it isn't importable from a folder."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        return None
    origin = Path(spec.origin).resolve()
    return origin.parent.parent if spec.submodule_search_locations else origin.parent


def same_project(entry: str, module: str) -> bool:
    """Whether `module` belongs to the project `entry` belongs to (their top-level packages share a folder)."""
    return _top_location(module.split(".")[0]) == _top_location(entry.split(".")[0])


def module_file(name: str, root: Path) -> Path | None:
    """The source file of module `name` under `root` (a package's `__init__.py`), or None when there is none."""
    p = root.joinpath(*name.split("."))
    for candidate in (p.with_suffix(".py"), p / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


class _Refs(NamedTuple):
    modules: frozenset[
        str
    ]  # imported modules, and plain strings that name one (`python -m tasks.training.torchrun_entry`)
    names: frozenset[tuple[str, str]]  # `from base import name`: (base, name), where name may be an attribute
    lazy: dict[str, str]  # name → module of this file's "module:Attr" strings (code loaded on demand)


@lru_cache(maxsize=4096)
def _references(path: str, mtime_ns: int, size: int, package: str) -> _Refs:
    """What the file at `path` imports or names (relative imports resolved against `package`); cached per file
    version, so a stage's key costs a parse only of the files that changed."""
    tree = ast.parse(Path(path).read_bytes(), filename=path)
    modules: set[str] = set()
    names: set[tuple[str, str]] = set()
    lazy: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
                base = ".".join([*parts, node.module] if node.module else parts)
            else:
                base = node.module or ""
            if base:
                modules.add(base)
                names.update((base, alias.name) for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 200:
            match = _MODULE_STRING.match(node.value)
            if match is None:
                continue
            module, _, attr = node.value.partition(":")
            if attr:
                lazy[attr.split(".")[0]] = module
            elif "." in module:
                modules.add(module)
    return _Refs(frozenset(modules), frozenset(names), lazy)


def import_closure(entry: str, *on_demand: str) -> dict[str, Path]:
    """{module name: source file} of every first-party module that `entry` can run, `entry` included.

    Followed: every import statement; `from package import name` where the package's `__init__` loads `name` on
    demand (a "module:name" string there); every plain string that names a first-party module. Not followed: the
    other "module:Attr" strings, code a registry loads only when asked for it (a strategy's class): the stage
    that asks names those modules in `on_demand`."""
    top = entry.split(".")[0]
    root = _top_location(top)
    if root is None or module_file(entry, root) is None:
        raise ValueError(f"no first-party module named {entry!r}")

    def is_first_party(name: str) -> bool:
        return _top_location(name.split(".")[0]) == root

    closure: dict[str, Path] = {}
    refs: dict[str, _Refs] = {}

    def visit(name: str) -> list[str]:
        """Add `name` and its parent packages (importing a.b.c runs a/__init__.py and a/b/__init__.py first);
        return what they reference."""
        found: list[str] = []
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            if mod in closure:
                continue
            path = module_file(mod, root)
            if path is None:  # `from a.b import name` where name is an attribute, not a module
                continue
            closure[mod] = path
            stat = path.stat()
            package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
            refs[mod] = r = _references(str(path), stat.st_mtime_ns, stat.st_size, package)
            found += [m for m in r.modules if is_first_party(m)]
            found += [f"{base}.{n}" for base, n in r.names if is_first_party(base)]
        return found

    pending, pulled = [entry, *on_demand], set()
    while pending:
        while pending:
            pending += visit(pending.pop())
        # a name imported from a package that loads it on demand pulls the module it comes from
        names = {pair for r in refs.values() for pair in r.names if pair[0] in refs}
        lazy = {refs[base].lazy.get(name) for base, name in names} - {None} - pulled
        pulled |= lazy
        pending = [m for m in lazy if is_first_party(m)]
    return closure


def code_digest(entry: str, *on_demand: str) -> str:
    """sha256 (16 hex digits) over the source of every module in `import_closure(entry, *on_demand)`: editing
    any module a stage can run changes it."""
    modules = import_closure(entry, *on_demand)
    h = hashlib.sha256()
    for name in sorted(modules):
        h.update(name.encode() + b"\0")
        h.update(modules[name].read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]
