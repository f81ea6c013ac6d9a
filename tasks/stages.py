"""Declared stages: what a stage module says about itself, the one list of stages, and the graph derived from them.

A stage module ends with one `Stage(...)` declaration (`DECLARATION`): its name, the Prefect task over its plain
function, the role it produces and the roles it consumes, whether it runs once per pipeline or once per strategy
(and for which strategies), when the YAML enables it, and what it adds to the report. `STAGES` lists the built-in
declarations; `register` / `registered` add one at run time (a test, a notebook, a plugin). `derive` turns the
declarations and one pipeline's YAML into the graph `flows/pipeline.py` runs: no stage is named there
(docs/architecture.md, "How a stage plugs in").

Roles are the names stages exchange `StageRef`s under: `data`, `target`, `regenerated`, `features`, `trained`,
`evaluated`, `report`, or any new name a stage produces. A per-strategy stage consuming a per-strategy role gets its
own strategy's ref; a pipeline stage consuming one gets the list over the strategies, in the YAML's order.
"""

from __future__ import annotations

import graphlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "STAGES",
    "Column",
    "Graph",
    "Node",
    "Roles",
    "Stage",
    "StageContext",
    "declarations",
    "derive",
    "register",
    "registered",
    "report_columns",
]


@dataclass(frozen=True)
class Column:
    """A report column a stage adds: `header`, the MLflow metric of the strategy's run it shows, its digits."""

    header: str
    metric: str
    digits: int = 4


@dataclass(frozen=True)
class Roles:
    """Several roles as one parameter: the stage gets `{role: ref}` (or `{role: [refs]}` across strategies).
    `optional`: a role no stage of this pipeline produces is left out instead of refused."""

    names: tuple[str, ...]
    optional: bool = False


Consumed = str | Roles


@dataclass(frozen=True)
class StageContext:
    """What every stage of one pipeline run may take besides its inputs (by parameter name, `values`)."""

    spec: Any
    workdir: str
    parent_run_id: str | None
    run_id: str

    def values(self, strategy: str | None) -> dict[str, Any]:
        t = self.spec.tracking
        return {
            "spec": self.spec,
            "strategy": strategy,
            "workdir": self.workdir,
            "parent_run_id": self.parent_run_id,
            "pipeline_name": self.spec.pipeline.name,
            "tracking_uri": t.uri,
            "experiment": t.experiment,
        }


def _always(*_) -> bool:
    return True


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage, as its module declares it (docs/architecture.md, "How a stage plugs in").

    `task`: the thin Prefect task over the stage's plain function (`tasks.common.prefect_task`: cached by the
    stage's store key, its MLflow side effects named there); `task_for(spec)` picks another one for some configs
    (the train stage on a GPU deployment). The function receives, by parameter name, the refs of what it consumes
    and any of `spec`, `strategy`, `workdir`, `parent_run_id`, `pipeline_name`, `tracking_uri`, `experiment`.
    `consumes(spec, strategy)` (or a plain mapping) maps parameters to roles. `applies(cls, spec)`: for a
    per-strategy stage, whether the strategy class takes part. `enabled(spec)`: whether the YAML turns it on.
    `on_demand`: it runs only when a stage of the graph consumes what it produces (a DFlash target). `leader_only`:
    node k > 0 of a multi-node training skips it. `checks`: `(roles, check(spec, **refs))` run as soon as those
    roles exist and before any later stage (refusing a bad config before hours of training). `after(ref, refs,
    ctx)`: side effects once it ran (reused too), returning entries for the flow's result. `title(spec)`: its name
    when the config decides it."""

    name: str
    task: Any
    produces: str
    consumes: Mapping[str, Consumed] | Callable[[Any, str | None], Mapping[str, Consumed]] = field(default_factory=dict)
    per_strategy: bool = False
    applies: Callable[[type, Any], bool] = _always
    enabled: Callable[[Any], bool] = _always
    on_demand: bool = False
    leader_only: bool = False
    checks: tuple[tuple[tuple[str, ...], Callable], ...] = ()
    after: Callable | None = None
    title: Callable[[Any], str] | None = None
    task_for: Callable[[Any], Any] | None = None
    report_columns: tuple[Column, ...] = ()

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(
                f"a stage name is an identifier (it names store folders and MLflow runs), got {self.name!r}"
            )

    def inputs(self, spec, strategy: str | None) -> dict[str, Consumed]:
        return dict(self.consumes(spec, strategy) if callable(self.consumes) else self.consumes)

    def display_name(self, spec, strategy: str | None) -> str:
        base = self.title(spec) if self.title else self.name
        return f"{base}[{strategy}]" if strategy else base

    def task_of(self, spec):
        return self.task_for(spec) if self.task_for else self.task

    def parameters(self, spec) -> set[str]:
        task = self.task_of(spec)
        return set(inspect.signature(getattr(task, "fn", task)).parameters)


# The built-in stages, as "module:attribute" (loaded on first use, so this list imports nothing heavy and no stage's
# key holds another's code). A new stage adds one line here, or registers itself at run time (`register`).
STAGES: dict[str, str] = {
    "prepare_data": "tasks.prepare_data:DECLARATION",
    "target": "tasks.speculative.target:DECLARATION",
    "regenerate": "tasks.speculative.regenerate:DECLARATION",
    "cache_target": "tasks.speculative.cache_target:DECLARATION",
    "train": "tasks.train:DECLARATION",
    "evaluate": "tasks.evaluate:DECLARATION",
    "grpo": "tasks.posttrain.grpo:DECLARATION",
    "evaluate_grpo": "tasks.posttrain.evaluate_tuned:DECLARATION",
    "report": "tasks.report:DECLARATION",
}
_RUNTIME: dict[str, Stage] = {}


def _load(ref: str) -> Stage:
    import importlib

    module, _, attr = ref.partition(":")
    stage = getattr(importlib.import_module(module), attr)
    if not isinstance(stage, Stage):
        raise TypeError(f"{ref} is a {type(stage).__name__}, not a tasks.stages.Stage declaration")
    return stage


def declarations() -> list[Stage]:
    """Every declared stage: the built-in ones, then those registered at run time, in that order."""
    return [*(_load(ref) for ref in STAGES.values()), *_RUNTIME.values()]


def register(stage: Stage) -> Stage:
    """Add a stage at run time (a built-in one is listed in `STAGES` instead); a name already taken is refused."""
    if not isinstance(stage, Stage):
        raise TypeError(f"register() takes a tasks.stages.Stage, got {type(stage).__name__}")
    if stage.name in STAGES or stage.name in _RUNTIME:
        raise ValueError(f"stage {stage.name!r} is already declared; give the new stage another name")
    _RUNTIME[stage.name] = stage
    return stage


@contextmanager
def registered(stage: Stage) -> Iterator[Stage]:
    """`register` for the duration of a `with` block."""
    register(stage)
    try:
        yield stage
    finally:
        _RUNTIME.pop(stage.name, None)


def report_columns() -> list[Column]:
    """The report columns every declared stage adds, in declaration order."""
    return [column for stage in declarations() for column in stage.report_columns]


# ---------------------------------------------------------------------------------------------- the graph


@dataclass(frozen=True)
class Node:
    """One stage instance of a pipeline: the stage, its strategy (per-strategy stages), its name in the run record,
    and the nodes it reads, per parameter (one node, a list across strategies, or a dict by role)."""

    stage: Stage
    strategy: str | None
    name: str
    inputs: dict[str, Any]

    def upstream(self) -> list[Node]:
        found: list[Node] = []
        for value in self.inputs.values():
            items = value.values() if isinstance(value, dict) else [value]
            for item in items:
                found += item if isinstance(item, list) else [item]
        return found


@dataclass(frozen=True)
class Graph:
    """A pipeline's stages in a topological order: `head` runs once before the strategies, `chains[strategy]`
    for each strategy (fanned out), `tail` once after them."""

    head: list[Node]
    chains: dict[str, list[Node]]
    tail: list[Node]

    def nodes(self) -> list[Node]:
        return [*self.head, *(n for chain in self.chains.values() for n in chain), *self.tail]

    def table(self) -> list[tuple[str, str, str]]:
        """(stage, consumes, produces) rows in run order: what `dllm-flow validate` and the docs show."""
        return [
            (n.name, ", ".join(dict.fromkeys(u.name for u in n.upstream())) or "–", n.stage.produces)
            for n in self.nodes()
        ]


def _candidates(spec, strategy_class: Callable[[str], type]) -> list[tuple[Stage, str | None]]:
    out: list[tuple[Stage, str | None]] = []
    for stage in declarations():
        if not stage.enabled(spec):
            continue
        if not stage.per_strategy:
            out.append((stage, None))
            continue
        out += [(stage, s) for s in spec.pipeline.strategies if stage.applies(strategy_class(s), spec)]
    return out


def derive(spec, strategy_class: Callable[[str], type]) -> Graph:
    """The graph of `spec`'s pipeline: every enabled stage that is not on demand, the on-demand stages whose roles
    those consume (transitively), in a topological order, split into head, per-strategy chains and tail."""
    candidates = _candidates(spec, strategy_class)
    producers: dict[str, list[tuple[Stage, str | None]]] = {}
    for stage, strategy in candidates:
        producers.setdefault(stage.produces, []).append((stage, strategy))
    nodes: dict[tuple[str, str | None], Node] = {}

    def node(stage: Stage, strategy: str | None) -> Node:
        if (stage.name, strategy) in nodes:
            return nodes[(stage.name, strategy)]
        inputs = {p: _resolve(stage, strategy, p, r, producers, node) for p, r in stage.inputs(spec, strategy).items()}
        made = nodes[(stage.name, strategy)] = Node(stage, strategy, stage.display_name(spec, strategy), inputs)
        return made

    for stage, strategy in candidates:
        if not stage.on_demand:
            node(stage, strategy)
    return _split(list(nodes.values()))


def _resolve(stage: Stage, strategy: str | None, param: str, consumed: Consumed, producers, node) -> Any:
    """The node(s) that parameter `param` of `stage` reads."""
    if isinstance(consumed, Roles):
        out = {}
        for role in consumed.names:
            if role in producers or not consumed.optional:
                out[role] = _resolve(stage, strategy, param, role, producers, node)
        return out
    made = producers.get(consumed, [])
    own = [(s, k) for s, k in made if k is None or strategy is None or k == strategy]
    if not own:
        who = f"{stage.name}[{strategy}]" if strategy else stage.name
        raise ValueError(
            f"stage {who} consumes {consumed!r} (its parameter {param}), which no stage enabled for this pipeline "
            f"produces; declared producers of it: {sorted({s.name for s, _ in made}) or 'none'}"
        )
    if strategy is None and any(k is not None for _, k in own):  # a pipeline stage reads every strategy's
        return [node(s, k) for s, k in own]
    if len(own) > 1:
        raise ValueError(f"role {consumed!r} is produced by several stages: {[s.name for s, _ in own]}")
    return node(*own[0])


def _split(nodes: list[Node]) -> Graph:
    sorter = graphlib.TopologicalSorter({n.name: [u.name for u in n.upstream()] for n in nodes})
    order = {name: i for i, name in enumerate(sorter.static_order())}  # refuses a cycle (graphlib.CycleError)
    by_name = {n.name: n for n in nodes}
    after_strategies: set[str] = set()
    for name in sorted(order, key=order.get):
        n = by_name[name]
        if n.strategy is None and any(u.strategy is not None or u.name in after_strategies for u in n.upstream()):
            after_strategies.add(name)
        elif n.strategy is not None and any(u.name in after_strategies for u in n.upstream()):
            late = [u.name for u in n.upstream() if u.name in after_strategies]
            raise ValueError(
                f"stage {name} runs per strategy but reads {late}, which run after every strategy: a per-strategy "
                "stage can only follow the pipeline stages before them"
            )
    ordered = sorted(nodes, key=lambda n: order[n.name])
    chains: dict[str, list[Node]] = {}
    for n in ordered:
        if n.strategy is not None:
            chains.setdefault(n.strategy, []).append(n)
    return Graph(
        head=[n for n in ordered if n.strategy is None and n.name not in after_strategies],
        chains=chains,
        tail=[n for n in ordered if n.name in after_strategies],
    )
