"""Stage keys cover the code a stage runs (docs/architecture.md, "Stage keys"): a stage's code version is the
digest of its import closure, checked against two oracles that are not `dllm_common.lineage` — Python's own
`modulefinder` (every import statement, reached statically) and the code that really runs while the stage
does (every first-party function called, traced with `sys.setprofile`) — and by editing a copy of the project:
an edited module rebuilds the stages whose closure holds it and what depends on them, nothing upstream."""

import json
import modulefinder
import os
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import ROOT
from stagekit import expected_statuses

from dllm_common.lineage import code_digest, import_closure
from strategies.registry import on_demand_modules
from tasks.common import stage_code_version
from tasks.stages import declarations

PACKAGES = ("flows", "tasks", "strategies", "dllm_common")
# every stage's module, from the stages' declarations (`tasks.stages`), not listed
STAGES = sorted({stage.task.fn.__module__ for stage in declarations()})


def first_party(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def test_every_stage_of_the_dag_is_found():
    """The stages are their declarations' (tasks/stages.py): each module keys itself and declares itself, the
    DFlash wing's among them."""
    import importlib

    from tasks.stages import STAGES as REGISTERED

    assert len(STAGES) == len(REGISTERED) and "tasks.speculative.cache_target" in STAGES
    for module in STAGES:
        mod = importlib.import_module(module)
        assert callable(mod.stage_of) and mod.DECLARATION.task.fn.__module__ == module


def strategy_closure(entry: str, strategy: str) -> set[str]:
    return set(import_closure(entry, *on_demand_modules(strategy)))


# ---------------------------------------------------------------- the closure, against modulefinder


@pytest.mark.parametrize("entry", STAGES)
def test_every_module_a_stage_imports_is_in_its_key(entry):
    """Python's modulefinder follows every import statement (functions included) of the project's modules."""
    finder = modulefinder.ModuleFinder(path=[str(ROOT)])
    finder.import_hook(entry)
    imported = {m for m in finder.modules if first_party(m)}
    closure = set(import_closure(entry))
    assert entry in closure and len(imported) > 5
    assert imported - closure == set()


def test_the_closure_follows_module_strings_and_on_demand_names(tmp_path):
    """`python -m pkg.mod` strings are followed, "module:Name" registrations only when asked for, and a name a
    package loads on demand pulls its module when imported from the package."""
    pkg = tmp_path / "lineagepkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('_LAZY = {"Thing": "lineagepkg.sub.thing:Thing"}\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "thing.py").write_text("class Thing: ...\n")
    (pkg / "sub" / "plugin.py").write_text("class Plugin: ...\n")
    (pkg / "sub" / "launched.py").write_text("")
    (pkg / "entry.py").write_text(
        "def f():\n"
        "    from lineagepkg import Thing\n"
        "    REG = 'lineagepkg.sub.plugin:Plugin'\n"
        "    return ['python', '-m', 'lineagepkg.sub.launched'], Thing, REG\n"
    )
    (pkg / "other.py").write_text("from . import sub\n")
    sys.path.insert(0, str(tmp_path))
    try:
        closure = set(import_closure("lineagepkg.entry"))
        assert closure == {"lineagepkg", "lineagepkg.entry", "lineagepkg.sub", "lineagepkg.sub.thing"} | {
            "lineagepkg.sub.launched"
        }
        assert "lineagepkg.sub.plugin" in import_closure("lineagepkg.entry", "lineagepkg.sub.plugin")
        assert set(import_closure("lineagepkg.other")) == {"lineagepkg", "lineagepkg.other", "lineagepkg.sub"}
        before = code_digest("lineagepkg.entry")
        (pkg / "sub" / "plugin.py").write_text("class Plugin: x = 1\n")
        assert code_digest("lineagepkg.entry") == before  # not loaded by the entry unless asked
        (pkg / "sub" / "thing.py").write_text("class Thing: x = 1\n")
        assert code_digest("lineagepkg.entry") != before
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("lineagepkg")]:
            del sys.modules[name]
    with pytest.raises(ValueError, match="no first-party module named 'tasks.nope'"):
        import_closure("tasks.nope")


def test_a_strategy_stage_is_keyed_by_its_own_strategy_only():
    """train[mdlm] holds the mdlm strategy's class and its imports, not another strategy's (their options, read
    by the registry, and their model shapes, offered every checkpoint folder, are in every such stage)."""
    mdlm, hybrid = strategy_closure("tasks.train", "mdlm"), strategy_closure("tasks.train", "hybrid")
    assert "strategies.mdlm.strategy" in mdlm and "strategies.mdlm.loss" in mdlm
    assert "strategies.hybrid.strategy" not in mdlm and "strategies.hybrid.loss" not in mdlm
    assert "strategies.hybrid.model" in hybrid and "strategies.hybrid.model" in mdlm  # a model shape
    assert stage_code_version("tasks.train", "mdlm") != stage_code_version("tasks.train", "hybrid")
    data = set(import_closure("tasks.prepare_data"))
    assert not any(m.endswith((".strategy", ".loss")) for m in data), sorted(data)


# ---------------------------------------------------------------- the closure, against the code that runs


@contextmanager
def code_that_runs():
    """The first-party modules whose code runs inside the block (any thread): module bodies and functions."""
    seen: set[str] = set()
    roots = {str(ROOT / p) for p in PACKAGES}

    def profile(frame, event, _arg):
        if event == "call":
            filename = frame.f_code.co_filename
            if filename.startswith(tuple(roots)):
                seen.add(filename)

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    names = {".".join(Path(f).relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__") for f in seen}
    seen.clear()
    seen.update(names)


@pytest.mark.slow
def test_every_module_whose_code_runs_in_a_stage_is_in_its_key(tiny_spec, tmp_path):
    """The mdlm chain (prepare_data → train → evaluate → report) and the DFlash chain (pretrain_target →
    cache_target → train[dflash]) on tiny data: what each stage ran is in its key."""
    from stagekit import dflash_spec

    from tasks.evaluate import evaluate
    from tasks.prepare_data import prepare_data
    from tasks.report import report
    from tasks.speculative.cache_target import cache_target
    from tasks.speculative.target import target
    from tasks.train import train

    workdir = str(tmp_path)
    ran = {}
    with code_that_runs() as ran["tasks.prepare_data"]:
        data = prepare_data(tiny_spec, workdir)
    with code_that_runs() as ran["tasks.train/mdlm"]:
        trained = train(tiny_spec, "mdlm", data, workdir)
    with code_that_runs() as ran["tasks.evaluate/mdlm"]:
        evaluated = evaluate(tiny_spec, "mdlm", trained, data, workdir)
    with code_that_runs() as ran["tasks.report"]:
        report("t", [trained], [evaluated], workdir)
    spec = dflash_spec(tiny_spec)
    with code_that_runs() as ran["tasks.speculative.target"]:
        tgt = target(spec, data, workdir)
    with code_that_runs() as ran["tasks.speculative.cache_target/dflash"]:  # keyed by the draft strategy too
        feats = cache_target(spec, tgt, data, workdir)
    with code_that_runs() as ran["tasks.train/dflash"]:
        train(spec, "dflash", data, workdir, inputs={"target": tgt, "features": feats})

    missing = {}
    for stage, modules in ran.items():
        entry, _, strategy = stage.partition("/")
        closure = strategy_closure(entry, strategy) if strategy else set(import_closure(entry))
        assert entry in modules, stage  # the trace saw the stage itself
        if modules - closure:
            missing[stage] = sorted(modules - closure)
    assert missing == {}


# ---------------------------------------------------------------- editing a copy of the project

EDIT_EVERY_MODULE = """
import json, sys
from pathlib import Path
from dllm_common.lineage import import_closure
from tasks.common import stage_code_version
from strategies.registry import on_demand_modules

stages = json.loads(sys.argv[1])
keys = lambda: {s: stage_code_version(*s.split("/")) for s in stages}
closures = {s: set(import_closure(s.split("/")[0], *(on_demand_modules(s.split("/")[1]) if "/" in s else ())))
            for s in stages}
before = keys()
changed = {}
for module in sorted(set().union(*closures.values())):
    path = Path(import_closure(module)[module])
    text = path.read_text()
    path.write_text(text + "\\n# edited\\n")
    try:
        after = keys()
    finally:
        path.write_text(text)
    changed[module] = sorted(s for s in stages if after[s] != before[s])
assert keys() == before
print(json.dumps({"changed": changed, "closures": {s: sorted(c) for s, c in closures.items()}}))
"""


def copy_of_the_project(dest: Path) -> Path:
    for name in (*PACKAGES, "configs"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def test_editing_any_module_changes_the_keys_of_the_stages_that_run_it_and_no_other(tmp_path):
    """In a copy of the project (first on sys.path), each module of any stage's closure is edited in turn: the
    code version of exactly the stages whose closure holds it changes; the modulefinder oracle says the same."""
    copy = copy_of_the_project(tmp_path / "copy")
    stages = [*STAGES, "tasks.train/mdlm", "tasks.train/scdd", "tasks.evaluate/mdlm", "tasks.train/dflash"]
    env = {**os.environ, "PYTHONPATH": str(copy)}
    out = subprocess.run(
        [sys.executable, "-c", EDIT_EVERY_MODULE, json.dumps(stages)],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    changed, closures = result["changed"], result["closures"]
    for module, stages_changed in changed.items():
        assert stages_changed == sorted(s for s in stages if module in closures[s]), module
    # editing a module only a downstream stage runs leaves the upstream stages' code versions alone
    assert changed["tasks.evaluation.scoring"] and "tasks.prepare_data" not in changed["tasks.evaluation.scoring"]
    assert (
        "tasks.train/mdlm" not in changed["tasks.evaluation.scoring"]
        and "tasks.evaluate/mdlm" in changed["tasks.evaluation.scoring"]
    )
    assert set(changed["tasks.rows"]) == set(stages)  # the rows every stage reads
    assert "strategies.hybrid.loss" not in changed  # no stage here trains hybrid: no key holds its loss
    assert (
        "tasks.train/mdlm" in changed["strategies.mdlm.loss"]
        and "tasks.train/scdd" not in changed["strategies.mdlm.loss"]
    )
    for entry in STAGES:  # the independent oracle agrees: every module modulefinder reaches is keyed
        finder = modulefinder.ModuleFinder(path=[str(ROOT)])
        finder.import_hook(entry)
        for module in (m for m in finder.modules if first_party(m)):
            assert entry in changed[module], (entry, module)


@pytest.mark.slow
def test_an_edited_metric_rebuilds_evaluate_and_report_and_reuses_the_rest(tmp_path, prefect_api):
    """The case that went stale before: run the smoke pipeline from a copy of the project, double how
    `eval/entropy` is computed (`tasks/evaluation/scoring.py`), run again: evaluate and report rebuild with the new
    value, prepare_data and train are reused. Then edit the mdlm loss's module: train and what follows rebuild, the
    data is reused."""
    copy = copy_of_the_project(tmp_path / "copy")
    workdir = tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k != "DLLM_FLOW_FAULT"}
    env.update(PYTHONPATH=str(copy), PREFECT_API_URL=prefect_api)

    def run():
        out = subprocess.run(
            [sys.executable, "-m", "flows.cli", "run", "configs/smoke.yaml", "--workdir", str(workdir)],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
        record = json.loads(sorted((workdir / "runs").glob("*.json"))[-1].read_text())
        return {s["name"]: s["status"] for s in record["stages"]}

    def entropy():
        manifests = [json.loads(p.read_text()) for p in (workdir / "store" / "evaluate").glob("*/manifest.json")]
        latest = max(manifests, key=lambda m: m["published_at"])
        return latest["info"]["metrics"]["eval/entropy"]

    assert set(run().values()) == {"COMPLETED"}
    first = entropy()
    scoring = copy / "tasks" / "evaluation" / "scoring.py"
    text = scoring.read_text()
    old = 'return sum(values) / len(values) if values else float("nan")'
    assert old in text
    scoring.write_text(text.replace(old, 'return 2 * sum(values) / len(values) if values else float("nan")'))
    assert run() == expected_statuses("configs/smoke.yaml", {"evaluate[mdlm]"})
    assert entropy() == pytest.approx(2 * first)
    loss = copy / "strategies" / "mdlm" / "loss.py"
    loss.write_text(loss.read_text() + "\n# edited\n")
    assert run() == expected_statuses("configs/smoke.yaml", {"train[mdlm]"})


def test_every_name_strategies_loads_on_demand_resolves():
    """`strategies/__init__.py` keeps the names it exported before it became lazy: each resolves to the object
    its module defines, and an unknown one is an AttributeError."""
    import importlib

    import strategies

    for name, where in strategies._ON_DEMAND.items():
        module, _, attr = where.partition(":")
        assert attr == name and getattr(strategies, name) is getattr(importlib.import_module(module), attr)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        strategies.Nope  # noqa: B018
