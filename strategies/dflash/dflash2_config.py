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
# what a serial draft proposes from when speculative decoding samples (T > 0; docs/strategies.md §10.13): its walk
# (the selector's path, the GRU's chain: what z-lab's decoder and the engines sample) or its backbone's one-pass
# distribution. Unset: DFlash 2 its backbone (trained alone throughout, and accepted more often than its walk in
# every measurement), Domino its walk (its backbone trains alone only during the curriculum)
WALK, BACKBONE = "walk", "backbone"
SAMPLED_DEFAULT = {DFLASH2: BACKBONE, DOMINO: WALK}
# Domino's head: the GRU's state size and the projection's inner width (`dflash_config` keys, as NeMo Automodel's)
DOMINO_DEFAULTS = {"gru_hidden_dim": 256, "emb_dim": 128}
DOMINO_KEYS = ["embed_proj.0.weight", "embed_proj.2.weight", "prefix_gru.weight_hh_l0", "prefix_gru.weight_ih_l0"]
ARCHITECTURE2 = "DFlash2DraftModel"
# the shapes of the convolutions and the selector: the reference's defaults (Automodel's qwen3_dflash2.yaml)
SHAPE_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
# why a kernel is no longer than the block (docs/strategies.md §10.11: the taps never reach across a block)
KERNEL_WHY = (
    "tap j of the in-block convolution reads the position j back inside the same block, so a block has room for as "
    "many taps as it has positions"
)


def dflash2_problem(cfg) -> str | None:
    """What is wrong with a DFlash 2 draft config's shapes (`cfg`: a `DFlashDraftConfig`), or None."""
    if cfg.variant not in (DFLASH, DFLASH2, JETSPEC, DOMINO):
        return f"variant {cfg.variant!r} is not one of {DFLASH!r}, {DFLASH2!r}, {JETSPEC!r}, {DOMINO!r}"
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
    if variant == DOMINO:
        return {"variant": DOMINO, **{k: getattr(options, f"domino_{k}") for k in DOMINO_DEFAULTS}}
    if variant != DFLASH2:
        return {} if variant == DFLASH else {"variant": variant}
    return {"variant": DFLASH2, **{k: getattr(options, k) for k in SHAPE_DEFAULTS}}
