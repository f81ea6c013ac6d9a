"""DFlash assembly, in one place: the frozen target, the layers whose features the draft reads, the
draft model, the feature source, and the strategy built over them (training, evaluation, generation).

The trained module is a `DFlashDraftModel`; the target (frozen: eval, no grad) lends its input
embedding, its LM head and its hidden states at `target_layer_ids` (docs/strategies.md §8.5).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from dllm_common.checkpoint import DIGESTS, load_weights_into
from dllm_common.config import PipelineSpec
from strategies import assemble_strategy
from strategies.dflash.blocks import _build_target_layer_ids
from strategies.dflash.draft import DFlashDraftConfig, DFlashDraftModel
from strategies.dflash.features import CachedFeatures, OnlineFeatures
from strategies.models import model_from_config_dir, resolve_model_path
from strategies.options import resolve_options
from strategies.registry import AssembledStrategy, candidate_mask_token_id
from tasks.common import StageRef
from tasks.prepare_data import load_tokenizer
from tasks.runtime import Trainee


def load_target(model_path: str | Path, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
    """The frozen target (eval mode, no grad): a dllm-flow checkpoint is digest-verified before loading."""
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"DFlash target {path} has no config.json; rerun the target stage "
            "(or set dflash.target_model_id to a causal LM checkpoint)"
        )
    if (path / DIGESTS).is_file():
        model = model_from_config_dir(path)
        load_weights_into(model, path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)


def load_spec_target(spec: PipelineSpec, model_path: str | Path, device: str):
    """`load_target` with the config's `dflash.target_torch_dtype` and `target_trust_remote_code`."""
    d = spec.dflash
    return load_target(model_path, d.target_torch_dtype, device, d.target_trust_remote_code)


def layer_ids_for(spec: PipelineSpec, target: StageRef) -> list[int]:
    """`dflash.target_layer_ids`, a draft checkpoint's own, or `_build_target_layer_ids(target, draft)`."""
    if spec.dflash.target_layer_ids:
        ids = list(spec.dflash.target_layer_ids)
    elif spec.model.kind == "pretrained":
        ids = list(DFlashDraftConfig.from_dir(resolve_model_path(spec.model.path)).target_layer_ids)
    else:  # a draft built from `model:`
        ids = _build_target_layer_ids(int(target.info["num_layers"]), spec.model.num_layers)
    bad = [i for i in ids if not 0 <= i < int(target.info["num_layers"])]
    if bad:
        raise ValueError(f"dflash.target_layer_ids {bad} are outside the target's {target.info['num_layers']} layers")
    return ids


def features_dir(ref: StageRef) -> Path:
    """Where a `cache_target` entry keeps its feature shards."""
    return Path(ref.path) / "features"


def draft_strategy(
    name: str, options, draft, target, *, mask_token_id: int | None = None, cache=None
) -> AssembledStrategy:
    """The draft strategy `name` over a draft and its frozen target; features from `cache` or a target forward."""
    top_k = getattr(options, "distill_top_k", 0)
    features = cache if cache is not None else OnlineFeatures(target, list(draft.config.target_layer_ids), top_k)
    return assemble_strategy(
        name, options, draft, None, mask_token_id=mask_token_id, resources={"target": target, "features": features}
    )


def _check_mask_row(mask_id: int | None, target) -> None:
    rows = target.get_input_embeddings().num_embeddings
    if mask_id is None or mask_id >= rows:
        raise ValueError(
            f"the DFlash mask token id {mask_id} is not a row of the target's embedding ({rows}); set "
            "dllm.mask_token_id to an unused token the target knows"
        )


def _new_draft(
    spec: PipelineSpec, target, target_ref: StageRef, block_size: int, mask_id: int, copy_hint: bool = False
) -> DFlashDraftModel:
    """A draft shaped by `model:` (its width is the target's), initialized from `train.seed`."""
    m, hidden = spec.model, target.config.hidden_size
    if m.hidden_size != hidden:
        raise ValueError(
            f"model.hidden_size ({m.hidden_size}) must equal the target's hidden size ({hidden}): "
            "the DFlash draft reads the target's embeddings and writes through its LM head"
        )
    if block_size < 2:
        raise ValueError("Cannot infer block_size from draft config. Set dflash.block_size in the YAML.")
    layer_ids = layer_ids_for(spec, target_ref)
    cfg = DFlashDraftConfig(
        hidden_size=hidden,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_target_features=len(layer_ids),
        target_hidden_size=hidden,
        block_size=block_size,
        target_layer_ids=layer_ids,
        mask_token_id=int(mask_id),
        intermediate_size=m.intermediate_size,
        rope_theta=float(getattr(target.config, "rope_theta", None) or 10000.0),
        copy_hint=copy_hint,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.train.seed)
        return DFlashDraftModel(cfg)


def draft_trainee(spec: PipelineSpec, name: str, data: StageRef, device: str, inputs: dict) -> Trainee:
    """What `train[name]` trains: the draft, against the target stage's model and (cached) features."""
    if "target" not in inputs:
        raise ValueError(
            f"train[{name}] needs its target stage: run it through the pipeline "
            f"(pretrain_target / target → cache_target → train[{name}])"
        )
    options = resolve_options(spec, name)
    if options.attention_backend == "flex_attention" and not str(device).startswith("cuda"):
        raise ValueError(
            "dflash.attention_backend 'flex_attention' trains on CUDA only (flex attention has no CPU "
            "backward in torch 2.13); use 'sdpa' here"
        )
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    target = load_spec_target(spec, inputs["target"].info["model_path"], device)
    mask_id = candidate_mask_token_id(options, tokenizer)
    _check_mask_row(mask_id, target)
    if spec.model.kind == "pretrained":
        draft = DFlashDraftModel.load(resolve_model_path(spec.model.path))
        if draft.config.copy_hint != options.copy_hint:
            raise ValueError(
                f"dflash.copy_hint is {str(options.copy_hint).lower()} but the draft checkpoint at model.path "
                f"({spec.model.path}) was built with copy_hint {str(draft.config.copy_hint).lower()}: set "
                f"dflash.copy_hint: {str(draft.config.copy_hint).lower()} to continue training it"
            )
    else:
        draft = _new_draft(spec, target, inputs["target"], options.block_size, mask_id, options.copy_hint)
    cache = CachedFeatures(features_dir(inputs["features"])) if "features" in inputs else None
    built = draft_strategy(name, options, draft, target, mask_token_id=mask_id, cache=cache)
    return Trainee(
        draft.to(device), tokenizer, built.strategy, built.loss_fn, built.mask_token_id, spec.train.precision
    )
