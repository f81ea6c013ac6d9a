"""The lm-evaluation-harness task names of `eval.lm_eval`, checked when a pipeline file is loaded (before any
training), and the harness's task index the evaluate stage runs them from. The harness is imported only when
the config names tasks (`pip install 'dllm-flow[lmeval]'`)."""

from __future__ import annotations

import difflib
import functools
import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING

from dllm_common.config import ConfigError, LMEvalConfig

if TYPE_CHECKING:
    from lm_eval.tasks import TaskManager

LMEVAL_MISSING = "eval.lm_eval needs the lmeval extra: pip install 'dllm-flow[lmeval]'"


def check_harness_tasks(settings: LMEvalConfig | None) -> None:
    """`eval.lm_eval`: the harness is installed, `include_path` is a folder and every task name is one the harness
    knows (a task, group or tag; or a task YAML file), checked before any training instead of after it. A name
    found by a quick scan of the task YAMLs costs about a second; any other is looked up in the harness's own
    index (~20 s) before it is refused with the closest names."""
    if settings is None:
        return
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(f"{LMEVAL_MISSING}, or remove eval.lm_eval")
    if settings.include_path is not None and not Path(settings.include_path).is_dir():
        raise ConfigError(
            f"eval.lm_eval.include_path {settings.include_path!r} is not a directory; give the folder of your task "
            "YAML files, or remove the key"
        )
    unknown = _unknown_harness_tasks(settings.tasks, settings.include_path)
    if unknown:
        named = "; ".join(
            f"{name!r}" + (f" (did you mean {', '.join(close)}?)" if close else "") for name, close in unknown
        )
        raise ConfigError(
            f"eval.lm_eval.tasks: unknown lm-eval task{'s' if len(unknown) > 1 else ''} {named}; `lm-eval ls tasks` "
            "lists the harness's tasks, and eval.lm_eval.include_path adds a folder of your own"
        )


# a top-level `task:`, `group:` or `tag:` of a task YAML, with a block list of tags under it
_DECLARED = re.compile(r"^(task|group|tag):[ \t]*([^\n#]*)((?:\n[ \t]*-[ \t]*[^\n]*)*)", re.M)


def _declared_names(root: Path) -> set[str]:
    """The task, group and tag names the YAML files under `root` declare themselves (what `include:` brings in is
    missed: a name not found here is looked up in the harness's index)."""
    names: set[str] = set()
    for path in root.rglob("*.yaml"):
        for key, value, items in _DECLARED.findall(path.read_text(encoding="utf-8", errors="replace")):
            value = value.strip()
            if value.startswith("["):
                values = value.strip("[]").split(",")
            elif value:
                values = [value]
            else:
                values = [line.strip()[1:] for line in items.splitlines() if line.strip()] if key == "tag" else []
            names.update(v.strip().strip("'\"") for v in values if v.strip())
    return names


@functools.lru_cache(maxsize=8)
def _unknown_harness_tasks(tasks: tuple[str, ...], include_path: str | None) -> list[tuple[str, list[str]]]:
    """(name, closest known names) of each task name the harness would not find; cached for the process (the
    CLI checks before the flow starts, the flow again for a deployment or a resumed run)."""
    missing = [t for t in tasks if not (t.endswith(".yaml") and Path(t).is_file())]
    builtin = Path(importlib.util.find_spec("lm_eval").submodule_search_locations[0]) / "tasks"
    roots = [builtin] if include_path is None else [Path(include_path), builtin]  # your own folder first
    for root in roots:
        declared = _declared_names(root)
        missing = [t for t in missing if t not in declared]
        if not missing:
            return []
    known = task_manager(tuple(missing), include_path).all_tasks
    return [(t, difflib.get_close_matches(t, known, n=3)) for t in missing if t not in known]


def task_manager(tasks: tuple[str, ...], include_path: str | None) -> TaskManager:
    """The harness's task index: only `include_path` when it holds every listed task (indexing the
    built-in tasks takes seconds), otherwise the built-in tasks too."""
    from lm_eval.tasks import TaskManager  # the harness: seconds to import, and builds its index

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise FileNotFoundError(f"eval.lm_eval.include_path {include_path!r} is not a directory")
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    return TaskManager(include_path=include_path)
