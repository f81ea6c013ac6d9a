"""DFlash assembly, in one place: the frozen target, the layers whose features the draft reads, the
draft model (new, or imported and checked against the target), the feature source, and the strategy built over
them (training, evaluation, generation).

The trained module is a `DFlashDraftModel`; the target (frozen: eval, no grad) lends its input
embedding, its LM head and its hidden states at `target_layer_ids` (docs/strategies.md §8.5). An imported draft
(`model.kind: pretrained`, `model.path`: a dllm-flow draft checkpoint or a z-lab / SpecForge or speculators folder,
local or a hub id) continues training, or with `train.steps: 0` is published as it is to be evaluated
(docs/strategies.md §10.10).
"""

from __future__ import annotations

import copy
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import constants, snapshot_download
from transformers import AutoModelForCausalLM

from dllm_common.checkpoint import DIGESTS, load_weights_into
from dllm_common.config import PipelineSpec, config_sha256
from strategies import assemble_strategy, strategy_class
from strategies.assembly import AssembledStrategy
from strategies.dflash.blocks import build_target_layer_ids
from strategies.dflash.config import (
    CONFIG,
    ZLAB,
    DFlashDraftConfig,
    DraftConfig,
    parse_draft_config,
    read_draft_config,
)
from strategies.dflash.dflash2_config import variant_fields
from strategies.dflash.draft import DFlashDraftModel
from strategies.dflash.features import OnlineFeatures
from strategies.dflash.served_checks import (
    engine_field_problems,
    mask_served_problem,
    target_config_ids,
    target_tokenizer,
    template_token_ids,
    tokenizer_problems,
)
from strategies.dflash.window_config import attention_shape_fields
from strategies.model_files import resolve_model_path
from strategies.models import check_pretrained_weights, model_from_config_dir
from strategies.options import resolve_options
from tasks.common import StageRef


def load_target(
    model_path: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    where: str | None = None,
):
    """The frozen target (eval mode, no grad): a dllm-flow checkpoint is digest-verified before loading; either kind
    has its weights' headers checked against the model first, a misfit named with `where` (the key that named it)."""
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"DFlash target {path} has no config.json; rerun the target stage "
            "(or set dflash.target_model_id to a causal LM checkpoint)"
        )
    if (path / DIGESTS).is_file():
        model = model_from_config_dir(path)
        load_weights_into(model, path, where)
    else:
        check_pretrained_weights(str(path), where or "the DFlash target", trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)


def load_spec_target(spec: PipelineSpec, model_path: str | Path, device: str):
    """`load_target` with the config's `dflash.target_torch_dtype` and `target_trust_remote_code`; a misfit of its
    weights names `dflash.target_model_id` (unset: the target the pipeline trained, a checkpoint of its own)."""
    d = spec.dflash
    where = "dflash.target_model_id" if d.target_model_id else None
    return load_target(model_path, d.target_torch_dtype, device, d.target_trust_remote_code, where)


@dataclass(frozen=True)
class DraftSetup:
    """What the speculative stages know of the draft before any weight is loaded, built once per config
    (`DraftSetup.of`) and handed to `cache_target`, `train` and the planner: the strategy that trains it and its
    resolved options, and for an imported draft (`model.kind: pretrained`) its folder and its config.json, read
    once (the raw mapping and the parsed config)."""

    strategy: str
    options: Any
    folder: Path | None = None
    raw_config: dict | None = None
    imported: DraftConfig | None = None

    @classmethod
    def of(cls, spec: PipelineSpec) -> DraftSetup:
        """The setup of `spec`'s draft (the first strategy that trains one), computed once per config."""
        digest = config_sha256(spec)
        if digest not in _SETUPS:
            while len(_SETUPS) >= 8:  # a long-lived process (a notebook, the test suite) keeps a few
                _SETUPS.pop(next(iter(_SETUPS)))
            _SETUPS[digest] = cls._build(spec)
        return _SETUPS[digest]

    @classmethod
    def _build(cls, spec: PipelineSpec) -> DraftSetup:
        names = [s for s in spec.pipeline.strategies if strategy_class(s).trains == "draft"]
        if not names:
            raise ValueError(
                f"pipeline.strategies {list(spec.pipeline.strategies)} has no strategy that trains a draft"
            )
        options = resolve_options(spec, names[0])
        if spec.model.kind != "pretrained":
            return cls(names[0], options)
        return cls.reading(names[0], options, draft_source(spec.model.path))

    @classmethod
    def reading(cls, strategy: str, options, folder: Path) -> DraftSetup:
        """The setup of an imported draft in `folder`: its config.json read here, once."""
        raw = json.loads((folder / CONFIG).read_text()) if (folder / CONFIG).is_file() else None
        read = parse_draft_config(raw, str(folder)) if raw is not None else read_draft_config(folder)  # (its error)
        return cls(strategy, options, folder, raw, read)

    def layer_ids(self, spec: PipelineSpec, target: StageRef) -> list[int]:
        """`dflash.target_layer_ids`, an imported draft's own, or `build_target_layer_ids(target, draft)`."""
        return layer_ids_for(spec, target, self)


_SETUPS: dict[str, DraftSetup] = {}


def layer_ids_for(spec: PipelineSpec, target: StageRef, setup: DraftSetup | None = None) -> list[int]:
    """`dflash.target_layer_ids`, an imported draft's own, or `build_target_layer_ids(target, draft)`."""
    given = list(spec.dflash.target_layer_ids) if spec.dflash.target_layer_ids else None
    if spec.model.kind == "pretrained":
        ids = list((setup or DraftSetup.of(spec)).imported.config.target_layer_ids)
        if given is not None and given != ids:
            raise ValueError(
                f"dflash.target_layer_ids {given} differ from the layers the draft at model.path reads ({ids}): "
                "unset dflash.target_layer_ids (an imported draft reads its own layers)"
            )
    else:  # a draft built from `model:`
        ids = given or build_target_layer_ids(int(target.info["num_layers"]), spec.model.num_layers)
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
    """The draft strategy `name` over a draft and its frozen target; features from `cache` or a target forward.
    `options`: the strategy's options, typed or as a checkpoint records them (a dict: `dllm-flow generate`)."""
    top_k = options.get("distill_top_k", 0) if isinstance(options, dict) else getattr(options, "distill_top_k", 0)
    features = cache if cache is not None else OnlineFeatures(target, list(draft.config.target_layer_ids), top_k)
    return assemble_strategy(
        name, options, draft, None, mask_token_id=mask_token_id, resources={"target": target, "features": features}
    )


def check_mask_row(mask_id: int | None, target) -> None:
    rows = target.get_input_embeddings().num_embeddings
    if mask_id is None or mask_id >= rows:
        raise ValueError(
            f"the DFlash mask token id {mask_id} is not a row of the target's embedding ({rows}); set "
            "dllm.mask_token_id to an unused token the target knows"
        )


def check_served_before_training(allow_alias: bool, chat: bool, tokenizer, target, target_path, mask_id: int) -> None:
    """The causes of a draft accepting less once served (docs/evaluation.md §4.7.1), before any training: a mask id
    that is the target's EOS/PAD (its config's) or a token its chat template writes is refused (unless
    `tokenizer.allow_mask_alias`); a training tokenizer whose special ids or (chat data) template differ from the
    target's own is warned about, one line each naming what to change."""
    served = target_tokenizer(target_path)
    if not allow_alias:
        problem = mask_served_problem(mask_id, target_config_ids(target), template_token_ids(served or tokenizer))
        if problem:
            raise ValueError(problem)
    for _, line in tokenizer_problems(tokenizer, served, chat) if served is not None else []:
        warnings.warn(f"served acceptance: {line}", stacklevel=2)


def _rope_theta(config) -> float:
    """The target's RoPE base (transformers 5 keeps it in `rope_parameters`), 10000 when it has none."""
    theta = getattr(config, "rope_theta", None)
    params = getattr(config, "rope_parameters", None) or {}
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta or 10000.0)


def target_facts(target) -> dict:
    """What a draft's config records of its target: layer count, vocabulary (its embedding's rows), context,
    special tokens and RoPE base."""
    c = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return {
        "num_target_layers": int(c.num_hidden_layers),
        "vocab_size": int(target.get_input_embeddings().num_embeddings),
        "max_position_embeddings": int(getattr(c, "max_position_embeddings", None) or 2048),
        "bos_token_id": getattr(c, "bos_token_id", None),
        "eos_token_id": getattr(c, "eos_token_id", None),
        "rope_theta": _rope_theta(c),
    }


def new_draft(
    spec: PipelineSpec,
    target,
    target_ref: StageRef,
    block_size: int,
    mask_id: int,
    copy_hint: bool = False,
    variant: dict | None = None,
) -> DFlashDraftModel:
    """A draft shaped by `model:` (its width is the target's; layers, heads, `num_kv_heads`, `intermediate_size`;
    head_dim = hidden ÷ heads, RoPE base the target's), initialized from `train.seed`; `variant`: more config
    keywords (`new_draft_fields`: DFlash 2's, the `dflash` options' attention shape and window)."""
    m, hidden = spec.model, target.config.hidden_size
    if m.hidden_size != hidden:
        raise ValueError(
            f"model.hidden_size ({m.hidden_size}) must equal the target's hidden size ({hidden}): "
            "the DFlash draft reads the target's embeddings and writes through its LM head"
        )
    if block_size < 2:
        raise ValueError("Cannot infer block_size from draft config. Set dflash.block_size in the YAML.")
    cfg = DFlashDraftConfig(
        hidden_size=hidden,
        num_hidden_layers=m.num_layers,
        intermediate_size=m.intermediate_size,
        block_size=block_size,
        target_layer_ids=layer_ids_for(spec, target_ref),
        mask_token_id=int(mask_id),
        copy_hint=copy_hint,
        **target_facts(target),
        **{"num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, **(variant or {})},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.train.seed)
        return DFlashDraftModel(cfg)


def new_draft_fields(spec: PipelineSpec, options) -> dict:
    """The config keywords the `dflash` options give a new draft beyond `model:`: DFlash 2's shapes, and the attention
    shape and sliding window (docs/strategies.md §10.12)."""
    return {**variant_fields(options), **attention_shape_fields(options, spec.model)}


def draft_source(path: str) -> Path:
    """The folder of an imported draft (`model.path`): a local folder, `package:NAME`, or a hub id fetched through
    the Hugging Face cache (config and safetensors only). Offline or unknown: one message, no retries."""
    local = Path(resolve_model_path(path))
    if local.is_dir():
        return local
    try:
        return Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # noqa: BLE001 - offline miss, unknown repo, bad id: one message
        offline = " with the hub offline (HF_HUB_OFFLINE)" if constants.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(
            f"model.path {path!r} is not a local directory and not in the Hugging Face cache{offline} "
            f"({type(exc).__name__}); give a local draft folder (the z-lab / SpecForge or speculators layout), or "
            "download it once with hub access"
        ) from None


def check_draft_fits_target(cfg: DFlashDraftConfig, target, where: str, verifier: str | None = None) -> None:
    """An imported draft must have been trained for this target: its width, vocabulary, layer count and layer
    ids, and its mask token a row of the target's embedding. One message naming both sides."""
    facts = target_facts(target)
    named = f" (its config names the verifier {verifier!r})" if verifier else ""
    fix = f"set dflash.target_model_id to the target this draft was trained for{named}"
    checks = [
        ("hidden size", cfg.hidden_size, int(target.config.hidden_size)),
        ("vocabulary", cfg.vocab_size, facts["vocab_size"]),
        ("layer count (num_target_layers)", cfg.num_target_layers, facts["num_target_layers"]),
    ]
    for what, draft_value, target_value in checks:
        if draft_value is not None and draft_value != target_value:
            raise ValueError(
                f"the DFlash draft at {where} was trained for a target with {what} {draft_value}, but the target "
                f"has {target_value}: {fix}"
            )
    bad = [i for i in cfg.target_layer_ids if i >= facts["num_target_layers"]]
    if bad:
        raise ValueError(
            f"the DFlash draft at {where} reads target layers {bad}, past the target's {facts['num_target_layers']}: "
            f"{fix}"
        )
    if cfg.mask_token_id >= facts["vocab_size"]:
        raise ValueError(
            f"the DFlash draft at {where} uses mask token {cfg.mask_token_id}, not a row of the target's embedding "
            f"({facts['vocab_size']}): {fix}"
        )


def import_draft(
    spec: PipelineSpec, options, target, setup: DraftSetup | None = None, *, weights: bool = True
) -> DFlashDraftModel:
    """The draft at `model.path` (`model.kind: pretrained`: a dllm-flow checkpoint, or a z-lab / SpecForge or
    speculators folder, local or a hub id), checked against the target and the options, tied to the target
    (a speculators config does not record its layer count). `setup`: the stage's `DraftSetup`, whose config.json
    read is used (none: the folder's is read here). `weights=False`: the draft its config describes, its weights
    not read (`dllm-flow plan`, on fake tensors)."""
    where = f"model.path ({spec.model.path})"
    setup = setup or DraftSetup.reading("", options, draft_source(spec.model.path))
    folder, read = setup.folder, setup.imported
    if read.layout == ZLAB:  # a field engines read otherwise than dllm-flow does: refused before training on
        ours = {"block_size": read.config.block_size, "mask_token_id": read.config.mask_token_id}
        lines = engine_field_problems(setup.raw_config, ours)
        if lines:
            raise ValueError(f"the DFlash draft at {where}: {lines[0]}")
    if weights:
        draft = DFlashDraftModel.load(folder, where="model.path", config=read.config)
    else:
        draft = DFlashDraftModel(copy.deepcopy(read.config))
    cfg = draft.config
    check_draft_fits_target(cfg, target, where, read.verifier)
    facts = target_facts(target)
    cfg.num_target_layers = cfg.num_target_layers or facts["num_target_layers"]
    cfg.vocab_size = cfg.vocab_size or facts["vocab_size"]
    if cfg.copy_hint != options.copy_hint:
        raise ValueError(
            f"dflash.copy_hint is {str(options.copy_hint).lower()} but the draft checkpoint at model.path "
            f"({spec.model.path}) was built with copy_hint {str(cfg.copy_hint).lower()}: set "
            f"dflash.copy_hint: {str(cfg.copy_hint).lower()} to continue training it"
        )
    if options.block_size and options.block_size != cfg.block_size:
        raise ValueError(
            f"dflash.block_size is {options.block_size} but the draft at {where} drafts blocks of {cfg.block_size}: "
            f"set dflash.block_size to 0 (the draft's) or {cfg.block_size}"
        )
    if getattr(options, "draft_variant", cfg.variant) == cfg.variant:  # (another variant: the strategy refuses it)
        for key, value in variant_fields(options).items():  # a shape option set explicitly must be the draft's
            option = key if hasattr(options, key) else f"domino_{key}"
            if key != "variant" and option in options.model_fields_set and getattr(cfg, key) != value:
                raise ValueError(
                    f"dflash.{option} is {value} but the {cfg.variant} draft at {where} was built with {key} "
                    f"{getattr(cfg, key)}: unset dflash.{option} (an imported draft brings its own) or set it to "
                    f"{getattr(cfg, key)}"
                )
    if options.mask_token_id is not None and options.mask_token_id != cfg.mask_token_id:
        raise ValueError(
            f"dllm.mask_token_id is {options.mask_token_id} but the draft at {where} was trained with mask token "
            f"{cfg.mask_token_id}: unset dllm.mask_token_id (an imported draft brings its own) or set it to "
            f"{cfg.mask_token_id}"
        )
    return draft
