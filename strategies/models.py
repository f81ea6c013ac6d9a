"""Model adapters: build the tiny embedded-default models, load pretrained ones, run a denoiser, wrap a causal
LM in a strategy's model shape (the shapes live in their strategies' packages, declared in their
registrations) and rebuild any checkpoint's module.

A stock causal LM (Llama/Qwen3) becomes a bidirectional denoiser by handing it an all-visible
4-D attention mask: transformers passes a prepared 4-D mask through unchanged, so sdpa runs
without its causal flag. Models that are natively bidirectional (LLaDA remote code) are called
with ids only. Which path applies is recorded on the model config as `dllm_attention`.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DiffusionGemmaConfig,
    DiffusionGemmaTextConfig,
    Gemma4VisionConfig,
    LlamaConfig,
    Qwen3Config,
)

from dllm_common.checkpoint import check_weights_fit, stored_weight_files
from strategies.model_files import check_model_folder, check_weights_cover, resolve_model_path
from strategies.registry import model_shape, model_shapes

BIDIRECTIONAL_MASK = "bidirectional_4d"
NATIVE = "native"


def tiny_model_config(
    family: str,
    vocab_size: int,
    max_len: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None,
    intermediate_size: int | None,
    tie_embeddings: bool,
    attn_implementation: str = "sdpa",
):
    """A small Llama- or Qwen3-style config built from the pipeline's `model:` section."""

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        intermediate_size=intermediate_size or 3 * hidden_size,
        max_position_embeddings=max_len,
        tie_word_embeddings=tie_embeddings,
        rms_norm_eps=1e-5,
    )
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    if family == "qwen3":
        common["head_dim"] = hidden_size // num_heads
    cfg = cls(**common)
    cfg._attn_implementation = attn_implementation
    return cfg


def tiny_shape(spec, vocab_size: int) -> tuple:
    """The shape `model:` gives a tiny model, in the order of `tiny_model_config`'s arguments after the family:
    vocabulary, longest row, hidden size, layers, heads, key/value heads, MLP width."""
    m = spec.model
    return (
        vocab_size,
        spec.data.seq_len,
        m.hidden_size,
        m.num_layers,
        m.num_heads,
        m.num_kv_heads,
        m.intermediate_size,
    )


def _smallest_vision() -> Gemma4VisionConfig:
    """The vision tower DiffusionGemma's architecture cannot leave out, at its smallest: one 8-wide layer."""
    return Gemma4VisionConfig(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        position_embedding_size=16,
        patch_size=4,
    )


def tiny_diffusion_gemma_config(
    vocab_size: int,
    max_len: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int | None,
    intermediate_size: int | None,
    *,
    num_experts: int,
    top_k_experts: int,
    moe_intermediate_size: int | None,
    canvas_length: int,
    token_ids: dict[str, int] | None = None,
    attn_implementation: str = "sdpa",
) -> DiffusionGemmaConfig:
    """A small `DiffusionGemmaConfig` sized like `tiny_model_config` (docs/strategies.md §9.5).

    DiffusionGemma has no dense option: every layer adds a routed mixture of experts to its dense MLP, so the
    smallest is one expert chosen for every token (`num_experts=1, top_k_experts=1`); the expert's width
    defaults to a third of the dense MLP's. Full-attention layers use the sliding layers' head size and
    key/value heads (the published models give them wider heads of their own), the layer pattern and the
    sliding window are DiffusionGemma's defaults (5 sliding : 1 full, the last full; 512 tokens). The vision
    tower cannot be left out of the architecture: it is a Gemma 4 vision tower of one 8-wide layer, never
    trained on text. Head, encoder and decoder are tied (`tie_word_embeddings`)."""
    head_dim = hidden_size // num_heads
    layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers - 1)]
    kv_heads = num_kv_heads or num_heads
    intermediate = intermediate_size or 3 * hidden_size
    text = DiffusionGemmaTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        global_head_dim=head_dim,
        num_global_key_value_heads=kv_heads,
        layer_types=[*layer_types, "full_attention"],
        max_position_embeddings=max_len,
        num_experts=num_experts,
        top_k_experts=top_k_experts,
        moe_intermediate_size=moe_intermediate_size or max(1, intermediate // 3),
        **(token_ids or {}),
    )
    config = DiffusionGemmaConfig(
        text_config=text, vision_config=_smallest_vision(), canvas_length=canvas_length, tie_word_embeddings=True
    )
    config._attn_implementation = attn_implementation
    return config


SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def tokenizer_token_ids(tokenizer) -> dict[str, int | None]:
    """The tokenizer's own BOS/EOS/PAD ids, None where it has none."""
    return {k: getattr(tokenizer, k, None) for k in SPECIAL_TOKEN_IDS}


def set_token_ids(config, tokenizer, mask_token_id: int | None = None) -> None:
    """Name the tokenizer's BOS/EOS/PAD ids (None where it has none) on a built model's config and its text
    config, and the [MASK] id where the strategy has one (`mask_token_id`), so every folder saved from the model
    says what its tokenizer says (a tiny Llama config otherwise keeps transformers' defaults, BOS 1 and EOS 2).
    A config that already lists several EOS ids, the tokenizer's among them (a pretrained model's), keeps its
    list. Set after the model is built: a config's `pad_token_id` becomes the embedding's `padding_idx` (a row
    initialized to zero and never trained), which must not change what trains."""
    ids = tokenizer_token_ids(tokenizer)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for cfg in {id(c): c for c in (config, text)}.values():
        for key, value in ids.items():
            current = getattr(cfg, key, None)
            if not (isinstance(current, list) and value in current):
                setattr(cfg, key, value)
        if mask_token_id is not None:
            cfg.mask_token_id = int(mask_token_id)


def build_model(config, seed: int, dllm_attention: str = BIDIRECTIONAL_MASK) -> nn.Module:
    """Instantiate a causal-LM module from a config with a deterministic init."""

    config.dllm_attention = dllm_attention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model


def load_pretrained(
    path: str,
    *,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    gguf_file: str | None = None,
    attn_implementation: str = "sdpa",
    dllm_attention: str | None = None,
    where: str = "model.path",
) -> nn.Module:
    """Load a causal LM from a local dir or hub id (hub access only if the user has one), its weights' headers
    checked against the model first (`check_pretrained_weights`; `where`: the key that named it)."""

    given, path = path, resolve_model_path(path)
    check_model_folder(given, path, gguf_file)  # one line naming model.path, not the library's error

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "dtype": getattr(torch, dtype)}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k != "dtype"})
    if not gguf_file:  # a GGUF file's tensors are the GGUF reader's to de-quantize
        check_pretrained_weights(path, where, config, trust_remote_code=trust_remote_code)
    model, info = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=attn_implementation, output_loading_info=True, **kwargs
    )
    check_weights_cover(given, path, sorted(info.get("missing_keys") or []))  # random weights are refused
    if dllm_attention is None:  # remote-code dLLMs (LLaDA, Dream) attend bidirectionally on their own
        dllm_attention = NATIVE if trust_remote_code and getattr(config, "auto_map", None) else BIDIRECTIONAL_MASK
    model.config.dllm_attention = dllm_attention
    return model


def check_pretrained_weights(path: str, where: str, config=None, build=None, trust_remote_code: bool = False) -> None:
    """Before `from_pretrained` reads the weights at `path` (a local folder or hub id): every tensor its safetensors
    headers declare, against the module its config builds on the meta device (shapes and dtypes, no memory, no
    initialization), `check_weights_fit` refusing a misfit in one line naming `where`. `build(config)`: the
    module's class (default: the Auto causal LM). A quantized checkpoint's tensors are the quantizer's to read."""
    files = stored_weight_files(path)
    if not files:
        return
    config = copy.deepcopy(config or AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code))
    if getattr(config, "quantization_config", None):
        return
    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            model = (
                build(config)
                if build
                else AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
            )
    except Exception:  # noqa: BLE001 - remote code that cannot be built on the meta device: from_pretrained checks it
        return
    check_weights_fit(model, files, where, getattr(model, "base_model_prefix", ""))


def full_attention_mask(input_ids: Tensor) -> Tensor:
    """All-visible boolean 4-D mask [B, 1, L, L] (an expanded view of one row; no L² allocation).

    The row is real memory (last-dimension stride 1): CUDA's fused attention kernels refuse a mask whose last
    dimension has stride 0, and SDPA then falls back to its math kernel, which keeps an fp32 [B, H, L, L]
    probability tensor per layer for backward (measured on an H200: 39.3 GB peak instead of ~29 GB for mdlm)."""
    batch, length = input_ids.shape
    return torch.ones(1, 1, 1, length, dtype=torch.bool, device=input_ids.device).expand(batch, 1, length, length)


def model_logits(model: nn.Module, inputs: dict[str, Tensor], time: Tensor | float | None = None) -> Tensor:
    """Denoiser forward: logits [B, L, V] with every position attending every position. `time`: the noise
    level of each row ([B] or a scalar), read by a time-conditioned backbone (`add_time_conditioning`) and
    ignored by any other."""
    kwargs = dict(inputs)
    config = getattr(model, "module", model).config  # DDP/FSDP wrappers hold the HF model as `.module`
    if getattr(config, "dllm_attention", BIDIRECTIONAL_MASK) == BIDIRECTIONAL_MASK:
        kwargs["attention_mask"] = full_attention_mask(kwargs["input_ids"])
    with time_input(model, time):
        out = model(**kwargs, use_cache=False)
    return out.logits if hasattr(out, "logits") else out


# ------------------------------------------------------------------ time conditioning (docs/strategies.md §8.2)

TIME_CONDITIONING = "dllm_time_conditioning"  # config flag: the backbone carries a `TimeEmbedding`
TIME_MODULE = "dllm_time_embedding"  # its attribute on the causal LM (state-dict prefix)


class TimeEmbedding(nn.Module):
    """The noise level t ∈ [0, 1] of each row → one vector added to every token embedding of the row.

    Sinusoidal features of 1000·t (the transformer's position code applied to the time, as DDPM and
    DiT do) go through Linear → SiLU → Linear. The last layer starts at zero, so a freshly added
    embedding leaves the backbone's output unchanged. It works through a forward hook on the input
    embedding: `time_input(model, t)` sets the rows' times for the duration of one forward; with no time
    set the hook adds nothing."""

    def __init__(self, hidden_size: int, features: int = 128, scale: float = 1000.0):
        super().__init__()
        half = features // 2
        freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float32) / half)
        self.register_buffer("freqs", freqs, persistent=False)
        self.scale = scale
        self.mlp = nn.Sequential(nn.Linear(2 * half, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.zeros_(self.mlp[2].bias)
        self.current: Tensor | None = None  # the rows' times during a forward (never saved)

    def forward(self, t: Tensor) -> Tensor:
        """[B] times → [B, hidden]."""
        angles = (self.scale * t.float())[:, None] * self.freqs[None, :]
        weight = self.mlp[0].weight
        return self.mlp(torch.cat([angles.cos(), angles.sin()], dim=-1).to(weight.dtype))

    def add_to_embeddings(self, module: nn.Module, args, output: Tensor) -> Tensor:
        if self.current is None:
            return output
        t = self.current.to(output.device).reshape(-1)
        if t.numel() == 1:
            t = t.expand(output.shape[0])
        return output + self(t).to(output.dtype)[:, None, :]


def time_embedding(model: nn.Module) -> TimeEmbedding | None:
    """The backbone's `TimeEmbedding`, or None for a backbone that reads no time."""
    return getattr(backbone_lm(getattr(model, "module", model)), TIME_MODULE, None)


def add_time_conditioning(model: nn.Module, seed: int = 0) -> TimeEmbedding:
    """Give the causal LM inside `model` a `TimeEmbedding` in place (idempotent), recorded on its config so a
    checkpoint rebuilds it (`model_from_config_dir`). Initialized from its own seed: the global RNG is untouched."""
    existing = time_embedding(model)
    if existing is not None:
        return existing
    lm = backbone_lm(getattr(model, "module", model))
    embed = lm.get_input_embeddings()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = TimeEmbedding(lm.config.hidden_size)  # initialized on the CPU in fp32 (the same values everywhere)
    # placed beside the embedding tensor by tensor, not with `Module.to`: that swaps a fake or meta tensor in
    # place, which fails for one made under a fake-tensor mode (`dllm-flow plan` builds its model fake)
    device, dtype = embed.weight.device, embed.weight.dtype
    for sub in module.modules():
        for key, param in list(sub.named_parameters(recurse=False)):
            if param.device != device or param.dtype != dtype:
                setattr(sub, key, nn.Parameter(param.detach().to(device, dtype), param.requires_grad))
        for key, buffer in list(sub.named_buffers(recurse=False)):
            cast = dtype if buffer.is_floating_point() else buffer.dtype
            if buffer.device != device or buffer.dtype != cast:
                setattr(sub, key, buffer.to(device, cast))
    setattr(lm, TIME_MODULE, module)
    embed.register_forward_hook(module.add_to_embeddings)
    setattr(lm.config, TIME_CONDITIONING, True)
    return module


@contextmanager
def time_input(model: nn.Module, time: Tensor | float | None) -> Iterator[None]:
    """Inside this block a time-conditioned backbone reads `time` ([B] or a scalar); otherwise a no-op."""
    module = time_embedding(model) if time is not None else None
    if module is None:
        yield
        return
    module.current = torch.as_tensor(time, dtype=torch.float32)
    try:
        yield
    finally:
        module.current = None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ model shapes


class DLLMOutput(dict):
    """Model output with attribute access: `logits` plus optional `causal_logits` / `encoder_logits`."""

    __getattr__ = dict.get


def wrap_for_architecture(lm: nn.Module, architecture: str | None, mask_token_id: int | None = None) -> nn.Module:
    """Wrap a causal LM in a strategy's model shape (None → the LM itself): the class its registration declares
    under that name (`Registration.models`), built as `Shape(lm, mask_token_id)`. A shape that masks internally
    (hybrid) keeps the mask id; others ignore it."""
    if architecture is None:
        return lm
    return model_shape(architecture)(lm, mask_token_id)


def model_from_config_dir(path, trust_remote_code: bool = False) -> nn.Module:
    """Rebuild the (possibly wrapped, possibly LoRA-adapted) module a dllm-flow checkpoint describes,
    weights not loaded. A registered model shape that recognizes the folder as its own (`describes(path)`, e.g. a
    DFlash draft, whose config.json no Auto class builds) rebuilds itself from it (`from_config_dir`)."""

    for shape in model_shapes().values():
        describes = getattr(shape, "describes", None)
        if describes is not None and describes(path):
            return shape.from_config_dir(path)

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    shape = getattr(config, "dllm_architecture", None)
    own = getattr(model_shape(shape), "from_config", None) if shape else None
    if own is not None:  # a shape that is a transformers model itself (block_diffusion's DiffusionGemma)
        return own(config)
    lm = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    if getattr(config, "dllm_lora", None):
        add_lora(lm, **config.dllm_lora)
    if getattr(config, TIME_CONDITIONING, False):  # added after the adapters, as in training
        add_time_conditioning(lm)
    return wrap_for_architecture(lm, getattr(config, "dllm_architecture", None))


# ------------------------------------------------------------------ large-model training aids


def backbone_lm(model: nn.Module) -> nn.Module:
    """The HF causal LM inside a strategy wrapper (or the model itself)."""
    return getattr(model, "lm", model)


def add_lora(lm: nn.Module, *, r: int, alpha: int, dropout: float, target_modules) -> None:
    """Inject LoRA adapters into `lm` in place (peft) and freeze every other weight of it.
    Recorded on the config so a checkpoint rebuilds the same module (`model_from_config_dir`)."""
    spec = {"r": int(r), "alpha": int(alpha), "dropout": float(dropout), "target_modules": list(target_modules)}
    inject_adapter_in_model(
        LoraConfig(
            r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"], target_modules=spec["target_modules"]
        ),
        lm,
    )
    for name, param in lm.named_parameters():
        param.requires_grad = "lora_" in name
    lm.config.dllm_lora = spec


def lora_state_dict(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in backbone_lm(model).state_dict().items() if "lora_" in k}


def apply_adapter(model: nn.Module, adapter_dir) -> None:
    """Merge a dllm-flow LoRA adapter (`adapter_model.safetensors` + `adapter_config.json`, as a
    training stage publishes it) into `model`'s backbone: inject, load the adapter weights, fold them in."""

    adapter_dir = Path(adapter_dir)
    cfg_file, weights = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    if not (cfg_file.is_file() and weights.is_file()):
        raise FileNotFoundError(f"--adapter {adapter_dir}: expected adapter_config.json and adapter_model.safetensors")
    cfg = json.loads(cfg_file.read_text())
    lm = backbone_lm(model)
    add_lora(lm, r=cfg["r"], alpha=cfg["alpha"], dropout=0.0, target_modules=cfg["target_modules"])
    check_weights_fit(lm, [weights], "--adapter")
    state = load_file(str(weights))
    missing = [k for k in lm.state_dict() if "lora_" in k and k not in state]
    if missing or not state:
        raise ValueError(
            f"--adapter {adapter_dir} does not fit this model (missing {missing[:3]}…); "
            "was it trained on this base checkpoint?"
        )
    lm.load_state_dict(state, strict=False)
    merge_lora(model)


@contextmanager
def adapters_off(model: nn.Module):
    """The model with every LoRA adapter of its backbone switched off for the duration: the base it was added to
    (GRPO's reference under LoRA, with no second copy of the weights). The adapters' weights are untouched and
    trainable again afterwards."""
    layers = [m for m in backbone_lm(model).modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merge_lora(model: nn.Module) -> None:
    """Fold every LoRA update into its base weight and drop the adapter modules (in place)."""
    lm = backbone_lm(model)
    for name, module in list(lm.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            setattr(lm.get_submodule(parent_name) if parent_name else lm, child, module.get_base_layer())
    if hasattr(lm.config, "dllm_lora"):
        del lm.config.dllm_lora
    for param in lm.parameters():
        param.requires_grad = True


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (HF gradient checkpointing, non-reentrant)."""
    lm = backbone_lm(model)
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers ≥ 5.x name
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
