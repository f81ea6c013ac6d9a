"""Evaluation-only code is out of training's key (docs/architecture.md, "Stage keys"): in a copy of the project,
editing a sampler, the samplers' shared machinery or an evaluator (the base class's evaluation hooks, a
strategy's own) changes the `evaluate[...]` key of the strategies that run it and no `train[...]` key; editing
the training kernel changes every `train[...]` key. For all registered strategies, in a subprocess whose first
`sys.path` entry is the copy; no training (one subprocess, its first keys cost the parse of every module)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

from strategies.registry import REGISTRY

PACKAGES = ("tasks", "strategies", "dllm_common")  # what a stage key reads (flows/ is above every stage)
STRATEGIES = sorted(REGISTRY)

# each strategy's own sampler module (mdlm's is the absorbing sampler every masked strategy offers too)
OWN_SAMPLERS = {
    "mdlm": "strategies/absorbing.py",
    "scdd": "strategies/scdd/sampling.py",
    "hybrid": "strategies/hybrid/sampling.py",
    "idlm": "strategies/idlm/sampling.py",
    "block_diffusion": "strategies/block_diffusion/sampling.py",
    "dflash": "strategies/dflash/decoding.py",
}
OWN_EVALUATORS = {
    "scdd": "strategies/scdd/evaluation.py",
    "hybrid": "strategies/hybrid/evaluation.py",
    "idlm": "strategies/idlm/evaluation.py",
    "block_diffusion": "strategies/block_diffusion/evaluation.py",
}
# what every evaluation runs or may run: the base evaluator, the samplers' shared values and caches, the
# absorbing sampler (`--sampler llada`), the speculative decoder the evaluate stage imports
SHARED = (
    "strategies/base_evaluation.py",
    "strategies/sampling.py",
    "strategies/decoding_cache.py",
    "strategies/absorbing.py",
    "strategies/dflash/decoding.py",
)
NO_OP_HOOK = "\n\ndef _an_evaluation_hook_added_later(model):  # edited\n    return None\n"

EDIT_AND_KEY = """
import json, sys
from pathlib import Path
from tasks.common import stage_code_version

strategies, edits = json.loads(sys.argv[1]), json.loads(sys.argv[2])  # edits: [[label, path, text appended]]
keys = lambda: {f"{stage}[{s}]": stage_code_version(f"tasks.{stage}", s) for stage in ("train", "evaluate")
                for s in strategies}
before = keys()
changed = {}
for label, edit, addition in edits:
    path = Path(edit)
    text = path.read_text()
    path.write_text(text + addition)
    try:
        after = keys()
    finally:
        path.write_text(text)
    changed[label] = sorted(k for k in before if after[k] != before[k])
assert keys() == before
print(json.dumps(changed))
"""


def copy_of_the_project(dest: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def keys_changed_by(copy: Path, edits: list[tuple[str, str, str]]) -> dict[str, set[str]]:
    """{label: the stage keys that changed} for each (label, file, text appended to it), one edit at a time."""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    out = subprocess.run(
        [sys.executable, "-c", EDIT_AND_KEY, json.dumps(STRATEGIES), json.dumps(edits)],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {label: set(keys) for label, keys in json.loads(out.stdout.splitlines()[-1]).items()}


def test_editing_evaluation_code_re_evaluates_and_never_retrains(tmp_path):
    """Each sampler and evaluator gets a no-op function appended (an evaluation hook added later); the base
    evaluator and one sampler also a comment, the smallest edit (the key hashes the source, not its behaviour)."""
    copy = copy_of_the_project(tmp_path / "copy")
    files = sorted({*OWN_SAMPLERS.values(), *OWN_EVALUATORS.values(), *SHARED, "strategies/corruption.py"})
    comments = ("strategies/base_evaluation.py", "strategies/scdd/sampling.py")
    edits = [(f, f, NO_OP_HOOK) for f in files] + [(f"# {f}", f, "\n# edited\n") for f in comments]
    changed = keys_changed_by(copy, edits)
    train = {f"train[{s}]" for s in STRATEGIES}
    evaluate = {f"evaluate[{s}]" for s in STRATEGIES}
    for label in sorted(set(changed) - {"strategies/corruption.py"}):
        assert not changed[label] & train, f"editing {label} retrains {sorted(changed[label] & train)}"
    for strategy, edit in OWN_SAMPLERS.items():  # a sampler: its strategy is evaluated again
        assert f"evaluate[{strategy}]" in changed[edit], edit
    for strategy, edit in OWN_EVALUATORS.items():  # an evaluator: its strategy only
        assert changed[edit] == {f"evaluate[{strategy}]"}, edit
    for edit in ("strategies/scdd/sampling.py", "strategies/hybrid/sampling.py", "strategies/idlm/sampling.py"):
        assert changed[edit] == {f"evaluate[{edit.split('/')[1]}]"}, edit  # no other strategy's evaluation
    for edit in SHARED:  # the base class's evaluation hooks and what every sampler shares: every evaluation
        assert changed[edit] == evaluate, edit
    assert changed["# strategies/base_evaluation.py"] == evaluate
    assert changed["# strategies/scdd/sampling.py"] == {"evaluate[scdd]"}
    # the converse: the training kernel (`apply_corruption`'s module) retrains every strategy and re-evaluates it
    assert changed["strategies/corruption.py"] == train | evaluate
