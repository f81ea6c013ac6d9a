"""The generated task families (docs/post-training.md, "Generated tasks") against brute force written here, apart
from the project's solvers: every reference answer is correct, every problem solvable (a sudoku exactly once),
`check` accepts correct answers and refuses wrong ones, and a family that cannot give the problems asked for is
one error naming what to change."""

import itertools
import re

import pytest

from tasks.posttrain.families import TaskError, check, countdown_value, generate


def _expressions(numbers):
    """Every value of + − × over a subset of `numbers` with every bracketing, by exhaustive enumeration."""
    values = set()
    for k in range(1, len(numbers) + 1):
        for chosen in itertools.permutations(numbers, k):
            values |= _values(list(chosen))
    return values


def _values(items):
    if len(items) == 1:
        return {items[0]}
    out = set()
    for cut in range(1, len(items)):
        for x in _values(items[:cut]):
            for y in _values(items[cut:]):
                out |= {x + y, x - y, x * y}
    return out


def _sudoku_completions(puzzle):
    blanks = [i for i, d in enumerate(puzzle) if d == 0]
    rows = [[4 * r + c for c in range(4)] for r in range(4)]
    cols = [[4 * r + c for r in range(4)] for c in range(4)]
    boxes = [[4 * (br + r) + bc + c for r in range(2) for c in range(2)] for br in (0, 2) for bc in (0, 2)]
    found = []
    for digits in itertools.product(range(1, 5), repeat=len(blanks)):
        grid = list(puzzle)
        for i, d in zip(blanks, digits):
            grid[i] = d
        if all(sorted(grid[k] for k in unit) == [1, 2, 3, 4] for unit in rows + cols + boxes):
            found.append("".join(map(str, grid)))
    return found


def test_arithmetic_answers_are_the_sums_and_differences():
    for p in generate("arithmetic", 300, 3, max_operand=40):
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", p.prompt).groups()
        assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
        assert check(p, p.answer) and check(p, f" {p.answer}\nmore") and not check(p, str(int(p.answer) + 1))


def test_countdown_answers_reach_the_target_and_every_problem_is_reachable():
    for p in generate("countdown", 60, 5, max_operand=12):
        numbers, target = p.facts
        assert target in _expressions(list(numbers))  # solvable by exhaustive search
        assert re.fullmatch(r"[\d+\-*() ]+", p.answer)
        assert eval(p.answer, {"__builtins__": {}}) == target  # noqa: S307 (digits, + − ×, brackets only)
        assert check(p, p.answer)
    numbers, target = (3, 5, 7), 22
    p = generate("countdown", 1, 5, max_operand=12)[0]
    p = type(p)("countdown", "", "", (numbers, target))
    assert check(p, "3*5+7") and check(p, "7+5*3") and check(p, "(7+5)*3-14") is False
    assert countdown_value("3*3+13", numbers) is None  # 3 used twice, 13 not given
    assert countdown_value("__import__('os')", numbers) is None
    assert countdown_value("7/7", numbers) is None  # division is not one of the operations
    assert not check(p, "")


def test_sudoku_puzzles_have_exactly_one_solution_the_answer():
    for p in generate("sudoku4", 40, 2, blanks=8):
        (puzzle,) = p.facts
        assert sum(d == 0 for d in puzzle) <= 8
        assert _sudoku_completions(puzzle) == [p.answer]
        assert check(p, p.answer)
        wrong = p.answer[1] + p.answer[0] + p.answer[2:]
        assert wrong == p.answer or not check(p, wrong)


def test_generation_is_deterministic_and_distinct():
    a, b = generate("countdown", 50, 1), generate("countdown", 50, 1)
    assert a == b and len({p.prompt for p in a}) == 50
    assert generate("countdown", 50, 2) != a


def test_a_family_that_cannot_give_enough_problems_names_what_to_change():
    # 0+0, 0+1, 1+0, 1+1, 0-0, 1-0, 1-1
    with pytest.raises(TaskError, match=r"gave only 7 distinct problems of the 10 asked \(max_operand 1"):
        generate("arithmetic", 10, 0, max_operand=1)
    with pytest.raises(TaskError, match="task family 'chess' is unknown; use one of arithmetic, countdown, sudoku4"):
        generate("chess", 10, 0)
