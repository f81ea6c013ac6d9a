"""The model card (README.md) of an exported folder: model, files, loading, lineage, metrics, samples,
repro card. What it reports about the checkpoint's evaluation and training comes from tasks/provenance.py;
metric meanings: docs/evaluation.md §4.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dllm_common.config import flatten
from strategies import strategy_class
from strategies.models import resolve_model_path
from tasks.checkpoints import checkpoint_options
from tasks.provenance import Checkpoint, Provenance
from tasks.snippets import program as sampling_program

CARD = "README.md"
DLLM_SUBDIR = "model"  # where `resolve_checkpoint` finds a checkpoint inside a folder


class CardSource(Checkpoint, Protocol):
    """What the card reads of the verified checkpoint (`tasks.export.Source` is one)."""

    ref: str
    config: dict
    tensors: dict[str, torch.Tensor]
    lora_merged: bool

    @property
    def strategy(self) -> str: ...

    @property
    def is_draft(self) -> bool: ...

    @property
    def wrapped(self) -> bool: ...


@dataclass(frozen=True)
class Layout:
    """What the export wrote at the top level of the folder."""

    name: str  # "shared", "separate" or "draft"
    config: dict  # its config.json (dflash_draft.json for a draft)
    weight_files: tuple[str, ...]
    extra: tuple[str, ...]  # the strategy wrapper's own tensors, left out of the backbone
    parameters: int  # in the top-level weights, tied weights once


def _md(value) -> str:
    """A table cell."""
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, sort_keys=True)
    else:
        text = "—" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows, header=("", "")) -> str:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {_md(k)} | {_md(v)} |" for k, v in rows]
    return "\n".join(lines)


def _fenced(text: str, lang: str = "") -> str:
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def base_model_license(train_config: dict | None) -> str | None:
    """The base model's license, where training started from a local pretrained model whose card names one."""
    config = flatten(train_config or {})  # a train manifest's slice, or MLflow's already flat params
    if config.get("model.kind") != "pretrained" or not config.get("model.path"):
        return None
    try:
        text = (Path(resolve_model_path(str(config["model.path"]))) / CARD).read_text()
    except OSError:  # a hub id, or no card
        return None
    front = re.match(r"---\n(.*?)\n---", text, flags=re.DOTALL)
    match = re.search(r"^license:\s*([\w.\-]+)\s*$", front.group(1), flags=re.MULTILINE) if front else None
    return match.group(1) if match else None


def _backbone_rows(source: CardSource, layout: Layout) -> list[tuple[str, Any]]:
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in source.tensors.values()})
    c = layout.config
    if source.is_draft:
        rows = [("model", "DFlash draft (no embedding or LM head of its own)")]
        rows += [(k, c.get(k)) for k in ("hidden_size", "num_layers", "num_heads", "block_size", "target_layer_ids")]
        rows.append(
            ("copy_hint (reads the context lookup's proposal; docs/strategies.md §10.9)", c.get("copy_hint", False))
        )
        return [*rows, ("parameters", f"{layout.parameters:,}"), ("dtype", ", ".join(dtypes))]
    keys = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads")
    keys += ("num_key_value_heads", "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")
    rows = [(k, c.get(k)) for k in keys]
    rows.append(("parameters (backbone)", f"{layout.parameters:,}"))
    if layout.extra:
        n_extra = sum(source.tensors[k].numel() for k in layout.extra)
        rows.append(("parameters (strategy wrapper, dllm-flow only)", f"{n_extra:,} ({', '.join(layout.extra)})"))
    return [*rows, ("dtype", ", ".join(dtypes))]


def model_card(source: CardSource, found: Provenance, name: str, layout: Layout, settings: dict) -> str:
    """README.md of the folder `name`: `settings` is what generation_config.json holds."""
    meta, strategy = source.meta, source.strategy
    cls = strategy_class(strategy)
    license_id = base_model_license(found.train_config)
    front = ["---", "library_name: dllm-flow"]
    front += [f"license: {license_id}"] if license_id else []
    front += ["pipeline_tag: text-generation", "tags:", "- dllm-flow", "- diffusion-language-model", f"- {strategy}"]
    front += ["- safetensors", "---", ""]
    options = checkpoint_options(meta, cls.Options.model_fields)
    parts = ["\n".join(front), f"# {name}", ""]
    kind = "a DFlash draft for speculative decoding" if source.is_draft else "a diffusion language model"
    parts.append(
        f"`{strategy}` checkpoint exported by dllm-flow ({kind}); "
        f"trained {meta.get('step', '?')} steps on {meta.get('seq_len', '?')}-token rows."
    )
    if not license_id:
        parts.append("\nLicense: not recorded by dllm-flow; add a `license:` to the front matter before publishing.")

    parts += ["", "## Model", ""]
    rows = [
        ("strategy", strategy),
        ("sampler", f"{settings['dllm_sampler']} ({cls.sampler_name})"),
        ("mask token id", meta.get("mask_token_id")),
        ("chat template", "yes" if meta.get("chat") else "no"),
        ("final validation loss (nats/token)", meta.get("final_val_loss")),
    ]
    if meta.get("peft"):
        lora = meta["peft"]
        merged = "merged into the weights" + (" at export" if source.lora_merged else "")
        rows.append(("LoRA", f"r={lora.get('r')}, alpha={lora.get('alpha')}, {merged}"))
    parts += [_table(rows + _backbone_rows(source, layout), ("", "")), ""]
    parts += ["Strategy options (`dllm.json` → `options`):", "", _fenced(json.dumps(options, indent=2), "json"), ""]
    parts += _files_section(source, layout)
    parts += _loading_section(source, name, settings)
    parts += _sampling_section(source)
    parts += _lineage_section(source, found)
    parts += _evaluation_section(found)
    return "\n".join(parts).rstrip() + "\n"


def _files_section(source: CardSource, layout: Layout) -> list[str]:
    weights = ", ".join(f"`{f}`" for f in layout.weight_files)
    extra = layout.extra
    lines = ["## Files", ""]
    if layout.name == "shared":
        lines.append(
            f"`config.json` + {weights} are both the transformers backbone and the dllm-flow checkpoint "
            "(`dllm.json`, `digests.json`)."
        )
    elif layout.name == "separate":
        why = (
            f"the `{source.strategy}` model wraps the backbone (its checkpoint keys carry the wrapper's prefix"
            + (f" and the wrapper's own {', '.join(f'`{k}`' for k in extra)}" if extra else "")
            + ")"
            if source.wrapped
            else "the weights are sharded and dllm-flow reads one `model.safetensors`"
        )
        lines.append(
            f"`config.json` + {weights} are the plain transformers backbone. `{DLLM_SUBDIR}/` is the dllm-flow "
            f"checkpoint (the same weights in dllm-flow's layout), because {why}."
        )
    else:
        target = source.meta.get("target", {})
        lines.append(
            "This is **not a transformers model**: a DFlash draft has no embedding or LM head and reads the hidden "
            "states of a frozen causal target, so there is no `config.json` to load with `AutoModelForCausalLM`. "
            f"`dflash_draft.json` + {weights} are the dllm-flow checkpoint. It decodes with its target: "
            f"`{target.get('path')}` (weights digest `{target.get('weights_digest')}`), which must exist at that "
            "path where it is loaded."
        )
    lines += [
        "",
        "`generation_config.json` holds the token ids and the sampler settings (`dllm_*`); "
        "`digests.json` covers the checkpoint files, not this card or the generation settings.",
        "",
    ]
    return lines


def _loading_section(source: CardSource, name: str, settings: dict) -> list[str]:
    cmd = (
        f"dllm-flow generate --checkpoint {name} --prompt 'To be, or not to be' --steps {settings['dllm_steps']} "
        f"--block-size {settings['dllm_block_size']} --max-new-tokens {settings['max_new_tokens']}"
    )
    lines = ["## How to load", "", "With dllm-flow (the strategy's own sampler, rebuilt from `dllm.json`):", ""]
    lines += [_fenced(cmd, "bash"), ""]
    if source.is_draft:
        return lines
    mask = source.meta.get("mask_token_id")
    cls = strategy_class(source.strategy)
    causal = cls.logit_shift == 1  # the denoiser runs with causal attention; logit i predicts token i + 1
    attention = (
        "# plain causal attention: the logits at position i predict token i + 1 (logit shift 1)"
        if causal
        else "visible = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool)  # every position sees every one"
    )
    call = "model(input_ids=ids).logits" if causal else "model(input_ids=ids, attention_mask=visible).logits"
    snippet = f"""import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{name}")
model = AutoModelForCausalLM.from_pretrained("{name}")
ids = tokenizer("To be, or not to be", return_tensors="pt").input_ids
ids = torch.cat([ids, torch.full((1, 8), {mask})], dim=1)  # 8 [MASK] tokens to denoise
{attention}
logits = {call}"""
    kind = "causal" if causal else "bidirectional"
    lines += [f"With transformers (the backbone; one {kind} denoising forward):", "", _fenced(snippet, "python")]
    note = (
        "The backbone was trained as a denoiser under causal attention with logit shift 1 (docs/strategies.md §8.4)"
        if causal
        else "The backbone was trained as a bidirectional denoiser: give it the all-visible 4-D mask above"
    )
    note += ". `model.generate()` decodes left to right and is not the diffusion sampler"
    # an exact left-to-right NLL means the backbone has a trained causal path: hybrid's causal branch
    # (docs/strategies.md §8.3), idlm's clean half (§8.4); a draft returned above
    if "ar_nll" in cls.likelihoods:
        note += "; this strategy also trains a causal (AR) path: `model.generate()` runs it"
    return [*lines, "", note + ".", ""]


def _sampling_section(source: CardSource) -> list[str]:
    """The strategy's sampling program (tasks/snippets/<strategy>.py, shared parts inlined), which needs nothing
    but torch and transformers; none for a strategy without one (a DFlash draft is no denoiser)."""
    found = None if source.is_draft else sampling_program(source.strategy)
    if found is None:
        return []
    lines = ["## Sampling without dllm-flow", "", found.summary, ""]
    lines += [f"Save it as `{source.strategy}.py` (it imports only torch and transformers):", ""]
    return [*lines, _fenced(found.text, "python"), ""]


def _lineage_section(source: CardSource, found: Provenance) -> list[str]:
    meta = source.meta
    rows = [
        ("source checkpoint", source.ref),
        ("checkpoint digest (sha256 of digests.json)", source.digest),
        ("train stage key", meta.get("stage_key")),
        ("data key", meta.get("data_key")),
        ("data digest", found.data_digest or "not found"),
        ("data digest from", found.data_digest_source),
        ("MLflow run id", meta.get("mlflow_run_id")),
        ("MLflow tracking URI", found.tracking_uri),
        ("registered model", found.registered_model),
    ]
    if meta.get("target"):
        t = meta["target"]
        rows += [("DFlash target", t.get("path")), ("target weights digest", t.get("weights_digest"))]
    lines = ["## Training lineage", "", _table(rows, ("", "")), ""]
    if found.train_config:
        lines += [f"Training configuration (from {found.train_config_source}):", ""]
        lines += [_fenced(json.dumps(found.train_config, indent=2, sort_keys=True), "json"), ""]
    else:
        lines += ["Training configuration: not found (no train store entry or MLflow run reachable).", ""]
    return lines


def _evaluation_section(found: Provenance) -> list[str]:
    ev = found.evaluation
    lines = ["## Evaluation", ""]
    if ev is None:
        lines.append("No evaluation found for this checkpoint: this export carries no metrics.")
        lines += [f"- {n}" for n in found.notes] + [""]
        lines += ["## Reproducibility card", "", "None (no evaluation found).", ""]
        return lines
    lines += [f"From {ev.source}. Metric definitions: dllm-flow's docs/evaluation.md.", ""]
    lines += [_table(sorted(ev.metrics.items()), ("metric", "value")), ""]
    if ev.others:
        lines += [f"Other evaluations of this checkpoint: {', '.join(ev.others)}.", ""]
    lines += ["### Sample outputs", ""]
    lines += [_fenced(ev.samples, "text") if ev.samples else "No samples recorded.", ""]
    lines += ["## Reproducibility card", ""]
    if ev.repro_card:
        lines += [_table(sorted(flatten(ev.repro_card).items()), ("field", "value")), ""]
    else:
        lines += ["Not recorded with this evaluation.", ""]
    return lines
