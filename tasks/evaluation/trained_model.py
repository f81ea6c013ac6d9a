"""A trained checkpoint loaded with its strategy rebuilt from the checkpoint's own record — what
evaluation, `dllm-flow generate`, the lm-eval harness model and `dllm-flow export` start from."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from dllm_common.checkpoint import CorruptCheckpointError, load_weights_into, read_meta
from strategies import assemble_strategy, strategy_class
from strategies.models import apply_adapter, backbone_lm, model_from_config_dir
from tasks.data.tokenizer import load_tokenizer
from tasks.speculative.setup import draft_strategy, load_target


def load_trained_model(ckpt: Path, device: str, where: str | None = None):
    """The checkpoint's module (wrapped, LoRA-adapted or a DFlash draft as recorded), digests verified first, then its
    weights' headers against the module (a misfit named with `where`: `--checkpoint`, `--redraft`; None: a checkpoint
    the pipeline wrote)."""
    model = model_from_config_dir(ckpt)
    load_weights_into(model, ckpt, where)  # verifies every digest, then every tensor's header
    return model.to(device).eval()


def check_vocabulary(ckpt: Path, tokenizer, rows: int | None) -> None:
    """A tokenizer that can produce ids past the model's embedding rows (its files swapped for another model's, or
    a token added after training) is refused when the checkpoint is loaded, naming both sizes; it would otherwise
    fail on the first such id, deep in torch (`IndexError: index out of range in self`). `rows` None: a model
    without an embedding of its own (a DFlash draft reads its target's)."""
    tokens = len(tokenizer)
    if rows is not None and tokens > rows:
        raise CorruptCheckpointError(
            f"checkpoint {ckpt}: its tokenizer has {tokens} tokens but the model's embedding has {rows} rows "
            f"(config.json vocab_size), so ids {rows}..{tokens - 1} have no embedding; the tokenizer files are not "
            "the ones this model was trained with: put those back (in a store entry, `dllm-flow run --verify` "
            "rebuilds it)"
        )


def embedding_rows(model) -> int | None:
    """How many token ids the model can embed (None: it has no embedding of its own)."""
    lm = backbone_lm(model)
    embeddings = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    return getattr(embeddings, "num_embeddings", None)


def checkpoint_tokenizer(ckpt: Path, model):
    """The checkpoint's tokenizer, checked against the loaded model's vocabulary (`check_vocabulary`)."""
    tokenizer = load_tokenizer(str(ckpt))
    check_vocabulary(ckpt, tokenizer, embedding_rows(model))
    return tokenizer


class Loaded(NamedTuple):
    """A checkpoint ready to generate: what `load_for_generation` returns (unpacks as a 5-tuple)."""

    model: torch.nn.Module
    tokenizer: object
    strategy: object
    mask_id: int | None  # None: a strategy that uses no [MASK] token, given none
    meta: dict


def load_for_generation(ckpt: Path, device: str, adapter: str | None = None, where: str | None = None) -> Loaded:
    """(model, tokenizer, strategy, mask id, meta) — the strategy rebuilt from the checkpoint's record; `where`: the
    flag that named the checkpoint (`--checkpoint`), which a misfit of its weights names."""
    meta = read_meta(ckpt)
    model = load_trained_model(ckpt, device, where)
    if adapter:
        apply_adapter(model, adapter)
    tokenizer = checkpoint_tokenizer(ckpt, model)
    name = meta["strategy"]
    options = checkpoint_options(meta, strategy_class(name).Options.model_fields)
    if strategy_class(name).trains == "draft":  # the draft decodes for the frozen target its checkpoint names
        t = meta["target"]
        section = meta.get(name, {})  # a checkpoint from before typed options kept its strategy's config section
        dtype = t.get("torch_dtype", section.get("target_torch_dtype", "float32"))
        remote = t.get("trust_remote_code", section.get("target_trust_remote_code", False))
        target = load_target(
            t["path"], dtype, device, remote, f"{where or 'the checkpoint'}'s target (dllm.json target.path)"
        )
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
