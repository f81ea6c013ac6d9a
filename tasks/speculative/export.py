"""`dllm-flow export` of a DFlash draft: the layouts serving engines load (docs/strategies.md §10.10).

- `zlab` (the default): the z-lab / SpecForge `DFlashDraftModel` that SGLang (`--speculative-algorithm DFLASH`),
  vLLM (`"method": "dflash"`) and TensorRT-LLM load: config.json (`architectures: ["DFlashDraftModel"]`,
  `model_type: qwen3`, `block_size`, `num_target_layers`, `dflash_config`) + model.safetensors under the
  engines' names (no `model.` prefix). A dllm-flow draft checkpoint already holds this config.json.
- `speculators`: the `speculators` package's layout (which vLLM reads too): its `DFlashSpeculatorConfig`
  naming the target as the verifier, the same weights.
- `dllm-flow`: the checkpoint as trained; the only layout of a copy-hint draft (`dflash.copy_hint`), whose
  extra input no engine has.

Beside config.json and the weights: the tokenizer (the target's), generation_config.json, the model card and
the dllm-flow record, dllm.json + digests.json. The engines read config.json and *.safetensors only, so the
record costs them nothing, and with it the folder stays a verified dllm-flow checkpoint: `dllm-flow generate
--checkpoint OUT` decodes with it and `model.path: OUT` imports it. Every file is written deterministically
(sorted JSON keys, sorted tensor names, `{"format": "pt"}` metadata): export → import → export gives the same
bytes.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from dllm_common.checkpoint import DIGESTS
from dllm_common.store import sha256_file
from strategies.dflash.config import (
    CONFIG,
    SPECULATORS,
    ZLAB,
    DFlashDraftConfig,
    parse_draft_config,
    write_json,
)
from strategies.dflash.dflash2_config import DFLASH2, DOMINO, DOMINO_DEFAULTS, DSPARK, DSPARK_DEFAULTS, SHAPE_DEFAULTS
from strategies.dflash.serving_layout import verifier_name, write_serving_layout
from strategies.models import tokenizer_token_ids

DLLM_FLOW = "dllm-flow"
FORMATS = (ZLAB, SPECULATORS, DLLM_FLOW)  # `dllm-flow export --format`; the first is a draft's default
META = "dllm.json"


def draft_format(config: dict, fmt: str | None) -> str:
    """The layout a draft is exported in: `fmt`, or the z-lab one. A copy-hint draft has no serving layout."""
    fmt = fmt or ZLAB
    if fmt not in FORMATS:
        raise ValueError(f"export --format {fmt!r}: a DFlash draft exports as one of {', '.join(FORMATS)}")
    cfg = parse_draft_config(config, "the draft").config
    if cfg.copy_hint and fmt != DLLM_FLOW:
        raise ValueError(
            f"this draft reads a copy hint (dflash.copy_hint: true), dllm-flow's own input that no serving engine "
            f"has, so it has no {fmt} layout: export it with --format {DLLM_FLOW} (it then decodes with dllm-flow "
            "only), or train a draft with dflash.copy_hint: false to serve it"
        )
    return fmt


def write_draft_export(dest: Path, source, meta: dict, fmt: str) -> dict:
    """The serving layout `fmt` plus the tokenizer and the dllm-flow record (dllm.json, digests.json over every
    file but the card and generation_config.json) into `dest`; returns the config.json written."""
    cfg = parse_draft_config(source.config, str(source.path)).config
    cfg = dataclasses.replace(cfg, **tokenizer_token_ids(source.tokenizer))  # the ids of the tokenizer beside it
    files = write_serving_layout(dest, cfg, source.tensors, fmt, meta.get("target") or {})
    for name in source.tokenizer_files:
        shutil.copyfile(source.path / name, dest / name)
    write_json(dest / META, meta)
    names = sorted([*files, META, *source.tokenizer_files])
    write_json(dest / DIGESTS, {n: sha256_file(dest / n) for n in names})
    return json.loads((dest / CONFIG).read_text())


# ------------------------------------------------------------------ the model card's draft parts


def draft_rows(config: dict, parameters: int, dtypes: str) -> list[tuple[str, object]]:
    """The card's model table for a draft."""
    read = parse_draft_config(config, "the draft")
    c = read.config
    rows = [
        ("model", "DFlash draft (z-lab / SpecForge `DFlashDraftModel`; no embedding or LM head of its own)"),
        ("layout", read.layout),
        ("hidden_size", c.hidden_size),
        ("num_hidden_layers", c.num_hidden_layers),
        (
            "num_attention_heads / num_key_value_heads / head_dim",
            f"{c.num_attention_heads} / {c.num_key_value_heads} / {c.head_dim}",
        ),
        ("intermediate_size", c.intermediate_size),
        ("block_size (tokens drafted per block: block_size − 1)", c.block_size),
        ("target layer ids (0-based; hidden_states[id + 1])", c.target_layer_ids),
        ("target layer count (num_target_layers)", c.num_target_layers),
        ("mask token id", c.mask_token_id),
        ("rope_theta", c.rope_theta),
        ("copy_hint (reads the context lookup's proposal; docs/strategies.md §10.9)", c.copy_hint),
    ]
    if c.sliding_window is not None:  # docs/strategies.md §10.12
        rows.append(
            (
                "layer_types (sliding_window: positions a sliding layer reads back)",
                f"{c.layer_types} ({c.sliding_window})",
            )
        )
    if c.variant == DFLASH2:  # docs/strategies.md §10.11
        rows[0] = ("model", "DFlash 2 draft (`DFlash2DraftModel`: in-block convolutions and a path selector)")
        rows += [(k, getattr(c, k)) for k in SHAPE_DEFAULTS]
    if c.variant == DOMINO:  # docs/strategies.md §10.15
        rows[0] = ("model", "Domino draft (`DFlashDraftModel` + `prefix_gru` / `embed_proj`: a serial correction head)")
        rows += [(k, getattr(c, k)) for k in DOMINO_DEFAULTS]
    if c.variant == DSPARK:  # docs/strategies.md §10.17
        rows[0] = ("model", "DSpark draft (the DFlash backbone + `markov_head` and `confidence_head`)")
        rows += [(k, getattr(c, k)) for k in DSPARK_DEFAULTS]
    if c.causal:  # docs/strategies.md §10.14
        rows[0] = ("model", "JetSpec draft (`DFlashDraftModel` with `is_causal: true`: causal inside the block)")
    return [*rows, ("parameters", f"{parameters:,}"), ("dtype", dtypes)]


def draft_files_lines(config: dict, weights: str, target: dict, name: str) -> list[str]:
    """The card's files paragraph for a draft, with the commands that serve it."""
    read = parse_draft_config(config, "the draft")
    c = read.config
    if c.copy_hint:
        head = (
            f"`config.json` + {weights} are a dllm-flow DFlash draft that reads a copy hint (`dllm_copy_hint`), an "
            "input no serving engine has: it decodes with dllm-flow only."
        )
    else:
        what = (
            "the z-lab / SpecForge DFlash draft that SGLang, vLLM and TensorRT-LLM load"
            if read.layout == ZLAB
            else "the `speculators` DFlash draft (`DFlashSpeculatorConfig`, which vLLM reads too)"
        )
        if c.variant == DFLASH2:  # docs/strategies.md §10.11
            what = (
                "a DFlash 2 draft in the published layout (`DFlash2DraftModel`, which z-lab's `dflash` package loads"
                if read.layout == ZLAB
                else "a DFlash 2 draft in the speculators layout (`DFlash2SpeculatorConfig`, which vLLM reads"
            ) + "; serving it on an engine is not checked here)"
        if c.causal:  # docs/strategies.md §10.14
            what = (
                "a JetSpec draft in the z-lab layout (`DFlashDraftModel` with `is_causal: true`, which z-lab's "
                "`dflash` package runs causally inside the block; whether an engine honours `is_causal`"
                " is not checked here)"
            )
        if c.variant == DOMINO:  # docs/strategies.md §10.15
            what = (
                "a Domino draft in NeMo Automodel's layout (`dflash_config.projector_type: domino`; no engine or "
                "package that runs Domino is checked here: z-lab's `dflash` 0.1.0 and speculators 0.9.0 have none)"
            )
        if c.variant == DSPARK:  # docs/strategies.md §10.17
            what = (
                "a DSpark draft in the speculators layout (`DSparkSpeculatorConfig`, `speculators_model_type: dspark`, "
                "`sample_from_anchor: false`; speculators' own `DSparkDraftModel` loads it and computes the same block "
                "logits, checked by dllm-flow's tests; serving it on an engine is not checked here)"
                if read.layout != ZLAB
                else "a DSpark draft in dllm-flow's z-lab-style layout (`dflash_config` holds the heads; no engine "
                "loads DSpark from it: export it with `--format speculators`)"
            )
        head = (
            f"`config.json` + {weights} are {what}. The draft reads the hidden states of a frozen causal target and "
            "uses its embedding and LM head, so it is not a model to load on its own."
        )
    lines = [
        head,
        "",
        f"Its target: `{target.get('path')}` (weights digest `{target.get('weights_digest')}`). The tokenizer is the "
        "target's; `dllm.json` and `digests.json` are dllm-flow's record (engines read only `config.json` and the "
        "safetensors): with them the folder is a dllm-flow checkpoint too.",
        "",
    ]
    engine_checked = not (c.copy_hint or c.variant in (DFLASH2, DOMINO, DSPARK) or c.causal)
    return lines + (serve_commands(c, read.layout, name, target) if engine_checked else [])


def serve_commands(c: DFlashDraftConfig, layout: str, name: str, target: dict) -> list[str]:
    """The serving snippet: SGLang's draft-token count is the block size (the anchor included), vLLM's
    `num_speculative_tokens` the block_size − 1 tokens a block proposes."""
    tgt = verifier_name(target.get("path")) if target.get("path") else "TARGET"
    spec = json.dumps({"method": "dflash", "model": name, "num_speculative_tokens": c.block_size - 1})
    vllm = f"vllm serve {tgt} --speculative-config '{spec}'"
    if layout == SPECULATORS:
        commands = [vllm, f"vllm serve {name}  # the speculators config names the target (its verifier)"]
    else:
        commands = [
            f"python -m sglang.launch_server --model-path {tgt} --speculative-algorithm DFLASH \\",
            f"    --speculative-draft-model-path {name} --speculative-num-draft-tokens {c.block_size}",
            vllm,
        ]
    return [
        f"Serve it as the draft of its target (block size {c.block_size}: {c.block_size - 1} tokens drafted per step):",
        "",
        "```bash",
        *commands,
        "```",
        "",
    ]
