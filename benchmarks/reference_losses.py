"""Locate and load the reference dLLM losses (NVIDIA NeMo Automodel, `nemo_automodel/components/loss/dllm_loss.py`).

Nothing of the reference is copied into this repository: its two source files are read from an installed
`nemo_automodel` distribution, an unpacked `nemo_automodel/` package folder, or a wheel, and loaded by file
path. The package's `__init__` (which pulls in its whole training stack) never runs: the parent packages
`nemo_automodel`, `nemo_automodel.components` and `nemo_automodel.components.loss` are registered as empty
stub modules whose `__path__` points at the real folders, so `dllm_loss.py`'s one internal import
(`chunked_ce._validate_chunk_len`, which itself imports `linear_ce_base.py`, torch and `transformers`)
resolves file by file.

    pkg = locate(None)  # or locate("nemo_automodel-0.7.0-py3-none-any.whl") / locate("path/to/nemo_automodel")
    ref = load(pkg)  # the dllm_loss module: ref.MDLMCrossEntropyLoss, ref.SCDDLoss, ...
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
import tempfile
import types
import zipfile
from pathlib import Path

PINNED = "0.7.0"
HOW_TO_GET = (
    f"reference losses not found (nemo_automodel is not installed): run "
    f"`pip download --no-deps nemo_automodel=={PINNED}` and pass "
    f"--reference nemo_automodel-{PINNED}-py3-none-any.whl (or an unpacked nemo_automodel/ folder); "
    f"measuring ours only"
)
LOSS_DIR = ("components", "loss")
# Files of components/loss that loading dllm_loss.py touches, in import order.
NEEDED = ("linear_ce_base.py", "chunked_ce.py", "dllm_loss.py")
_STUBS = ("nemo_automodel", "nemo_automodel.components", "nemo_automodel.components.loss")


def _package_dir(path: Path) -> Path | None:
    """The `nemo_automodel` package folder at or directly under `path`, if it holds the loss files."""
    for cand in (path, path / "nemo_automodel"):
        if cand.joinpath(*LOSS_DIR, "dllm_loss.py").is_file():
            return cand
    return None


def _from_wheel(wheel: Path) -> Path:
    """Extract the needed loss files (and the dist-info METADATA) of a wheel into a temporary folder."""
    out = Path(tempfile.mkdtemp(prefix="nemo_ref_"))
    prefix = "nemo_automodel/" + "/".join(LOSS_DIR) + "/"
    with zipfile.ZipFile(wheel) as zf:
        names = [prefix + f for f in NEEDED]
        names += [
            n for n in zf.namelist() if n.endswith(".dist-info/METADATA") or n == "nemo_automodel/package_info.py"
        ]
        for name in names:
            zf.extract(name, out)
    return out / "nemo_automodel"


def _installed() -> Path | None:
    """The installed `nemo_automodel`'s package folder, found from its metadata or its spec; never imported."""
    try:
        dist = importlib.metadata.distribution("nemo_automodel")
        pkg = _package_dir(Path(dist.locate_file("nemo_automodel")))
        if pkg is not None:
            return pkg
    except importlib.metadata.PackageNotFoundError:
        pass
    # find_spec of a top-level name consults the finders only; the package's __init__ does not run.
    spec = importlib.util.find_spec("nemo_automodel") if "nemo_automodel" not in sys.modules else None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        pkg = _package_dir(Path(loc))
        if pkg is not None:
            return pkg
    return None


def locate(reference: str | None) -> Path | None:
    """The reference's `nemo_automodel` package folder: from `reference` (a package folder, its parent, or a
    wheel, extracted to a temporary folder) or, when None, from the installed distribution; None if absent."""
    if reference is None:
        return _installed()
    path = Path(reference).expanduser()
    if path.is_file() and path.suffix == ".whl":
        return _from_wheel(path)
    pkg = _package_dir(path) if path.is_dir() else None
    if pkg is None:
        raise FileNotFoundError(
            f"--reference {reference}: not a .whl nor a folder holding nemo_automodel/components/loss"
        )
    return pkg


def version(pkg: Path) -> str:
    """Version of the reference at `pkg`: from a sibling *.dist-info METADATA, else package_info.py, else '?'."""
    for meta in sorted(pkg.parent.glob("nemo_automodel*.dist-info/METADATA")):
        m = re.search(r"^Version: (\S+)", meta.read_text(), flags=re.MULTILINE)
        if m:
            return m.group(1)
    info = pkg / "package_info.py"
    if info.is_file():
        parts = dict(re.findall(r"^(MAJOR|MINOR|PATCH) = (\d+)", info.read_text(), flags=re.MULTILINE))
        if len(parts) == 3:
            return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
    return "?"


def _load_file(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load(pkg: Path) -> types.ModuleType:
    """Load `components/loss/dllm_loss.py` of the reference at `pkg` without running any package `__init__`."""
    folders = (pkg, pkg / LOSS_DIR[0], pkg.joinpath(*LOSS_DIR))
    for name, folder in zip(_STUBS, folders):
        existing = sys.modules.get(name)
        if existing is not None and getattr(existing, "__file__", None) is not None:
            raise RuntimeError(f"{name} is already imported for real; load the reference in a fresh process")
        stub = types.ModuleType(name)
        stub.__path__ = [str(folder)]  # submodules resolve from the real folder; the stub has no __init__ to run
        sys.modules[name] = stub
    loss_dir = folders[-1]
    _load_file("nemo_automodel.components.loss.chunked_ce", loss_dir / "chunked_ce.py")
    return _load_file("nemo_automodel.components.loss.dllm_loss", loss_dir / "dllm_loss.py")
