"""Sliding-window draft layers and the draft's own attention shape, as a draft's config.json writes them
(docs/strategies.md §10.12); torch-free like `strategies.dflash.config`, which it serves.

A DFlash draft layer is `full_attention` (a block reads the whole context before its anchor) or `sliding_attention`
(the query at sequence position A + o reads only the context keys k with A + o − k < `sliding_window`). The published
drafters and their readers write and read it in the Qwen3 config's own keys:
- NeMo Automodel's DFlash recipe (`draft_sliding_window`): every draft layer `sliding_attention`, `sliding_window`,
  `use_sliding_window: true`, and `is_causal: false` always, because a reader that infers causality from the layer
  type runs `sliding_attention` causally.
- z-lab's `dflash` package (`DFlashDraftModel`): a layer is causal when `is_causal` says so, and when it is absent,
  when it is `sliding_attention`; a non-causal sliding layer hides keys with |q − k| ≥ window on both sides, the
  block's own included.
- transformers' `Qwen3Config`: `sliding_window` is dropped when `use_sliding_window` is false, and without
  `layer_types` the layers from `max_window_layers` on are the sliding ones.
dllm-flow's draft is bidirectional inside a block, or causal in every layer (a JetSpec draft, `is_causal: true`,
docs/strategies.md §10.14), so a config that one of these readers would run causally where it was trained
bidirectionally, or without its window, is refused by name; a window smaller than the block (which the engines
apply inside the block too) is refused as well. The last section checks a new draft's `dflash` options against the
draft they build or the draft imported: its attention, and the top-k options its vocabulary bounds.
"""

from __future__ import annotations

from strategies.dflash.dflash2_config import DFLASH2

FULL, SLIDING = "full_attention", "sliding_attention"
QWEN3_MAX_WINDOW_LAYERS = 28  # transformers' Qwen3Config default, read when a config has no `layer_types`


def window_problem(cfg) -> str | None:
    """What is wrong with a draft config's layer types and window (`cfg`: a `DFlashDraftConfig` whose `layer_types`
    is already a list), or None."""
    types, window, layers = cfg.layer_types, cfg.sliding_window, cfg.num_hidden_layers
    if len(types) != layers:
        return f"layer_types has {len(types)} entries for {layers} layers (num_hidden_layers)"
    other = sorted(set(types) - {FULL, SLIDING})
    if other:
        return f"layer_types {other}: dllm-flow's draft runs {FULL!r} and {SLIDING!r} layers only"
    if SLIDING not in types:
        return None if window is None else f"sliding_window ({window}) is set but no layer is {SLIDING!r}"
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return f"its {SLIDING} layers need sliding_window, a positive number of positions (got {window!r})"
    if window < cfg.block_size:
        return (
            f"sliding_window ({window}) is smaller than block_size ({cfg.block_size}): the engines apply the window "
            "inside the block too (|q − k| < window), so a block's later positions would not see its anchor; use a "
            f"window of at least {cfg.block_size}"
        )
    return None


def default_layer_types(num_layers: int, window: int | None) -> list[str]:
    """A new draft's layers: all sliding when it has a window (Automodel's `draft_sliding_window`), else all full."""
    return [SLIDING if window is not None else FULL] * num_layers


def window_fields(cfg) -> dict:
    """The decoder-config keys of a draft's layers, as the published drafters write them; `max_window_layers` (which
    Qwen3Config reads only without `layer_types`) counts the leading full layers, so that reading agrees too."""
    types = list(cfg.layer_types)
    leading_full = next((i for i, t in enumerate(types) if t != FULL), len(types))
    return {
        "is_causal": bool(cfg.causal),
        "layer_types": types,
        "max_window_layers": leading_full,
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": SLIDING in types,
    }


def raw_layer_types(raw: dict) -> list[str]:
    """A config.json's layer types as Qwen3Config derives them: `layer_types`, or without it the layers from
    `max_window_layers` on when `use_sliding_window` is true and a `sliding_window` is given."""
    given = raw.get("layer_types")
    if given is not None:
        return [str(t) for t in given]
    layers = int(raw.get("num_hidden_layers") or 0)
    windowed = bool(raw.get("use_sliding_window")) and raw.get("sliding_window") is not None
    first = int(raw.get("max_window_layers", QWEN3_MAX_WINDOW_LAYERS))
    return [SLIDING if windowed and i >= first else FULL for i in range(layers)]


def parse_window_fields(raw: dict, refuse) -> dict:
    """`DFlashDraftConfig` keywords (`layer_types`, `sliding_window`) of a z-lab-layout config.json; `refuse(what)`
    makes the error for what dllm-flow's draft can't run."""
    types = raw_layer_types(raw)
    causal = raw.get("is_causal")  # true: a JetSpec draft (strategies.dflash.config reads it)
    if SLIDING not in types:
        return {"layer_types": types, "sliding_window": None}  # a window no layer uses is dropped
    if not raw.get("use_sliding_window"):
        raise refuse(
            f"its layers include sliding-window attention (layer_types {sorted(set(types))}) but use_sliding_window "
            "is not true, so transformers' Qwen3Config drops sliding_window and its readers run those layers without "
            "a window; set use_sliding_window: true (or the layers to full_attention)"
        )
    if causal is None:
        raise refuse(
            "its layers include sliding-window attention and it has no is_causal: z-lab's DFlashDraftModel runs such "
            "layers causally inside the block, NeMo Automodel and dllm-flow bidirectionally; write is_causal: false "
            "if it was trained bidirectionally (as the published drafters do)"
        )
    return {"layer_types": types, "sliding_window": raw.get("sliding_window")}


# ---------------------------------------------------------------------------------------- a new draft's options


def attention_shape_fields(options, model) -> dict:
    """`DFlashDraftConfig` keywords of a new draft's attention: heads, key/value heads and head width from the
    `dflash` options where set, else `model:` (head_dim None: hidden ÷ heads), and the layers' window."""
    heads = options.draft_num_attention_heads or model.num_heads
    kv = options.draft_num_key_value_heads or model.num_kv_heads
    window = options.draft_sliding_window
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": options.draft_head_dim,
        "sliding_window": window,
        "layer_types": default_layer_types(model.num_layers, window),
    }


def attention_shape_problem(options, model) -> tuple[str, str] | None:
    """(the key at fault, what is wrong) with the draft attention the `dflash` options and `model:` describe together
    (the options, where set, take the place of `model.num_heads` / `model.num_kv_heads`), or None."""
    given = options.model_fields_set
    fields = attention_shape_fields(options, model)
    heads, kv = fields["num_attention_heads"], fields["num_key_value_heads"] or fields["num_attention_heads"]
    if heads % kv:
        key = "draft_num_key_value_heads" if "draft_num_key_value_heads" in given else "draft_num_attention_heads"
        return key, (
            f"leaves the draft {heads} query heads and {kv} key/value heads: the key/value heads must divide the "
            f"heads (set dflash.draft_num_key_value_heads to a divisor of {heads})"
        )
    if options.draft_head_dim is None and options.draft_num_attention_heads is not None:
        hidden = model.hidden_size
        if hidden % heads or (hidden // heads) % 2:
            return "draft_num_attention_heads", (
                f"({heads}) does not split the hidden size {hidden} into even head widths: set dflash.draft_head_dim "
                "(the draft's head width, independent of hidden ÷ heads)"
            )
    return None


def vocabulary_problem(options, vocab_size: int | None, source: str) -> tuple[str, str] | None:
    """(the key at fault, what is wrong) with a `dflash` option that picks among the target's `vocab_size` tokens
    (`source` says where that size comes from), or None: the distillation label's top k (`distill_top_k`, a top-k of
    the target's logits) and a DFlash 2 selector's candidates (`selector_top_k`, a top-k of the draft's)."""
    if vocab_size is None:
        return None
    checks = [("distill_top_k", "the soft label keeps the target's k most probable next tokens (0: hard labels)")]
    if options.draft_variant == DFLASH2:
        checks.append(("selector_top_k", "the path selector keeps each position's k most probable candidates"))
    for key, why in checks:
        value = getattr(options, key)
        if value > vocab_size:
            return key, (
                f"({value}) is more than the target's vocabulary of {vocab_size} tokens ({source}): {why}; set it to "
                f"at most {vocab_size}"
            )
    return None


def options_mismatch(options, cfg) -> str | None:
    """What the `dflash` attention options ask that the draft `cfg` (a new one, or one imported) is not, or a top k
    its vocabulary cannot give (`vocabulary_problem`; the strategy checks this at setup, before any training step),
    or None."""
    kv = options.draft_num_key_value_heads
    checks = (
        ("draft_sliding_window", options.draft_sliding_window, cfg.sliding_window),
        ("draft_num_attention_heads", options.draft_num_attention_heads, cfg.num_attention_heads),
        ("draft_num_key_value_heads", kv, cfg.num_key_value_heads),
        ("draft_head_dim", options.draft_head_dim, cfg.head_dim),
    )
    for key, asked, has in checks:
        if asked is not None and asked != has:
            return (
                f"dflash.{key} is {asked} but the draft has {has} ({cfg.layer_types.count(SLIDING)} sliding layers of "
                f"{cfg.num_hidden_layers}): unset dflash.{key} (an imported draft brings its own attention) or set it "
                f"to {has}"
            )
    problem = vocabulary_problem(options, cfg.vocab_size, "the rows of its embedding")
    return None if problem is None else f"dflash.{problem[0]} {problem[1]}"
