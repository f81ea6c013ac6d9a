"""A trained checkpoint loaded with its strategy rebuilt from the checkpoint's own record — what
evaluation, `dllm-flow generate`, the lm-eval harness model and `dllm-flow export` start from."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from dllm_common.checkpoint import load_weights_into, read_meta
from strategies import assemble_strategy, strategy_class
from strategies.models import apply_adapter, model_from_config_dir
from tasks.dflash_setup import draft_strategy, load_target
from tasks.prepare_data import load_tokenizer


def load_trained_model(ckpt: Path, device: str):
    """The checkpoint's module (wrapped, LoRA-adapted or a DFlash draft as recorded), digests verified first."""
    model = model_from_config_dir(ckpt)
    load_weights_into(model, ckpt)  # verifies every digest first
    return model.to(device).eval()


class Loaded(NamedTuple):
    """A checkpoint ready to generate: what `load_for_generation` returns (unpacks as a 5-tuple)."""

    model: torch.nn.Module
    tokenizer: object
    strategy: object
    mask_id: int | None  # None: a strategy that uses no [MASK] token, given none
    meta: dict


def load_for_generation(ckpt: Path, device: str, adapter: str | None = None) -> Loaded:
    """(model, tokenizer, strategy, mask id, meta) — the strategy rebuilt from the checkpoint's record."""
    meta = read_meta(ckpt)
    model = load_trained_model(ckpt, device)
    if adapter:
        apply_adapter(model, adapter)
    tokenizer = load_tokenizer(str(ckpt))
    name = meta["strategy"]
    options = checkpoint_options(meta, strategy_class(name).Options.model_fields)
    if strategy_class(name).trains == "draft":  # the draft decodes for the frozen target its checkpoint names
        t = meta["target"]
        section = meta.get(name, {})  # a checkpoint from before typed options kept its strategy's config section
        dtype = t.get("torch_dtype", section.get("target_torch_dtype", "float32"))
        remote = t.get("trust_remote_code", section.get("target_trust_remote_code", False))
        target = load_target(t["path"], dtype, device, remote)
        built = draft_strategy(name, options, model, target, mask_token_id=meta["mask_token_id"])
    else:
        built = assemble_strategy(name, options, model, tokenizer, mask_token_id=meta["mask_token_id"])
    return Loaded(model, tokenizer, built.strategy, built.mask_token_id, meta)


def checkpoint_options(meta: dict, declared) -> dict:
    """The strategy options a checkpoint records (`options`); a checkpoint written before strategies had
    typed options recorded the whole `dllm:` (and `dflash:`) section: its declared keys are kept."""
    if "options" in meta:
        return meta["options"]
    legacy = {**meta.get("dllm", {}), **meta.get(meta.get("strategy", ""), {})}
    return {k: v for k, v in legacy.items() if k in declared}
