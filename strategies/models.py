"""Model adapters: build the tiny embedded-default models, load pretrained ones, run a denoiser.

A stock causal LM (Llama/Qwen3) becomes a bidirectional denoiser by handing it an all-visible
4-D attention mask: transformers passes a prepared 4-D mask through unchanged, so sdpa runs
without its causal flag. Models that are natively bidirectional (LLaDA remote code) are called
with ids only. Which path applies is recorded on the model config as `dllm_attention`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

BIDIRECTIONAL_MASK = "bidirectional_4d"
NATIVE = "native"


def tiny_model_config(family: str, vocab_size: int, max_len: int, hidden_size: int, num_layers: int,
                      num_heads: int, num_kv_heads: int | None, intermediate_size: int | None,
                      tie_embeddings: bool, attn_implementation: str = "sdpa"):
    """A small Llama- or Qwen3-style config built from the pipeline's `model:` section."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
        intermediate_size=intermediate_size or 3 * hidden_size, max_position_embeddings=max_len,
        tie_word_embeddings=tie_embeddings, rms_norm_eps=1e-5,
    )
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[family]
    if family == "qwen3":
        common["head_dim"] = hidden_size // num_heads
    cfg = cls(**common)
    cfg._attn_implementation = attn_implementation
    return cfg


def build_model(config, seed: int, dllm_attention: str = BIDIRECTIONAL_MASK) -> nn.Module:
    """Instantiate a causal-LM module from a config with a deterministic init."""
    from transformers import AutoModelForCausalLM

    config.dllm_attention = dllm_attention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model


def load_pretrained(path: str, *, dtype: str = "float32", trust_remote_code: bool = False,
                    gguf_file: str | None = None, attn_implementation: str = "sdpa",
                    dllm_attention: str | None = None) -> nn.Module:
    """Load a causal LM from a local dir or hub id (hub access only if the user has one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code, "dtype": getattr(torch, dtype)}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k != "dtype"})
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn_implementation, **kwargs)
    if dllm_attention is None:  # remote-code dLLMs (LLaDA, Dream) attend bidirectionally on their own
        dllm_attention = NATIVE if trust_remote_code and getattr(config, "auto_map", None) else BIDIRECTIONAL_MASK
    model.config.dllm_attention = dllm_attention
    return model


def full_attention_mask(input_ids: Tensor) -> Tensor:
    """All-visible boolean 4-D mask [B, 1, L, L] (an expanded view; no L² allocation)."""
    batch, length = input_ids.shape
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=input_ids.device).expand(batch, 1, length, length)


def model_logits(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """Denoiser forward: logits [B, L, V] with every position attending every position."""
    kwargs = dict(inputs)
    if getattr(model.config, "dllm_attention", BIDIRECTIONAL_MASK) == BIDIRECTIONAL_MASK:
        kwargs["attention_mask"] = full_attention_mask(kwargs["input_ids"])
    out = model(**kwargs, use_cache=False)
    return out.logits if hasattr(out, "logits") else out


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
