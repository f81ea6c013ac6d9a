"""A [MASK] id that is also the tokenizer's EOS or PAD id: refused unless `tokenizer.allow_mask_alias` says so.

Absorbing-state diffusion writes [MASK] into every noised position and samples until EOS, and padding is what
rows are filled with: a [MASK] that is EOS makes every masked position read as the end of the text (and the
sampler stop at once), one that is PAD makes it read as padding (docs/strategies.md §7.1). The ids are
checked as early as they are known: at config load where the config says them (explicit `dllm.mask_token_id`,
the tokenizer trained here, a local pretrained tokenizer's files), else once the tokenizer is prepared, and
again where a strategy resolves its mask id, before any training. Torch-free: the config layer reads it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ALLOW = "tokenizer.allow_mask_alias"
# the ids of the tokenizer trained here (tasks/data/tokenizer.py `SPECIAL`, added in that order: pad, eos, mask)
TRAIN_BPE_IDS = {"pad_token_id": 0, "eos_token_id": 1, "mask_token_id": 2, "bos_token_id": None}
_NAMES = {"eos_token_id": "EOS", "pad_token_id": "PAD"}


def mask_alias_problem(mask_id: Any, ids: dict[str, Any], where: str) -> str | None:
    """One line naming what to change when `mask_id` (said by `where`) is the EOS or PAD id in `ids` (a
    tokenizer's `eos_token_id` / `pad_token_id`; an EOS list counts each of its ids), else None."""
    if mask_id is None or isinstance(mask_id, bool):
        return None
    clashes = []
    for key, name in _NAMES.items():
        value = ids.get(key)
        values = value if isinstance(value, list | tuple) else [value]
        if any(v is not None and int(v) == int(mask_id) for v in values):
            clashes.append(name)
    if not clashes:
        return None
    return (
        f"{where} is {mask_id}, which is also the tokenizer's {' and '.join(clashes)} token id: masked positions "
        "would read as the end of the text or as padding; set dllm.mask_token_id to a token id of its own (or use "
        f"a tokenizer with a distinct mask token), or set {ALLOW}: true to train with the alias anyway"
    )


def explicit_mask_ids(shared: dict, overrides: dict, strategies) -> dict[str, Any]:
    """The mask ids a config writes itself: the config key that says it → its id."""
    out = {}
    if shared.get("mask_token_id") is not None:
        out["dllm.mask_token_id"] = shared["mask_token_id"]
    for name in strategies:
        own = (overrides.get(name) or {}).get("mask_token_id")
        if own is not None:
            out[f"dllm.overrides.{name}.mask_token_id"] = own
    return out


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def local_tokenizer_ids(path: str | None, gguf_file: str | None = None) -> dict[str, Any] | None:
    """The special-token ids a local pretrained tokenizer folder's files name (`mask_token_id` the [MASK]'s),
    read without loading it; None when they are not known from its files (a hub id, a GGUF file, no
    tokenizer_config.json): the prepared tokenizer is checked instead."""
    folder = Path(path) if path else None
    if gguf_file or folder is None or not (folder / "tokenizer_config.json").is_file():
        return None
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        names = {f"{k}_token_id": _content(config.get(f"{k}_token")) for k in ("bos", "eos", "pad", "mask")}
        vocab = {_content(t): int(i) for i, t in (config.get("added_tokens_decoder") or {}).items()}
        if any(n is not None and n not in vocab for n in names.values()) and (folder / "tokenizer.json").is_file():
            added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens") or []
            vocab.update({t["content"]: int(t["id"]) for t in added if "content" in t and "id" in t})
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if any(n is not None and n not in vocab for n in names.values()):
        return None
    return {k: None if n is None else vocab[n] for k, n in names.items()}


def config_mask_alias_problem(tokenizer_cfg, shared: dict, overrides: dict, strategies) -> str | None:
    """At config load: a mask id the config itself makes equal to the tokenizer's EOS or PAD id, where the
    config says the tokenizer's ids (None: nothing known aliased, or `tokenizer.allow_mask_alias`)."""
    if getattr(tokenizer_cfg, "allow_mask_alias", False):
        return None
    if tokenizer_cfg.kind == "train_bpe":
        ids = TRAIN_BPE_IDS
    else:
        ids = local_tokenizer_ids(tokenizer_cfg.path, tokenizer_cfg.gguf_file)
        if ids is None:
            return None
    explicit = explicit_mask_ids(shared, overrides, strategies)
    said = dict(explicit)
    if "dllm.mask_token_id" not in explicit:  # a strategy without an id of its own takes the tokenizer's
        said[f"the mask token of tokenizer.path ({tokenizer_cfg.path!r})"] = ids.get("mask_token_id")
    for where, mask_id in said.items():
        problem = mask_alias_problem(mask_id, ids, where)
        if problem:
            return problem
    return None
