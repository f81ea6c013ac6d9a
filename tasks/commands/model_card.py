"""The model card (README.md) of an exported folder: model, files, loading, lineage, metrics, samples,
repro card. What it reports about the checkpoint's evaluation and training comes from tasks/commands/provenance.py;
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
from strategies.dflash.served_checks import served_notes
from strategies.model_files import resolve_model_path
from tasks.commands.provenance import Checkpoint, Provenance
from tasks.commands.snippets import program as sampling_program
from tasks.evaluation.trained_model import checkpoint_options
from tasks.speculative.export import draft_files_lines, draft_rows

CARD = "README.md"
DLLM_SUBDIR = "model"  # where `resolve_checkpoint` finds a checkpoint inside a folder
SNIPPETS = Path(__file__).parent / "snippets"  # <strategy>.py: sampling with torch and transformers alone


class CardSource(Checkpoint, Protocol):
    """What the card reads of the verified checkpoint (`tasks.commands.export.Source` is one)."""

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

    name: str  # "shared", "separate", or a DFlash draft's layout (tasks/speculative/export.py)
    config: dict  # its config.json
    weight_files: tuple[str, ...]
    extra: tuple[str, ...]  # the strategy wrapper's own tensors, left out of the backbone
    parameters: int  # in the top-level weights, tied weights once
    own_generation: bool = False  # generation_config.json is the model class's own (dllm.json keeps the sampler's)


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
        return draft_rows(c, layout.parameters, ", ".join(dtypes))
    keys = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads")
    keys += ("num_key_value_heads", "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")
    c = {**c.get("text_config", {}), **c}  # a multimodal config keeps the text model's shape in text_config
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
    parts += _files_section(source, layout, name)
    parts += _loading_section(source, name, settings)
    parts += _sampling_section(source)
    parts += _lineage_section(source, found)
    parts += _evaluation_section(found)
    return "\n".join(parts).rstrip() + "\n"


def _files_section(source: CardSource, layout: Layout, name: str) -> list[str]:
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
        lines += draft_files_lines(layout.config, weights, source.meta.get("target", {}), name)
    held = (
        "the settings of the model class's own generation (dllm-flow's sampler settings are in `dllm.json` → "
        "`export.sampler_settings`)"
        if layout.own_generation
        else "the token ids and the sampler settings (`dllm_*`)"
    )
    lines += [
        "",
        f"`generation_config.json` holds {held}; "
        "`digests.json` covers the checkpoint files, not this card or the generation settings.",
        "",
    ]
    return lines


def _model_specific(strategy: str) -> bool:
    """A snippet that declares `MODEL_TYPE` samples through that model class's own generation: the loading section
    shows it (`transformers_snippet`), for checkpoints of that type only."""
    path = SNIPPETS / f"{strategy}.py"
    return path.is_file() and re.search(r"^MODEL_TYPE = ", path.read_text(), flags=re.MULTILINE) is not None


def transformers_snippet(source: CardSource, name: str) -> str | None:
    """`tasks/commands/snippets/<strategy>.py` with `FOLDER` set to the folder's name: sampling with torch and
    transformers alone. A snippet that declares `MODEL_TYPE` fits only checkpoints of that model type; None where none
    fits."""
    path = SNIPPETS / f"{source.strategy}.py"
    if source.is_draft or not path.is_file():
        return None
    text = path.read_text()
    wants = re.search(r'^MODEL_TYPE = "([^"]+)"', text, flags=re.MULTILINE)
    if wants and wants.group(1) != source.config.get("model_type"):
        return None
    return re.sub(r'^FOLDER = "[^"]*"', f"FOLDER = {json.dumps(name)}", text, count=1, flags=re.MULTILINE)


def _loading_section(source: CardSource, name: str, settings: dict) -> list[str]:
    cmd = (
        f"dllm-flow generate --checkpoint {name} --prompt 'To be, or not to be' --steps {settings['dllm_steps']} "
        f"--block-size {settings['dllm_block_size']} --max-new-tokens {settings['max_new_tokens']}"
    )
    lines = ["## How to load", "", "With dllm-flow (the strategy's own sampler, rebuilt from `dllm.json`):", ""]
    lines += [_fenced(cmd, "bash"), ""]
    if source.is_draft:
        return lines
    own = transformers_snippet(source, name)
    if own is not None:
        same = re.search(r"^MAX_NEW_TOKENS = (\d+)", own, flags=re.MULTILINE)
        lines += ["With transformers alone (no dllm-flow installed):", "", _fenced(own, "python"), ""]
        lines += [
            f"Run from the folder that holds `{name}/`. At temperature 0 it gives the tokens of `dllm-flow generate "
            f"--checkpoint {name} --prompt 'To be, or not to be' --temperature 0 --seed 0 --max-new-tokens "
            f"{same.group(1) if same else '…'}` with `--block-size` the model's `canvas_length` and `--steps` one per "
            "block (the snippet's docstring says what it reproduces).",
            "",
        ]
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
    """The strategy's sampling program (tasks/commands/snippets/<strategy>.py, shared parts inlined), which needs
    nothing but torch and transformers; none for a strategy without one (a DFlash draft is no denoiser)."""
    found = None if source.is_draft or _model_specific(source.strategy) else sampling_program(source.strategy)
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
    served = served_notes(ev.metrics)  # a DFlash draft's τ as served, the causes of a gap (docs/evaluation.md §4.7.1)
    lines += [*served, ""] if served else []
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
