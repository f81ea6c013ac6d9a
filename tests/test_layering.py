"""The one direction of imports (flows → tasks → strategies → dllm_common) and a CUDA-free flows layer."""

import ast
import subprocess
import sys

from conftest import ROOT

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
