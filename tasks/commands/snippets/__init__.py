"""Sampling programs that need only torch and transformers: one per strategy whose export is a denoiser
(`<strategy>.py`), each a complete program (`python mdlm.py EXPORT_DIR "PROMPT"`) that reproduces the strategy's
default `dllm-flow generate` sampler at temperature 0 (docs/strategies.md §11.9). The model card of an export
shows its strategy's program ("Sampling without dllm-flow"); tests/pipeline/test_export_snippets.py runs that text with
dllm-flow's packages blocked.

The programs share parts (`common.py`, `absorbing.py`), imported as `from common import ...` so that each file
runs from this folder as it is; `program(strategy)` inlines the parts, so what the card shows is one
self-contained file. A part imports no other part.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Program:
    text: str  # the self-contained program
    summary: str  # the first paragraph of its docstring: what it reproduces


def program(strategy: str) -> Program | None:
    """`<strategy>.py` of this folder with its shared parts inlined (the definitions it uses, and what those use), or
    None where the strategy has no program."""
    path = HERE / f"{strategy}.py"
    if not path.is_file():
        return None
    main = _Split.of(path)
    parts = [_Split.of(HERE / f"{name}.py").keeping(names) for name, names in main.parts.items()]
    straight = set().union(main.straight, *(p.straight for p in parts))
    froms: dict[str, set[str]] = {}
    for piece in (*parts, main):
        for module, names in piece.froms.items():
            froms.setdefault(module, set()).update(names)
    head = "\n\n".join(filter(None, [main.docstring, _import_block(straight, froms)]))
    code = [text for piece in (*parts, main) for _, _, text in piece.statements]
    text = "\n\n\n".join([head, *code]) + "\n"
    summary = " ".join((ast.get_docstring(ast.parse(text)) or "").split("\n\n")[0].split())
    return Program(text, summary)


@dataclass
class _Split:
    """A file of this folder taken apart: its docstring, its imports (those of shared parts apart: {part: names}),
    and its top-level statements after them, each as (names it defines, names it reads, its text)."""

    docstring: str
    straight: set[str] = field(default_factory=set)  # `import x`
    froms: dict[str, set[str]] = field(default_factory=dict)  # `from m import a, b`
    parts: dict[str, set[str]] = field(default_factory=dict)
    statements: list[tuple[set[str], set[str], str]] = field(default_factory=list)

    @classmethod
    def of(cls, path: Path) -> _Split:
        text = path.read_text()
        tree = ast.parse(text)
        lines = text.splitlines()
        nodes = list(tree.body)
        first = nodes[0] if nodes else None
        is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        split = cls(ast.get_source_segment(text, nodes.pop(0)) if is_doc else "")
        end = first.end_lineno if is_doc else 0
        while nodes and isinstance(nodes[0], (ast.Import, ast.ImportFrom)):
            node = nodes.pop(0)
            end = node.end_lineno
            names = {a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names}
            if isinstance(node, ast.Import):
                split.straight |= names
            elif (HERE / f"{node.module}.py").is_file():
                split.parts.setdefault(node.module, set()).update(names)
            else:
                split.froms.setdefault(node.module, set()).update(names)
        for node in nodes:  # each statement with the comments above it
            defined = {node.name} if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else set()
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                defined = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            split.statements.append((defined, read, "\n".join(lines[end : node.end_lineno]).strip("\n")))
            end = node.end_lineno
        return split

    def keeping(self, wanted: set[str]) -> _Split:
        """Only the statements that define a `wanted` name or one such a statement reads."""
        wanted = set(wanted)
        while True:
            more = set().union(*(read for defined, read, _ in self.statements if defined & wanted)) - wanted
            if not more:
                break
            wanted |= more
        kept = [s for s in self.statements if s[0] & wanted]
        return _Split(self.docstring, self.straight, self.froms, self.parts, kept)


def _import_block(straight: set[str], froms: dict[str, set[str]]) -> str:
    """The imports as isort writes them: the standard library, then the rest; `import x` before `from x import`."""

    def stdlib(module: str) -> bool:
        return module.split(".")[0] in sys.stdlib_module_names

    def by_type(name: str) -> tuple[int, str]:  # constants, then classes, then the rest
        return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)

    sections = []
    for wanted in (True, False):
        lines = [f"import {n}" for n in sorted(straight, key=str.lower) if stdlib(n) == wanted]
        lines += [
            f"from {m} import {', '.join(sorted(froms[m], key=by_type))}"
            for m in sorted(froms, key=str.lower)
            if stdlib(m) == wanted
        ]
        if lines:
            sections.append("\n".join(lines))
    return "\n\n".join(sections)
