"""What `dllm-flow`'s commands check before they start anything: the training device, the tracking store, a
read-only registry, a report folder that is a file; and `--verify`'s setting, which workers inherit.

Torch-free at import: torch is imported by the check that needs it."""

from __future__ import annotations

import os
from pathlib import Path

from dllm_common.config import ConfigError


def set_verification(args) -> None:
    """`--verify`: every reused store entry is re-hashed, not only size-checked (workers inherit the setting)."""
    if getattr(args, "verify", False):
        from dllm_common.store import VERIFY_ENV

        os.environ[VERIFY_ENV] = "full"


def check_device(spec) -> None:
    """train.device: cuda on a machine without one fails here, not inside the first stage (a remote
    train_deployment trains on its own worker's GPU, a grpo_deployment tunes on it)."""
    local_grpo = spec.grpo is not None and spec.pipeline.grpo_deployment is None
    if spec.train.device == "cuda" and (spec.pipeline.train_deployment is None or local_grpo):
        import torch

        if not torch.cuda.is_available():
            if spec.pipeline.train_deployment is not None:  # training is remote; the grpo stage would run here
                raise ConfigError(
                    "train.device is 'cuda' and the grpo stage runs on this machine, which has no CUDA device; "
                    "send it to the GPU work pool too (pipeline.grpo_deployment, e.g. dllm-grpo/grpo-gpu)"
                )
            raise ConfigError(
                "train.device is 'cuda' but this machine has no CUDA device; use train.device: auto (cuda when "
                "present) or cpu, or train on a GPU work pool (pipeline.train_deployment)"
            )


def check_tracking(uri: str | None, workdir: Path) -> None:
    """The tracking store a run will write to, checked before any service starts: the workdir's sqlite store is
    readable, or the tracking server `tracking.uri` names answers."""
    from dllm_common.tracking import check_local_store, check_tracking_server

    if uri is None:
        check_local_store(workdir / "mlflow.db", workdir)
    else:
        check_tracking_server(uri)


def check_registry_writable(workdir: Path) -> None:
    """A models:/ or runs:/ URI is looked up in the workdir's sqlite registry, which MLflow opens for writing
    (its schema check, its journal): a read-only workdir is refused at once, naming what to do, instead of
    MLflow's minutes of retries ending in "not found"."""
    from dllm_common.store import refuse_read_only

    workdir = workdir.resolve()
    if not workdir.is_dir():
        return  # no registry there: resolve_checkpoint says the model is not found
    refuse_read_only(
        workdir,
        f"--workdir {workdir} is read-only",
        "its MLflow registry (mlflow.db) cannot be opened there: pass the checkpoint folder instead "
        f"(dllm-flow generate {workdir}/store/train/<key>/model ...; `dllm-flow runs --workdir {workdir}` lists "
        "the runs), or copy the workdir somewhere writable (cp -a) and pass --workdir with the copy",
    )


def refuse_file_as_folder(out: Path, flag: str) -> None:
    """The report's folder (or a folder above it) must not be an existing file: said before MLflow is opened."""
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        where = "is a file" if blocker == out else f"is inside {blocker}, which is a file"
        what = f"--out {out}" if flag == "--out" else f"folder {out} (under --workdir)"
        raise FileExistsError(
            f"report {what} {where}, not a directory; nothing was written. Give {flag} a directory (new or "
            "existing) for report.md, report.json and the plots"
        )


def check_served_target(spec) -> list[str]:
    """A DFlash pipeline whose target is a local folder with its own tokenizer files (docs/strategies.md §10.13),
    before any service starts: a mask id the config writes that is the target tokenizer's EOS or PAD id is refused
    (unless tokenizer.allow_mask_alias); special-token ids of `tokenizer:` that differ from the target's own are
    returned as warning lines (the draft would learn around ids the served prompts don't use)."""
    from dllm_common.mask_alias import explicit_mask_ids, local_tokenizer_ids, mask_alias_problem
    from strategies.model_files import resolve_model_path

    d, t = spec.dflash, spec.tokenizer
    if not _trains_a_draft(spec) or not d.target_model_id or d.target_gguf_file:
        return []
    target_ids = local_tokenizer_ids(resolve_model_path(d.target_model_id))
    if target_ids is None:
        return []
    if not t.allow_mask_alias:
        said = explicit_mask_ids(spec.dllm.shared(), spec.dllm.overrides, spec.pipeline.strategies)
        for where, mask_id in said.items():
            problem = mask_alias_problem(mask_id, target_ids, f"{where} (against the target's tokenizer)")
            if problem:
                raise ConfigError(problem)
    ours = local_tokenizer_ids(resolve_model_path(t.path), t.gguf_file) if t.kind == "pretrained" else None
    if ours is None:
        return []
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    diff = [f"{k} {ours[k]} vs {target_ids[k]}" for k in keys if ours[k] != target_ids[k]]
    if not diff:
        return []
    return [
        f"tokenizer.path and dflash.target_model_id differ in {', '.join(diff)}: the draft trains on ids the served "
        "prompts won't use; set tokenizer.path to the target's folder"
    ]


def _trains_a_draft(spec) -> bool:
    """Whether a strategy of the pipeline trains a draft against a frozen target (its class says so)."""
    from strategies import strategy_class

    return any(strategy_class(s).trains == "draft" for s in spec.pipeline.strategies)


def check_sampled_serving(spec) -> list[str]:
    """A DFlash pipeline measured at a sampling temperature (`dflash.eval_temperature`) whose draft trains on rows
    the target continued greedily: a warning line naming what to set (docs/strategies.md §10.13)."""
    from strategies.dflash.served_checks import sampling_problems

    d = spec.dflash
    if not _trains_a_draft(spec) or spec.train.steps == 0 or d.regenerate is None:
        return []
    return sampling_problems(d.eval_temperature, d.regenerate.temperature)
