"""`dllm-flow export CHECKPOINT OUT`: a trained checkpoint as a Hugging Face folder with a model card.

CHECKPOINT is anything `dllm-flow generate --checkpoint` takes (a checkpoint dir, a train store entry,
`models:/NAME@ALIAS`, `runs:/ID/model`). Its digests are verified before anything is written; the
folder is built in a temporary directory beside OUT and renamed into place, and an existing non-empty
OUT is never overwritten.

Layout of OUT:
    config.json, model.safetensors      the backbone as a plain transformers causal LM (`architectures`
      (or model-0000i-of-0000n.safetensors + model.safetensors.index.json above `max_shard_size`)
    tokenizer files                     as trained
    generation_config.json              token ids and the strategy's sampler settings (`dllm_*` keys)
    dllm.json, digests.json             the dllm-flow checkpoint record: `dllm-flow generate --checkpoint OUT`
    README.md                           the model card: model, loading, lineage, metrics, samples, repro card

One set of files serves both loaders where the checkpoint's weights *are* the backbone's (mdlm, scdd,
idlm; LoRA merged here first). A wrapped model (hybrid, block_diffusion: strategies/models.py keeps the
backbone as `.lm`, so its keys carry an `lm.` prefix and block_diffusion adds `self_cond`) and a sharded
export are written twice: the top level is the transformers backbone, `model/` the dllm-flow checkpoint
(`resolve_checkpoint` looks there; docs/strategies.md §8.3, §9.5). A DFlash draft is no transformers
model (it reads a frozen target's hidden states, docs/strategies.md §10.1): the top level is its
dllm-flow checkpoint and the card says which target it needs.

The card (`tasks.commands.model_card`) reports the checkpoint's evaluation, data digest and training config as
`tasks.commands.provenance` finds them in the stores and the training's MLflow run. Metric meanings:
docs/evaluation.md §4.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from dllm_common.checkpoint import (
    DIGESTS,
    MAX_SHARD_SIZE,
    WEIGHTS,
    WEIGHTS_INDEX,
    CorruptCheckpointError,
    checkpoint_digest,
    dedupe_tensors,
    load_weights_into,
    read_meta,
    read_weights,
    verify_checkpoint,
    weight_files,
    write_weights,
)
from dllm_common.store import MANIFEST, StageEntry, Store, fsync_tree, refuse_published, sha256_file
from strategies import strategy_class
from strategies.dflash.config import LEGACY_CONFIG, is_draft_dir, read_draft_config
from strategies.models import merge_lora, model_from_config_dir, tokenizer_token_ids
from strategies.registry import model_shape
from strategies.sampling import SamplerConfig
from tasks.commands.generate import default_temperature, default_top_p, resolve_checkpoint
from tasks.commands.model_card import CARD, DLLM_SUBDIR, Layout, model_card
from tasks.commands.provenance import Evaluation, Provenance, find_provenance
from tasks.data.tokenizer import load_tokenizer
from tasks.evaluation.trained_model import check_vocabulary, checkpoint_options
from tasks.speculative.export import DLLM_FLOW, draft_format, write_draft_export

CONFIG = "config.json"
META = "dllm.json"
GENERATION_CONFIG = "generation_config.json"
WRAPPER_PREFIX = "lm."  # HybridLM / BlockDiffusionLM hold the backbone as `.lm`
# checkpoint files that are not the tokenizer's
NOT_TOKENIZER = {CONFIG, WEIGHTS, META, DIGESTS, "trainer_state.pt", LEGACY_CONFIG, GENERATION_CONFIG, CARD}


def export_checkpoint(
    checkpoint: str,
    out: Path,
    workdir: Path,
    tracking_uri: str | None = None,
    *,
    max_shard_size: int | str = MAX_SHARD_SIZE,
    fmt: str | None = None,
) -> Path:
    """Write CHECKPOINT as a Hugging Face folder at `out` (see the module doc); returns `out`. `fmt`: a DFlash
    draft's layout (`tasks.speculative.export.FORMATS`; None: the z-lab one)."""
    out = Path(out)
    refuse_published(out, workdir)
    _refuse_existing(out)
    remote = checkpoint.startswith(("models:/", "runs:/"))
    scratch = Path(tempfile.mkdtemp(prefix="dllm-export-")) if remote else None
    try:
        ckpt = resolve_checkpoint(checkpoint, Path(workdir), tracking_uri, scratch=scratch)
        try:
            verify_checkpoint(ckpt)
            verify_against_store(ckpt)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"refusing to export {checkpoint}: {exc}") from None
        source = Source.read(ckpt, checkpoint)
        found = find_provenance(source, Path(workdir), tracking_uri)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            write_export(staging, source, found, out.name, max_shard_size, fmt)
            fsync_tree(staging)
            _publish(staging, out)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return out


def verify_against_store(ckpt: Path) -> None:
    """A checkpoint inside a published store entry (`WORKDIR/store/train/<key>/model`) is checked against the
    entry's manifest too, every file re-hashed (after `verify_checkpoint`): the checkpoint's own digests.json can
    be rewritten along with its weights, the manifest beside it records what was published.
    `CorruptCheckpointError` names the files that differ and how to rebuild the entry. A checkpoint
    outside a store has no manifest to check."""
    entry_dir = next((d for d in (ckpt, *ckpt.parents) if (d / MANIFEST).is_file()), None)
    if entry_dir is None:
        return
    entry = StageEntry(entry_dir.parent.name, entry_dir.name, entry_dir)
    problems = Store(entry_dir.parent.parent).verify(entry)
    if not problems:  # every file the manifest lists matches; a checkpoint file it does not list was added since
        listed = set(entry.manifest["files"])
        inside = ckpt.relative_to(entry_dir)
        problems = [
            f"{(inside / name).as_posix()} is not in the manifest"
            for name in sorted(json.loads((ckpt / DIGESTS).read_text()))
            if (inside / name).as_posix() not in listed
        ]
    if problems:  # the content first: the digests table is expected to differ with it
        problems.sort(key=lambda p: p.startswith((ckpt.relative_to(entry_dir) / DIGESTS).as_posix()))
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CorruptCheckpointError(
            f"{ckpt} is not what its store entry {entry.stage}/{entry.key} published ({entry_dir / MANIFEST}): "
            f"{'; '.join(problems[:3])}{more}. It was changed after it was published, its {DIGESTS} too: rerun the "
            "pipeline with `dllm-flow run --verify` (or `dllm-flow resume RUN_ID --verify`) to set the damaged "
            "entry aside and rebuild it"
        )


def _refuse_existing(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise FileExistsError(
            f"export: {out} already exists and is not empty; nothing was written. Choose a new OUT, or remove it first"
        )


def _publish(staging: Path, out: Path) -> None:
    """Rename the finished folder into place (an empty `out` is replaced, a non-empty one refused)."""
    try:
        os.rename(staging, out)
    except OSError as exc:  # `out` appeared (non-empty) while the export ran
        raise FileExistsError(f"export: {out} appeared while exporting ({exc.strerror}); nothing was written") from None


# ------------------------------------------------------------------ the checkpoint


@dataclass(kw_only=True)
class Source:
    """The verified checkpoint: its record, config, tokenizer and weights (LoRA merged)."""

    path: Path
    ref: str
    meta: dict
    config: dict  # config.json
    tokenizer: Any
    tokenizer_files: list[str]
    tensors: dict[str, torch.Tensor]  # the dllm-flow module's state, tied weights once
    verbatim: bool  # tensors are exactly the checkpoint's model.safetensors
    lora_merged: bool
    digest: str  # checkpoint_digest: what an evaluation's repro card records

    @property
    def strategy(self) -> str:
        return self.meta["strategy"]

    @property
    def is_draft(self) -> bool:
        return is_draft_dir(self.path)

    @property
    def wrapped(self) -> bool:
        """A strategy shape around a causal LM (its keys carry `lm.`); a shape that is a transformers model itself
        (block_diffusion's DiffusionGemma) is not."""
        shaped = not self.is_draft and self.config.get("dllm_architecture") is not None
        return shaped and any(k.startswith(WRAPPER_PREFIX) for k in self.tensors)

    @classmethod
    def read(cls, ckpt: Path, ref: str) -> Source:
        meta = read_meta(ckpt)
        strategy_class(meta["strategy"])  # an unknown strategy fails here, naming the available ones
        draft = is_draft_dir(ckpt)
        if draft:
            read_draft_config(ckpt)  # a draft of the old layout stops here, saying how to retrain it
        config = json.loads((ckpt / CONFIG).read_text())
        recorded = json.loads((ckpt / DIGESTS).read_text())
        tokenizer_files = sorted(n for n in recorded if n not in NOT_TOKENIZER)
        tokenizer = load_tokenizer(str(ckpt))
        check_vocabulary(ckpt, tokenizer, None if draft else config.get("vocab_size"))
        tensors, verbatim, merged = _checkpoint_tensors(ckpt, config)
        return cls(
            path=ckpt,
            ref=ref,
            meta=meta,
            config=config,
            tokenizer=tokenizer,
            tokenizer_files=tokenizer_files,
            tensors=tensors,
            verbatim=verbatim,
            lora_merged=merged,
            digest=checkpoint_digest(ckpt),
        )


def _checkpoint_tensors(ckpt: Path, config: dict) -> tuple[dict[str, torch.Tensor], bool, bool]:
    """(tensors, verbatim, lora merged): the file as stored, or, for a LoRA checkpoint that kept its
    adapters, the module with the adapters folded in, each tensor back in its stored dtype."""
    if not config.get("dllm_lora"):
        return read_weights(ckpt), True, False
    model = model_from_config_dir(ckpt)
    load_weights_into(model, ckpt)
    merge_lora(model)
    dtypes = {}
    for name in weight_files(ckpt):
        with safe_open(str(ckpt / name), "pt") as f:
            dtypes.update({k.replace(".base_layer", ""): f.get_slice(k).get_dtype() for k in f.keys()})
    stored = {name: getattr(torch, _TORCH_DTYPES.get(code, "float32")) for name, code in dtypes.items()}
    state = {k: v.detach().to(stored.get(k, v.dtype)) for k, v in model.state_dict().items()}
    return dedupe_tensors(state), False, True


_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64"}


def backbone_tensors(source: Source) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the transformers backbone's tensors, names of the wrapper's own tensors left out of it)."""
    if not source.wrapped:
        return source.tensors, []
    n = len(WRAPPER_PREFIX)
    backbone = {k[n:]: v for k, v in source.tensors.items() if k.startswith(WRAPPER_PREFIX)}
    return backbone, sorted(k for k in source.tensors if not k.startswith(WRAPPER_PREFIX))


def _is_sharded(tensors: dict[str, torch.Tensor], max_shard_size: int | str) -> bool:
    return split_torch_state_dict_into_shards(dedupe_tensors(tensors), max_shard_size=max_shard_size).is_sharded


def _token_ids(tokenizer) -> dict[str, int | None]:
    """The tokenizer's BOS/EOS/PAD ids, null where it has none (a missing key reads as the config class's default)."""
    return tokenizer_token_ids(tokenizer)


def _mask_id(source: Source) -> dict[str, int]:
    """`mask_token_id` for a strategy that writes [MASK] (the id its checkpoint records), else nothing."""
    mask = source.meta.get("mask_token_id")
    return {"mask_token_id": int(mask)} if mask is not None and strategy_class(source.strategy).uses_mask_token else {}


def dllm_config(source: Source) -> dict:
    """The checkpoint's config.json for dllm-flow: adapters merged, `architectures` named, and the
    special-token ids the tokenizer defines (a tiny model's config otherwise keeps Llama's defaults)."""
    config = {k: v for k, v in source.config.items() if not (source.lora_merged and k == "dllm_lora")}
    if not config.get("architectures") and config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        config["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config["model_type"]]]
    return {**config, **_token_ids(source.tokenizer), **_mask_id(source)}


def hf_config(source: Source) -> dict:
    """config.json of the top level: the backbone alone (a wrapper's shape lives in `model/`)."""
    config = dllm_config(source)
    if source.wrapped:
        config = {k: v for k, v in config.items() if k not in ("dllm_architecture", "dllm_mask_token_id")}
    return config


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _copy_tokenizer(source: Source, dest: Path) -> None:
    for name in source.tokenizer_files:
        shutil.copyfile(source.path / name, dest / name)


def write_dllm_checkpoint(dest: Path, source: Source, meta: dict) -> None:
    """A checkpoint `load_for_generation` reads (the layout of dllm_common/checkpoint.py): config,
    one weights file, tokenizer, dllm.json, then digests.json over exactly those files (the card and
    generation_config.json stay editable)."""
    dest.mkdir(exist_ok=True)
    config_name = CONFIG
    if source.is_draft:  # its config.json is the engines' (z-lab) layout as trained
        shutil.copyfile(source.path / CONFIG, dest / CONFIG)
    else:
        _write_json(dest / CONFIG, dllm_config(source))
    if source.verbatim:
        weights = weight_files(source.path)
        for name in weights:
            shutil.copyfile(source.path / name, dest / name)
        if len(weights) > 1:  # the shards' index
            weights.append(WEIGHTS_INDEX)
            shutil.copyfile(source.path / WEIGHTS_INDEX, dest / WEIGHTS_INDEX)
    else:
        weights = [WEIGHTS]
        save_file({k: v.contiguous() for k, v in source.tensors.items()}, str(dest / WEIGHTS), {"format": "pt"})
    _copy_tokenizer(source, dest)
    _write_json(dest / META, meta)
    names = sorted([config_name, *weights, META, *source.tokenizer_files])
    _write_json(dest / DIGESTS, {n: sha256_file(dest / n) for n in names})


def write_export(
    dest: Path, source: Source, found: Provenance, name: str, max_shard_size: int | str, fmt: str | None = None
) -> str:
    """Fill `dest`; returns the layout written ("shared", "separate", or a draft's:
    `tasks.speculative.export.FORMATS`)."""
    backbone, extra = backbone_tensors(source)
    settings = generation_settings(source, found.evaluation)
    generation = transformers_generation(source, settings)
    if source.is_draft:
        layout = draft_format(source.config, fmt)
    elif fmt is not None:
        raise ValueError(f"export --format {fmt!r} chooses a DFlash draft's layout; a {source.strategy} model has one")
    elif source.wrapped or _is_sharded(backbone, max_shard_size):
        layout = "separate"
    else:
        layout = "shared"
    meta = {
        **source.meta,
        "export": {
            "source": source.ref,
            "source_checkpoint_digest": source.digest,
            "layout": layout,
            "lora_merged": source.lora_merged,
            # where generation_config.json cannot hold the sampler settings (its model's class refuses them)
            **({"sampler_settings": settings} if generation is not settings else {}),
        },
    }
    if source.lora_merged and isinstance(meta.get("peft"), dict):
        meta["peft"] = {**meta["peft"], "merged": True}
    if layout == "separate":
        config = hf_config(source)
        weight_files = write_weights(dest, backbone, max_shard_size)
        _write_json(dest / CONFIG, config)
        _copy_tokenizer(source, dest)
        write_dllm_checkpoint(dest / DLLM_SUBDIR, source, meta)
    elif source.is_draft and layout != DLLM_FLOW:
        config = write_draft_export(dest, source, meta, layout)
        weight_files = [WEIGHTS]
    else:
        config = source.config if source.is_draft else dllm_config(source)
        write_dllm_checkpoint(dest, source, meta)
        weight_files = [WEIGHTS]
    _write_json(dest / GENERATION_CONFIG, generation)
    parameters = sum(t.numel() for t in dedupe_tensors(backbone).values())
    written = Layout(layout, config, tuple(weight_files), tuple(extra), parameters, generation is not settings)
    (dest / CARD).write_text(model_card(source, found, name, written, settings))
    return layout


def transformers_generation(source: Source, settings: dict) -> dict:
    """generation_config.json: `settings`, or, for a model shape that is a transformers model with a generation
    config of its own (DiffusionGemma's refuses keys it does not know), what the shape makes of them
    (`exported_generation_config`)."""
    shape = None if source.is_draft else source.config.get("dllm_architecture")
    own = getattr(model_shape(shape), "exported_generation_config", None) if shape else None
    return own(settings, source.config) if own is not None else settings


def generation_settings(source: Source, evaluation: Evaluation | None) -> dict:
    """generation_config.json: the token ids transformers reads, and the strategy's sampler with the
    settings its evaluation sampled with (else the sampler defaults of strategies/sampling.py)."""
    cls = strategy_class(source.strategy)
    sampler = cls.samplers[0]  # what `dllm-flow generate --sampler auto` runs
    tok = source.tokenizer
    evaluated = (evaluation.repro_card or {}).get("sampler") if evaluation else None
    if evaluated:
        cfg, origin = evaluated, f"evaluation {evaluation.key}"
    else:
        temperature = default_temperature(sampler)
        cfg = {**SamplerConfig().__dict__, "temperature": temperature, "top_p": default_top_p(temperature)}
        origin = "sampler defaults"
    temperature = float(cfg["temperature"])
    settings = {
        **_token_ids(tok),
        "mask_token_id": source.meta.get("mask_token_id"),
        "max_new_tokens": cfg["max_new_tokens"],
        "do_sample": temperature > 0,
        "dllm_strategy": source.strategy,
        "dllm_sampler": sampler,
        "dllm_sampler_name": cls.sampler_name,
        "dllm_steps": cfg["steps"],
        "dllm_block_size": cfg["block_size"],
        "dllm_temperature": temperature,
        "dllm_remasking": cfg.get("remasking"),
        "dllm_threshold": cfg.get("threshold"),
        "dllm_logit_shift": cls.logit_shift,
        "dllm_settings_from": origin,
        # what a sampler outside dllm-flow reads (the model card's program): chat prompts, the strategy's options
        "dllm_chat": bool(source.meta.get("chat")),
        "dllm_options": checkpoint_options(source.meta, cls.Options.model_fields),
    }
    if temperature > 0:
        settings["temperature"] = temperature
        settings["top_p"] = float(cfg.get("top_p", 1.0))
        settings["top_k"] = int(cfg.get("top_k", 0))
    return settings
