"""Verifiable task families generated in the project (docs/post-training.md, "Generated tasks"): problems with
an answer a program checks, so chat SFT and RL on verifiable rewards run with no hub. The families are the ones
d1 (Zhao et al., 2025, arXiv 2504.12216) trains its masked-diffusion reasoners on, sized for a small model:

- `arithmetic`: "17+25=" → "42" (sums and differences of `max_operand`-bounded integers);
- `countdown`: reach a target from 3 numbers with + − ×, each number used at most once → an expression;
- `sudoku4`: a 4×4 sudoku (2×2 boxes) with a unique solution → its 16 digits, row by row.

Every problem comes with the one reference answer SFT trains on; `check` accepts any correct answer (a countdown
has several). Each family has a brute-force solver that generation asks: a problem is kept only when the solver
finds it solvable (sudoku: exactly one solution)."""

from __future__ import annotations

import ast
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

FAMILIES = ("arithmetic", "countdown", "sudoku4")


class TaskError(ValueError):
    """A task family's settings that give no problem to train on."""


@dataclass(frozen=True)
class Problem:
    """One generated problem: the prompt a user sends, the reference answer, and what `check` reads."""

    family: str
    prompt: str
    answer: str
    facts: tuple  # arithmetic: (a, op, b); countdown: (numbers, target); sudoku4: (puzzle,) with 0 for a blank


# ---------------------------------------------------------------------------------------------- arithmetic


def _arithmetic(rng: random.Random, max_operand: int) -> Problem:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    op = rng.choice("+-")
    if op == "-" and b > a:
        a, b = b, a
    value = a + b if op == "+" else a - b
    return Problem("arithmetic", f"{a}{op}{b}=", str(value), (a, op, b))


def _arithmetic_value(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


# ---------------------------------------------------------------------------------------------- countdown

_OPS = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y, ast.Mult: lambda x, y: x * y}


def countdown_values(numbers: tuple[int, ...]) -> dict[int, str]:
    """Every integer an expression over a subset of `numbers` (each at most once, + − ×, any bracketing) reaches,
    with one expression for it: the brute-force solver."""
    found: dict[int, str] = {}

    def grow(items: list[tuple[int, str]]):
        for value, text in items:
            found.setdefault(value, text)
        for i, j in itertools.permutations(range(len(items)), 2):
            (x, tx), (y, ty) = items[i], items[j]
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            for sym, value in (("+", x + y), ("-", x - y), ("*", x * y)):
                if sym in "+*" and i > j:
                    continue  # commutative: the other order gives the same value
                grow([*rest, (value, f"({tx}{sym}{ty})")])

    grow([(n, str(n)) for n in numbers])
    return {v: (t[1:-1] if t.startswith("(") and t.endswith(")") else t) for v, t in found.items()}


def _countdown(rng: random.Random, max_operand: int) -> Problem:
    numbers = tuple(rng.randint(1, max_operand) for _ in range(3))
    reachable = countdown_values(numbers)
    # a target that needs every number is the harder, d1-like problem; any reachable one is a fallback
    full = [
        v for v, t in reachable.items() if 0 < v <= 4 * max_operand and t.count("+") + t.count("-") + t.count("*") == 2
    ]
    pool = sorted(full) or sorted(v for v in reachable if v > 0)
    target = rng.choice(pool)
    listed = " ".join(str(n) for n in numbers)
    return Problem("countdown", f"{listed} -> {target}:", reachable[target], (numbers, target))


def countdown_value(expression: str, numbers: tuple[int, ...]) -> int | None:
    """The value of `expression` if it uses only integers of `numbers` (each at most as often as given), + − × and
    brackets; None otherwise (never evaluated by Python's `eval`)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    used: list[int] = []

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("not allowed")

    try:
        result = value(tree)
    except (ValueError, RecursionError):
        return None
    pool = list(numbers)
    for n in used:
        if n not in pool:
            return None
        pool.remove(n)
    return result


# ---------------------------------------------------------------------------------------------- sudoku 4×4


def _units() -> list[list[int]]:
    rows = [[4 * r + c for c in range(4)] for r in range(4)]
    cols = [[4 * r + c for r in range(4)] for c in range(4)]
    boxes = [[4 * (br + r) + bc + c for r in range(2) for c in range(2)] for br in (0, 2) for bc in (0, 2)]
    return rows + cols + boxes


UNITS = _units()


def sudoku_solutions(puzzle: tuple[int, ...], limit: int = 2) -> list[tuple[int, ...]]:
    """Up to `limit` completions of a 4×4 puzzle (0 = blank), by backtracking: the brute-force solver."""
    grid, out = list(puzzle), []

    def fits(cell: int, digit: int) -> bool:
        return all(grid[k] != digit for unit in UNITS if cell in unit for k in unit)

    def fill(cell: int) -> None:
        if len(out) >= limit:
            return
        if cell == 16:
            out.append(tuple(grid))
            return
        if grid[cell]:
            return fill(cell + 1)
        for digit in range(1, 5):
            if fits(cell, digit):
                grid[cell] = digit
                fill(cell + 1)
                grid[cell] = 0

    fill(0)
    return out


def _sudoku(rng: random.Random, blanks: int) -> Problem:
    solution = sudoku_solutions((0,) * 16, limit=1)[0]
    digits = list(range(1, 5))
    rng.shuffle(digits)
    solution = tuple(digits[d - 1] for d in solution)  # a relabelling of a valid grid is valid
    puzzle = list(solution)
    for cell in rng.sample(range(16), 16):
        if sum(1 for d in puzzle if d == 0) >= blanks:
            break
        kept, puzzle[cell] = puzzle[cell], 0
        if len(sudoku_solutions(tuple(puzzle))) != 1:
            puzzle[cell] = kept  # that blank would allow a second solution
    shown = "".join(str(d) if d else "." for d in puzzle)
    return Problem("sudoku4", f"sudoku {shown}:", "".join(map(str, solution)), (tuple(puzzle),))


# ---------------------------------------------------------------------------------------------- generation, checks


def generate(family: str, count: int, seed: int, max_operand: int = 50, blanks: int = 6) -> list[Problem]:
    """`count` distinct problems of `family` (distinct prompts), the same for the same arguments; a family whose
    settings cannot give that many distinct problems is one `TaskError` naming what to change."""
    if family not in FAMILIES:
        raise TaskError(f"task family {family!r} is unknown; use one of {', '.join(FAMILIES)}")
    rng = random.Random(f"{family}:{seed}")
    make = {
        "arithmetic": lambda: _arithmetic(rng, max_operand),
        "countdown": lambda: _countdown(rng, max_operand),
        "sudoku4": lambda: _sudoku(rng, blanks),
    }[family]
    seen: dict[str, Problem] = {}
    for _ in range(50 * count + 1000):
        if len(seen) == count:
            break
        problem = make()
        seen.setdefault(problem.prompt, problem)
    if len(seen) < count:
        raise TaskError(
            f"task family {family!r} gave only {len(seen)} distinct problems of the {count} asked "
            f"(max_operand {max_operand}, blanks {blanks}); ask for fewer problems or widen the family's range"
        )
    return list(seen.values())


def check(problem: Problem, completion: str) -> bool:
    """Whether `completion` answers `problem` correctly: the answer is the completion's first line, stripped."""
    answer = completion.strip().split("\n", 1)[0].strip() if completion.strip() else ""
    if problem.family == "arithmetic":
        return answer.lstrip("-").isdigit() and int(answer) == _arithmetic_value(*problem.facts)
    if problem.family == "countdown":
        numbers, target = problem.facts
        return countdown_value(answer, numbers) == target
    (puzzle,) = problem.facts
    if len(answer) != 16 or not answer.isdigit():
        return False
    grid = tuple(int(c) for c in answer)
    given = all(p == 0 or p == g for p, g in zip(puzzle, grid))
    return given and all(sorted(grid[k] for k in unit) == [1, 2, 3, 4] for unit in UNITS)


def iter_problems(family: str, count: int, seed: int, **settings) -> Iterator[tuple[str, Problem]]:
    """(document id, problem) for the data stage: one document per problem, so the train/val split by document is a
    split by problem (the validation problems are held out)."""
    for i, problem in enumerate(generate(family, count, seed, **settings)):
        yield f"{family}-{seed}-{i}", problem
