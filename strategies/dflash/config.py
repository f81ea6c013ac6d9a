"""The DFlash draft's configuration, read from and written to the `config.json` of the layouts serving engines
load (docs/strategies.md §10.10). Torch-free: config validation and the export read it without the model.

Two layouts describe the same draft (the z-lab / SpecForge `DFlashDraftModel`, Qwen3-style layers):
- **zlab** (what SGLang, vLLM and TensorRT-LLM load, and what a dllm-flow draft checkpoint holds): a Qwen3
  config (`model_type: qwen3`, `architectures: ["DFlashDraftModel"]`) plus `block_size`, `num_target_layers`
  (the target's layer count) and `dflash_config: {mask_token_id, target_layer_ids}`; layer id l reads the
  target's `hidden_states[l + 1]` (index 0 is the embedding output).
- **speculators** (the `speculators` package's `DFlashSpeculatorConfig`, which vLLM also reads): the Qwen3
  config nested as `transformer_layer_config`, the layers as `aux_hidden_state_layer_ids` (the
  `hidden_states` indices, l + 1), `speculators_config` naming the verifier (the target) and how many tokens
  a block proposes.

The weights are the same in both (`DRAFT_KEYS`): no embedding and no LM head (the target's). A DFlash 2 draft
(`variant: dflash2`, `strategies.dflash.dflash2_config`) names `DFlash2DraftModel` in both, with its shapes in
`dflash_config` (z-lab) or at the top level (speculators' `DFlash2SpeculatorConfig`, `speculators_model_type:
dflash2`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from strategies.dflash.dflash2_config import (
    ARCHITECTURE2,
    ARCHITECTURE_DSPARK,
    DFLASH,
    DFLASH2,
    DOMINO,
    DOMINO_DEFAULTS,
    DSPARK,
    DSPARK_DEFAULTS,
    JETSPEC,
    SHAPE_DEFAULTS,
    dflash2_config_fields,
    dflash2_keys,
    dflash2_problem,
    domino_config_fields,
    dspark_config_fields,
    parse_dflash2_fields,
    parse_domino_fields,
    parse_dspark_fields,
)
from strategies.dflash.window_config import (
    SLIDING,
    default_layer_types,
    parse_window_fields,
    raw_layer_types,
    window_fields,
    window_problem,
)

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURES = {
    ARCHITECTURE,
    ARCHITECTURE2,
    ARCHITECTURE_DSPARK,
}  # a config.json naming one holds a DFlash-family draft
CONFIG = "config.json"
LEGACY_CONFIG = "dflash_draft.json"  # dllm-flow's own draft before the engines' layout: no longer read
ZLAB, SPECULATORS = "zlab", "speculators"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose DFlash config this writes (and CI loads)
COPY_HINT_KEY = "dllm_copy_hint"  # dllm-flow's own input, no engine has it: written only when on
RETRAIN = (
    "retrain it in this version: run its pipeline config with `model.kind: tiny` (a new draft shaped by `model:`) "
    "instead of `model.kind: pretrained` pointing at it, e.g. `dllm-flow run configs/dflash.yaml`"
)


def legacy_draft_error(path: str | Path) -> ValueError:
    """The one message for a draft folder of dllm-flow's old layout (`dflash_draft.json`)."""
    return ValueError(
        f"{path} holds a DFlash draft in dllm-flow's old layout ({LEGACY_CONFIG}: its own attention without q/k "
        "norms, interleaved RoPE), which no serving engine loads and this version of dllm-flow no longer reads; "
        + RETRAIN
    )


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers a draft reads when none are given (the z-lab / SpecForge / SGLang rule): the middle one for
    a 1-layer draft, else evenly spaced from 1 to T − 3, `round(1 + i·(T − 4)/(D − 1))`."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DFlashDraftConfig:
    """The draft's shape and what ties it to its target, named as the engines' config.json names it.
    `num_key_value_heads`, `head_dim`, `intermediate_size` left None: the number of heads, hidden ÷ heads and
    3 × hidden. `num_target_layers` and `vocab_size` are the target's (None until a target is known)."""

    hidden_size: int  # = the target's hidden size (the draft reads the target's embeddings, writes to its head)
    num_hidden_layers: int
    num_attention_heads: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    num_target_layers: int | None = None
    vocab_size: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    copy_hint: bool = False  # the draft also reads the context lookup's proposal (docs/strategies.md §10.9)
    # "dflash2": DFlash 2's in-block convolutions and path selector, shaped by the four below (`dflash2_config`)
    variant: str = DFLASH
    conv_kernel_size: int = SHAPE_DEFAULTS["conv_kernel_size"]
    conv_group_size: int = SHAPE_DEFAULTS["conv_group_size"]
    selector_rank: int = SHAPE_DEFAULTS["selector_rank"]
    selector_top_k: int = SHAPE_DEFAULTS["selector_top_k"]
    # "domino": a serial GRU correction head (`strategies.dflash.domino`) of these sizes
    gru_hidden_dim: int = DOMINO_DEFAULTS["gru_hidden_dim"]
    emb_dim: int = DOMINO_DEFAULTS["emb_dim"]
    # "dspark": a Markov logit-bias head of rank `markov_rank` and a confidence head (`strategies.dflash.dspark`)
    markov_rank: int = DSPARK_DEFAULTS["markov_rank"]
    markov_head_type: str = DSPARK_DEFAULTS["markov_head_type"]
    enable_confidence_head: bool = DSPARK_DEFAULTS["enable_confidence_head"]
    confidence_head_with_markov: bool = DSPARK_DEFAULTS["confidence_head_with_markov"]
    # each layer's attention, "full_attention" or "sliding_attention" (None: all sliding when `sliding_window` is set,
    # else all full), and the sliding layers' window over the context (docs/strategies.md §10.12)
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // max(self.num_attention_heads, 1)
        if self.intermediate_size is None:
            self.intermediate_size = 3 * self.hidden_size
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        sizes = {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
        }
        bad = [f"{k} ({v})" for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad:
            raise ValueError(f"DFlash draft config: {', '.join(bad)} must be positive integers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DFlash draft config: num_key_value_heads ({self.num_key_value_heads}) must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"DFlash draft config: head_dim ({self.head_dim}) must be even (RoPE rotates pairs)")
        if self.block_size < 2:
            raise ValueError(f"DFlash draft config: block_size ({self.block_size}) must be at least 2")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(
                f"DFlash draft config: target_layer_ids {self.target_layer_ids} must be a non-empty list of "
                "target layer indices (0-based)"
            )
        if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
            raise ValueError(
                f"DFlash draft config: target_layer_ids {self.target_layer_ids} reach past the target's "
                f"{self.num_target_layers} layers (num_target_layers)"
            )
        if self.vocab_size is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"DFlash draft config: mask_token_id {self.mask_token_id} is not a token of the target's "
                f"vocabulary of {self.vocab_size}"
            )
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ValueError("DFlash draft config: rope_theta and rms_norm_eps must be positive")
        given = self.layer_types
        self.layer_types = default_layer_types(self.num_hidden_layers, self.sliding_window) if given is None else given
        self.layer_types = [str(t) for t in self.layer_types]
        problem = dflash2_problem(self) or window_problem(self)
        if problem:
            raise ValueError(f"DFlash draft config: {problem}")

    @property
    def causal(self) -> bool:
        """Attention causal inside the block (JetSpec, docs/strategies.md §10.14): offset o sees offsets ≤ o."""
        return self.variant == JETSPEC

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    # ------------------------------------------------------------------ the engines' config.json

    def _decoder_fields(self) -> dict:
        """The Qwen3 decoder config both layouts hold (the z-lab one at the top level, speculators' nested)."""
        layers = self.num_hidden_layers
        out = {
            "model_type": "qwen3",
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": self.vocab_size,
            **window_fields(self),  # layer_types, sliding_window, use_sliding_window, max_window_layers, is_causal
        }
        # always named, null where the tokenizer has none: a missing key would read as Qwen3Config's default
        return {
            **out,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }

    def to_zlab(self, dtype: str = "float32") -> dict:
        """config.json of the z-lab / SpecForge layout (what SGLang, vLLM and TensorRT-LLM read); dllm-flow's
        own copy-hint flag is added only for a copy-hint draft, which the serving layouts refuse anyway."""
        self._require_target_facts("num_target_layers", "vocab_size")
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        architecture = {DFLASH2: ARCHITECTURE2, DSPARK: ARCHITECTURE_DSPARK}.get(self.variant, ARCHITECTURE)
        variant_fields = {**dflash2_config_fields(self), **domino_config_fields(self), **dspark_config_fields(self)}
        out = {
            **self._decoder_fields(),
            "architectures": [architecture],
            "block_size": self.block_size,
            "dflash_config": {**dflash, **variant_fields},
            "dtype": dtype,
            "num_target_layers": self.num_target_layers,
            "rope_scaling": None,
            "rope_theta": float(self.rope_theta),
        }
        if self.copy_hint:
            out[COPY_HINT_KEY] = True
        return out

    def to_speculators(self, verifier: str, verifier_architectures: list[str], dtype: str = "float32") -> dict:
        """config.json of the speculators layout (`DFlashSpeculatorConfig`): the verifier is the target (its
        path or hub id); a block proposes block_size − 1 tokens (the anchor is the target's own token).
        `sliding_window_non_causal` true keeps sliding-window layers bidirectional inside the block, as the full
        ones always are (and every layer in a vLLM that turns the flag into `dflash_config.causal`)."""
        self._require_target_facts("vocab_size")
        if self.copy_hint:
            raise ValueError(f"a copy-hint draft has no speculators layout ({COPY_HINT_KEY})")
        if self.variant == DOMINO:
            raise ValueError(
                "a Domino draft has no speculators layout in speculators 0.9.0 (its DominoHead is on the main branch "
                "only); export it as --format zlab (dflash_config.projector_type: domino)"
            )
        if self.causal:
            raise ValueError(
                "a JetSpec draft (causal inside the block) has no speculators layout: speculators' DFlash layers are "
                "bidirectional inside the block; export it as --format zlab (is_causal: true)"
            )
        if self.num_target_layers is not None and self.num_target_layers - 1 in self.target_layer_ids:
            raise ValueError(
                f"target layer {self.num_target_layers - 1} is the target's last: speculators reads the layers "
                "before the final norm and drops that one, so this draft has no speculators layout"
            )
        layer_config = {
            **self._decoder_fields(),
            "rope_parameters": {"rope_theta": float(self.rope_theta), "rope_type": "default"},
        }
        # speculators' DFlash2SpeculatorConfig / DSparkSpeculatorConfig: the variant's fields at the top level
        kind = self.variant if self.variant in (DFLASH2, DSPARK) else "dflash"
        own = {DFLASH2: {k: getattr(self, k) for k in SHAPE_DEFAULTS}, DSPARK: dspark_config_fields(self)}
        return {
            **own.get(kind, {}),
            "architectures": [{DFLASH2: ARCHITECTURE2, DSPARK: ARCHITECTURE_DSPARK}.get(kind, ARCHITECTURE)],
            "aux_hidden_state_layer_ids": [i + 1 for i in self.target_layer_ids],
            "block_size": self.block_size,
            "draft_vocab_size": self.vocab_size,
            "dtype": dtype,
            "mask_token_id": self.mask_token_id,
            "sample_from_anchor": False,
            "sliding_window_non_causal": True,
            "speculators_config": {
                "algorithm": kind,
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "accept_tolerance": 0.0,
                        "proposal_type": "greedy",
                        "speculative_tokens": self.block_size - 1,
                        "verifier_accept_k": 1,
                    }
                ],
                "verifier": {"architectures": list(verifier_architectures), "name_or_path": verifier},
            },
            "speculators_model_type": kind,
            "speculators_version": SPECULATORS_VERSION,
            "target_hidden_size": self.hidden_size,
            "tie_word_embeddings": False,
            "transformer_layer_config": layer_config,
        }

    def _require_target_facts(self, *names: str) -> None:
        missing = [k for k in names if getattr(self, k) is None]
        if missing:
            raise ValueError(
                f"DFlash draft config: {', '.join(missing)} unknown (the target's); the draft must be tied to its "
                "target (built or imported against it) before it is written"
            )

    # ------------------------------------------------------------------ reading

    def save_pretrained(self, dest: str | Path) -> None:
        """Write config.json in the z-lab layout (the checkpoint writer calls this like an HF config's)."""
        write_json(Path(dest) / CONFIG, self.to_zlab())

    @classmethod
    def from_dir(cls, path: str | Path) -> DFlashDraftConfig:
        return read_draft_config(path).config


class DraftConfig(NamedTuple):
    """A draft's config.json read: the config, its layout and (speculators) the verifier it names."""

    config: DFlashDraftConfig
    layout: str
    verifier: str | None = None


def write_json(path: Path, obj: Any) -> None:
    """Deterministic JSON: sorted keys, two-space indent, one trailing newline (an export is byte-identical)."""
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def is_draft_dir(path: str | Path) -> bool:
    """A folder holding a DFlash draft: a config.json naming `DFlashDraftModel` (either layout), or the old
    layout's `dflash_draft.json` (which `read_draft_config` refuses with the retrain message)."""
    path = Path(path)
    if (path / LEGACY_CONFIG).is_file() and not (path / CONFIG).is_file():
        return True
    try:
        raw = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and bool(ARCHITECTURES & set(raw.get("architectures") or []))


def read_draft_config(path: str | Path) -> DraftConfig:
    """The config.json of a draft folder in either layout; the old layout and anything that is not a DFlash
    draft are refused with one message each."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        if (path / LEGACY_CONFIG).is_file():
            raise legacy_draft_error(path)
        raise FileNotFoundError(f"{path} is not a DFlash draft (no {CONFIG})")
    return parse_draft_config(json.loads((path / CONFIG).read_text()), str(path))


def parse_draft_config(raw: dict, where: str) -> DraftConfig:
    """`raw` (a config.json) as a `DFlashDraftConfig`, whichever layout wrote it."""
    if not isinstance(raw, dict) or not ARCHITECTURES & set(raw.get("architectures") or []):
        found = raw.get("architectures") if isinstance(raw, dict) else None
        raise ValueError(
            f'{where} is not a DFlash draft: its config.json names architectures {found}, not ["{ARCHITECTURE}"], '
            f'["{ARCHITECTURE2}"] or ["{ARCHITECTURE_DSPARK}"] (a DFlash-family draft in the z-lab / SpecForge or '
            "speculators layout)"
        )
    if "speculators_model_type" in raw:
        return _parse_speculators(raw, where)
    return DraftConfig(_parse_zlab(raw, where), ZLAB)


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(
        f"{where}: {what}; dllm-flow's DFlash draft (full or sliding-window attention, bidirectional or causal in "
        "the block, plain RoPE) can't run it"
    )


def _parse_zlab(raw: dict, where: str) -> DFlashDraftConfig:
    dflash = raw.get("dflash_config") or {}

    def get(key):  # SGLang reads these from `dflash_config` or the top level
        return dflash.get(key, raw.get(key))

    if raw.get("hidden_act", "silu") != "silu":
        raise _refuse(where, f"hidden_act is {raw['hidden_act']!r}, not 'silu'")
    window = parse_window_fields(raw, lambda what: _refuse(where, what))  # docs/strategies.md §10.12
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise _refuse(where, f"its RoPE is scaled ({rope})")
    theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
    missing = [k for k in ("block_size", "mask_token_id") if get(k) is None]
    missing += [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if raw.get(k) is None]
    if missing:
        raise ValueError(f"{where}: the draft's config.json has no {', '.join(missing)}")
    num_target_layers, ids = get("num_target_layers"), get("target_layer_ids")
    if ids is None:
        if num_target_layers is None:
            raise ValueError(f"{where}: the draft's config.json has neither target_layer_ids nor num_target_layers")
        ids = default_layer_ids(int(num_target_layers), int(raw["num_hidden_layers"]))
    # their errors name `where`
    variant = parse_dflash2_fields(raw, get, where) or parse_domino_fields(dflash, where)
    variant = variant or parse_dspark_fields(raw, get, where)
    if raw.get("is_causal"):  # z-lab's reader: every layer causal inside the block, as JetSpec trains it
        if variant:
            name = {DFLASH2: "DFlash 2", DOMINO: "Domino", DSPARK: "DSpark"}[variant["variant"]]
            raise _refuse(where, f"it is a {name} draft with is_causal true")
        variant = {"variant": JETSPEC}
    try:
        return DFlashDraftConfig(
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            block_size=int(get("block_size")),
            target_layer_ids=list(ids),
            mask_token_id=int(get("mask_token_id")),
            num_key_value_heads=raw.get("num_key_value_heads"),
            head_dim=raw.get("head_dim"),
            intermediate_size=raw.get("intermediate_size"),
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            vocab_size=raw.get("vocab_size"),
            rope_theta=float(theta),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            attention_bias=bool(raw.get("attention_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            copy_hint=bool(raw.get(COPY_HINT_KEY, False)),
            **variant,
            **window,
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _parse_speculators(raw: dict, where: str) -> DraftConfig:
    kind = raw.get("speculators_model_type")
    if kind not in ("dflash", "dflash2", "dspark"):
        raise ValueError(f"{where}: a speculators {raw.get('speculators_model_type')!r} model, not a DFlash draft")
    layer = dict(raw.get("transformer_layer_config") or {})
    if raw.get("sample_from_anchor") and kind != "dspark":  # (a DSpark one is refused naming DSpark, below)
        raise _refuse(where, "it also predicts the anchor's token (sample_from_anchor)")
    vocab = layer.get("vocab_size")
    if raw.get("draft_vocab_size") not in (None, vocab):
        raise _refuse(where, f"it drafts over a reduced vocabulary (draft_vocab_size {raw['draft_vocab_size']})")
    if raw.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        raise _refuse(where, f"its target_hidden_size {raw['target_hidden_size']} is not its hidden size")
    if layer.get("is_causal"):  # speculators and vLLM run DFlash layers bidirectionally inside the block
        raise _refuse(where, "its transformer_layer_config says is_causal true, which speculators does not run")
    if SLIDING in raw_layer_types(layer):  # speculators reads `sliding_window_non_causal`, not `is_causal`
        if not raw.get("sliding_window_non_causal"):
            raise _refuse(where, "its sliding-window layers are causal inside the block (sliding_window_non_causal)")
        layer["is_causal"] = False
    aux = raw.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"{where}: the speculators config has no aux_hidden_state_layer_ids")
    flat = {
        **layer,
        "architectures": [{"dflash2": ARCHITECTURE2, "dspark": ARCHITECTURE_DSPARK}.get(kind, ARCHITECTURE)],
        "block_size": raw.get("block_size"),
        "dflash_config": {"mask_token_id": raw.get("mask_token_id"), "target_layer_ids": [i - 1 for i in aux]},
    }
    if kind == "dflash2":  # the shapes sit at the top level of speculators' config, as z-lab's reader also takes them
        flat["dflash_config"].update({k: raw.get(k) for k in SHAPE_DEFAULTS})
    if kind == "dspark":  # so do DSpark's heads (absent: speculators' defaults)
        flat["dflash_config"].update({k: raw[k] for k in (*DSPARK_DEFAULTS, "sample_from_anchor") if k in raw})
    verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return DraftConfig(_parse_zlab(flat, where), SPECULATORS, verifier)


def draft_keys(config: DFlashDraftConfig) -> list[str]:
    """The weight names of a draft in the engines' layout (no `model.` prefix), sorted; a copy-hint draft adds
    dllm-flow's `hint_proj` and `hint_length`."""
    keys = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        keys += [f"{p}mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
        keys += [f"{p}self_attn.{m}_proj.weight" for m in ("q", "k", "v", "o")]
        keys += [f"{p}self_attn.{m}_norm.weight" for m in ("q", "k")]
        if config.attention_bias:
            keys += [f"{p}self_attn.{m}_proj.bias" for m in ("q", "k", "v", "o")]
    if config.copy_hint:
        keys += ["hint_length.weight", "hint_proj.weight"]
    return sorted(keys + dflash2_keys(config))
