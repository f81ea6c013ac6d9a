"""`step_cost.py --explain`: what can be checked on CPU of the GPU path (issue 45, item 3).

- **Graph breaks**: every distinct decoder-layer call of one training step (what `train.compile` compiles, one
  graph reused by identical layers) is captured with its real arguments and run through `torch._dynamo.explain`:
  graphs, graph breaks and their reasons. Zero breaks means one compiled graph per layer kind.
- **Attention path**: every `scaled_dot_product_attention` call of the step is recorded: query and key lengths, the
  mask it gets (none + is_causal, a boolean or additive 4-D mask, its broadcast strides) and the fused kernel
  PyTorch picks for those inputs on this device (`torch._fused_sdp_choice`: flash, efficient, math, ...). On CUDA a
  dense 4-D mask rules out the flash kernel; a block-structured mask is what FlexAttention would take instead.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn
from torch.nn.attention import SDPBackend
from transformers import DynamicCache


def _layers(model: nn.Module) -> list[nn.Module]:
    """Every element of every `layers` ModuleList in the model (an encoder's and a decoder's, a draft's)."""
    out = []
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList):
            out.extend(layers)
    return list({id(m): m for m in out}.values())


def _kind(layer: nn.Module) -> str:
    attn = getattr(layer, "self_attn", None)
    kind = getattr(layer, "attention_type", None) or getattr(attn, "layer_type", None)
    if kind is None and attn is not None and getattr(attn, "sliding_window", None):
        kind = "sliding_attention"
    return type(layer).__name__ + (f"[{kind}]" if kind else "")


def _backend(q, k, v, mask, is_causal, enable_gqa) -> str:
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal, enable_gqa=enable_gqa)
        return SDPBackend(choice).name.lower()
    except Exception as exc:  # noqa: BLE001 - a description, never a failure
        return f"? ({type(exc).__name__})"


def _mask(mask) -> str:
    if mask is None:
        return "none"
    kind = "bool" if mask.dtype == torch.bool else f"additive {str(mask.dtype).removeprefix('torch.')}"
    stride = "broadcast" if 0 in mask.stride() else "dense"
    return f"{kind} {list(mask.shape)} {stride}"


@contextlib.contextmanager
def _recording_sdpa(calls: Counter):
    original = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        key = (
            f"q {q.shape[-2]} × kv {k.shape[-2]}, mask {_mask(attn_mask)}, is_causal={is_causal} → "
            f"{_backend(q, k, v, attn_mask, is_causal, enable_gqa)}"
        )
        calls[key] += 1
        return original(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )

    torch.nn.functional.scaled_dot_product_attention = recorded
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def explain_side(side, step: int) -> dict:
    """One more step of `side` (a `step_cost.Side`) with its layer calls captured and its attention recorded, then
    `torch._dynamo.explain` of each distinct layer call."""
    model = side.trainee.model
    captured: dict[str, tuple[nn.Module, tuple, dict]] = {}

    def hook(layer):
        def pre(module, args, kwargs):
            captured.setdefault(_kind(module), (module, args, dict(kwargs)))

        return pre

    handles = [layer.register_forward_pre_hook(hook(layer), with_kwargs=True) for layer in _layers(model)]
    calls: Counter = Counter()
    try:
        with _recording_sdpa(calls):
            side.step(step)
    finally:
        for handle in handles:
            handle.remove()
    graphs = {}
    # the layers that ran last first: a DiffusionGemma decoder layer reads the encoder's cache as the step left it,
    # and an encoder layer writes into the cache it is given, so it gets a fresh one (its entry was empty then)
    for kind, (layer, args, kwargs) in reversed(captured.items()):
        layer = getattr(layer, "_orig_mod", layer)
        if "Encoder" in kind and isinstance(kwargs.get("cache"), DynamicCache):
            kwargs = {**kwargs, "cache": DynamicCache()}
        torch._dynamo.reset()
        try:
            with side.trainee.autocast():
                out = torch._dynamo.explain(layer)(*args, **kwargs)
            reasons = sorted({str(b.reason).splitlines()[0][:160] for b in out.break_reasons})
            graphs[kind] = (out.graph_count, out.graph_break_count, reasons)
        except Exception as exc:  # noqa: BLE001 - reported, the other layers still explained
            graphs[kind] = (0, -1, [f"explain failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"])
    torch._dynamo.reset()
    return {"graphs": dict(reversed(graphs.items())), "attention": dict(calls)}


def print_explain(results: dict) -> None:
    print("\n## torch._dynamo.explain of each decoder-layer call (what train.compile compiles)\n")
    print("| strategy | side | layer | graphs | graph breaks | reasons |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        for side in ("explain", "explain_causal"):
            for kind, (graphs, breaks, reasons) in r[side]["graphs"].items():
                label = "strategy" if side == "explain" else "causal"
                print(f"| {name} | {label} | {kind} | {graphs} | {breaks} | {'; '.join(reasons) or '-'} |")
    print("\n## attention calls of one step (scaled_dot_product_attention), with the kernel chosen here\n")
    for name, r in results.items():
        for side in ("explain", "explain_causal"):
            label = "strategy" if side == "explain" else "causal"
            for call, n in r[side]["attention"].items():
                print(f"- {name} ({label}): {n}× {call}")
