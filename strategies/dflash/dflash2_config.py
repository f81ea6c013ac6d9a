"""DFlash 2's part of the draft configuration (docs/strategies.md §10.11), torch-free like `strategies.dflash.config`.

A DFlash 2 draft is the DFlash draft plus two-tap in-block convolutions around every sublayer and a pairwise path
selector over each position's top-k candidates (the DFlash 2 blog, https://inco.ai/blog/dflash2/; NeMo Automodel's
`Qwen3DFlash2DraftModel`; z-lab's `dflash` package, `DFlash2DraftModel`). The published drafters write
`architectures: ["DFlash2DraftModel"]` and the shapes of both modules in `dflash_config`, next to the DFlash keys:
`block_size, conv_group_size, conv_kernel_size, final_logit_softcapping, mask_token_id, output_multiplier,
selector_rank, selector_top_k, target_layer_ids`.
"""

from __future__ import annotations

DFLASH, DFLASH2 = "dflash", "dflash2"  # `DFlashDraftConfig.variant` / the `dflash.draft_variant` option
JETSPEC = "jetspec"  # the DFlash draft with causal attention inside the block (docs/strategies.md §10.14)
DOMINO = "domino"  # the DFlash draft with a serial GRU correction head (docs/strategies.md §10.15)
DSPARK = "dspark"  # the DFlash draft with a Markov logit-bias head and a confidence head (docs/strategies.md §10.17)
# what a serial draft proposes from when speculative decoding samples (T > 0; docs/strategies.md §10.13): its walk
# (the selector's path, the GRU's chain: what z-lab's decoder and the engines sample) or its backbone's one-pass
# distribution. Unset: DFlash 2 its backbone (trained alone throughout, and accepted more often than its walk in
# every measurement), Domino its walk (its backbone trains alone only during the curriculum)
WALK, BACKBONE = "walk", "backbone"
SAMPLED_DEFAULT = {DFLASH2: BACKBONE, DOMINO: WALK, DSPARK: WALK}
SERIAL = (DFLASH2, DOMINO, DSPARK)  # drafts that walk their block after the backbone, one position after another
# Domino's head: the GRU's state size and the projection's inner width (`dflash_config` keys, as NeMo Automodel's)
DOMINO_DEFAULTS = {"gru_hidden_dim": 256, "emb_dim": 128}
DOMINO_KEYS = ["embed_proj.0.weight", "embed_proj.2.weight", "prefix_gru.weight_hh_l0", "prefix_gru.weight_ih_l0"]
ARCHITECTURE2 = "DFlash2DraftModel"
# DSpark's heads, named and defaulted as speculators 0.9.0's `DSparkSpeculatorConfig` (its `markov_rank` 0: no Markov
# head; `confidence_head_with_markov`: the confidence head also reads the previous token's Markov embedding)
DSPARK_DEFAULTS = {
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
}
MARKOV_HEADS = ("vanilla", "gated", "rnn")
ARCHITECTURE_DSPARK = "DSparkSpeculator"  # what speculators' DSpark config names
# the shapes of the convolutions and the selector: the reference's defaults (Automodel's qwen3_dflash2.yaml)
SHAPE_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
# why a kernel is no longer than the block (docs/strategies.md §10.11: the taps never reach across a block)
KERNEL_WHY = (
    "tap j of the in-block convolution reads the position j back inside the same block, so a block has room for as "
    "many taps as it has positions"
)


def dflash2_problem(cfg) -> str | None:
    """What is wrong with a DFlash 2 draft config's shapes (`cfg`: a `DFlashDraftConfig`), or None."""
    if cfg.variant not in (DFLASH, DFLASH2, JETSPEC, DOMINO, DSPARK):
        return f"variant {cfg.variant!r} is not one of {DFLASH!r}, {DFLASH2!r}, {JETSPEC!r}, {DOMINO!r}, {DSPARK!r}"
    if cfg.variant == DSPARK:
        return dspark_problem(cfg)
    if cfg.variant not in (DFLASH2, DOMINO):
        return None
    shapes = SHAPE_DEFAULTS if cfg.variant == DFLASH2 else DOMINO_DEFAULTS
    bad = [k for k in shapes if not isinstance(getattr(cfg, k), int) or getattr(cfg, k) < 1]
    if bad:
        return f"{', '.join(bad)} must be positive integers"
    if cfg.variant == DOMINO:
        return "a Domino draft reads no copy hint (copy_hint)" if cfg.copy_hint else None
    if cfg.hidden_size % cfg.conv_group_size:
        return f"conv_group_size ({cfg.conv_group_size}) must divide hidden_size ({cfg.hidden_size})"
    if cfg.conv_kernel_size > cfg.block_size:
        return f"conv_kernel_size ({cfg.conv_kernel_size}) is larger than block_size ({cfg.block_size}): {KERNEL_WHY}"
    if cfg.vocab_size is not None and cfg.selector_top_k > cfg.vocab_size:
        return f"selector_top_k ({cfg.selector_top_k}) is larger than the vocabulary ({cfg.vocab_size})"
    if cfg.copy_hint:
        return "a DFlash 2 draft reads no copy hint (copy_hint)"
    return None


def dflash2_config_fields(cfg) -> dict:
    """The `dflash_config` entries a DFlash 2 draft adds (logits as the target's head gives them: multiplier 1,
    no soft-capping); {} for another variant."""
    if cfg.variant != DFLASH2:
        return {}
    return {
        "block_size": cfg.block_size,
        **{k: getattr(cfg, k) for k in SHAPE_DEFAULTS},
        "final_logit_softcapping": None,
        "output_multiplier": 1.0,
    }


def domino_config_fields(cfg) -> dict:
    """The `dflash_config` entries of a Domino draft, as NeMo Automodel's `Qwen3DFlashDraftModel` reads them (its
    defaults for the two it also knows: no pure-draft prefix, no shifted labels)."""
    if cfg.variant != DOMINO:
        return {}
    return {"projector_type": DOMINO, **{k: getattr(cfg, k) for k in DOMINO_DEFAULTS}, "pure_draft_prefix_len": 0}


def parse_domino_fields(dflash: dict, where: str) -> dict:
    """`DFlashDraftConfig` keywords of a `dflash_config` naming a projector ({} without one)."""
    kind = dflash.get("projector_type")
    if kind is None:
        return {}
    if kind != DOMINO:
        raise ValueError(f"{where}: its dflash_config names projector_type {kind!r}; dllm-flow runs only 'domino'")
    if dflash.get("pure_draft_prefix_len") or dflash.get("shift_label"):
        raise ValueError(
            f"{where}: this Domino draft leaves its first positions uncorrected (pure_draft_prefix_len) or predicts "
            "shifted labels (shift_label); dllm-flow's Domino corrects every predicted position of an anchor block"
        )
    missing = [k for k in DOMINO_DEFAULTS if dflash.get(k) is None]
    if missing:
        raise ValueError(f"{where}: the Domino draft's dflash_config has no {', '.join(missing)}")
    return {"variant": DOMINO, **{k: int(dflash[k]) for k in DOMINO_DEFAULTS}}


def parse_dflash2_fields(raw: dict, get, where: str) -> dict:
    """`DFlashDraftConfig` keywords of a config.json naming `DFlash2DraftModel` ({} for a DFlash draft); `get(key)`
    reads `dflash_config` then the top level, as z-lab's `_draft_value` does. Logits other than the head's own
    (an output multiplier, soft-capping, a scaled input embedding: Gemma-class targets) are refused."""
    if ARCHITECTURE2 not in (raw.get("architectures") or []):
        return {}
    softcap, multiplier = get("final_logit_softcapping"), get("output_multiplier")
    scale = get("input_embedding_scale")
    if (softcap not in (None, 0, 0.0)) or (multiplier not in (None, 1, 1.0)) or (scale not in (None, 1, 1.0)):
        raise ValueError(
            f"{where}: this DFlash 2 draft rescales the target's logits or embeddings (final_logit_softcapping "
            f"{softcap}, output_multiplier {multiplier}, input_embedding_scale {scale}); dllm-flow's DFlash 2 draft "
            "uses the target's head and embedding as they are and can't run it"
        )
    missing = [k for k in SHAPE_DEFAULTS if get(k) is None]
    if missing:
        raise ValueError(f"{where}: the DFlash 2 draft's config.json has no {', '.join(missing)}")
    return {"variant": DFLASH2, **{k: int(get(k)) for k in SHAPE_DEFAULTS}}


def dflash2_keys(cfg) -> list[str]:
    """The weight names DFlash 2 adds (as the published drafters name them: the codebooks without `.weight`), or
    Domino's head."""
    if cfg.variant == DOMINO:
        return list(DOMINO_KEYS)
    if cfg.variant == DSPARK:
        return dspark_keys(cfg)
    if cfg.variant != DFLASH2:
        return []
    keys = [f"candidate_selector.{k}" for k in ("hidden_projection.weight", "predecessor_codebook")]
    keys.append("candidate_selector.successor_codebook")
    for i in range(cfg.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            keys += [f"layers.{i}.{conv}.base_kernel", f"layers.{i}.{conv}.kernel_projection.weight"]
    return keys


def variant_fields(options) -> dict:
    """The `DFlashDraftConfig` keywords of a new draft under the `dflash` options `options` ({} for DFlash)."""
    variant = getattr(options, "draft_variant", DFLASH)
    if variant == DSPARK:
        return {"variant": DSPARK, **{k: getattr(options, f"dspark_{k}") for k in DSPARK_DEFAULTS}}
    if variant == DOMINO:
        return {"variant": DOMINO, **{k: getattr(options, f"domino_{k}") for k in DOMINO_DEFAULTS}}
    if variant != DFLASH2:
        return {} if variant == DFLASH else {"variant": variant}
    return {"variant": DFLASH2, **{k: getattr(options, k) for k in SHAPE_DEFAULTS}}


# ---------------------------------------------------------------------------------------- DSpark (§10.17)


def dspark_problem(cfg) -> str | None:
    """What is wrong with a DSpark draft config's heads, or None."""
    rank = cfg.markov_rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        return f"markov_rank ({rank}) must be a non-negative integer (0: no Markov head)"
    if cfg.markov_head_type not in MARKOV_HEADS:
        return f"markov_head_type {cfg.markov_head_type!r} is not one of {', '.join(MARKOV_HEADS)}"
    if cfg.confidence_head_with_markov and cfg.enable_confidence_head and rank == 0:
        return "confidence_head_with_markov reads the Markov head's embedding: it needs markov_rank > 0"
    if cfg.copy_hint:
        return "a DSpark draft reads no copy hint (copy_hint)"
    return None


def dspark_config_fields(cfg) -> dict:
    """The `dflash_config` entries of a DSpark draft (its heads; the anchor is the target's token, as in DFlash)."""
    if cfg.variant != DSPARK:
        return {}
    return {**{k: getattr(cfg, k) for k in DSPARK_DEFAULTS}, "sample_from_anchor": False}


def parse_dspark_fields(raw: dict, get, where: str) -> dict:
    """`DFlashDraftConfig` keywords of a config.json naming DSpark ({} otherwise); `get` reads `dflash_config` then the
    top level (speculators writes the heads at the top level). An anchor-first draft (`sample_from_anchor`) is
    refused: its block position k predicts the token after k, which dllm-flow's decoder does not draft."""
    if not {ARCHITECTURE_DSPARK, "DSparkDraftModel"} & set(raw.get("architectures") or []):
        return {}
    if get("sample_from_anchor"):
        raise ValueError(
            f"{where}: this DSpark draft predicts from the anchor position too (sample_from_anchor true: block "
            "position k proposes the token after it); dllm-flow's DSpark keeps the anchor as the target's token and "
            "proposes block_size − 1 tokens (sample_from_anchor false), so it can't run this one"
        )
    out = {"variant": DSPARK}
    for key, default in DSPARK_DEFAULTS.items():
        value = get(key)
        out[key] = default if value is None else (value if isinstance(default, str) else type(default)(value))
    return out


def dspark_keys(cfg) -> list[str]:
    """The weight names DSpark adds (speculators' `markov_head.*` and `confidence_head.proj.*`)."""
    if cfg.variant != DSPARK:
        return []
    keys = []
    if cfg.markov_rank:
        keys += ["markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
        extra = {"gated": "gate_proj", "rnn": "joint_proj"}.get(cfg.markov_head_type)
        if extra:
            keys += [f"markov_head.{extra}.weight", f"markov_head.{extra}.bias"]
    if cfg.enable_confidence_head:
        keys += ["confidence_head.proj.weight", "confidence_head.proj.bias"]
    return keys
