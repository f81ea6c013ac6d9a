"""Block diffusion on transformers' DiffusionGemma (docs/strategies.md §9.5): the model vLLM and SGLang serve.

`DiffusionGemmaCanvas` *is* `transformers.DiffusionGemmaForBlockDiffusion` (same modules, parameter names,
config and maths; a checkpoint's `config.json` names transformers' class, so `from_pretrained` loads it
without dllm-flow). It adds the call block_diffusion trains and samples with, which transformers' own forward
cannot express: the encoder over a whole padded row, a canvas of several blocks under the block-causal 4-D
masks, and the two self-conditioning passes of training. Called without `canvas_ids`, it is transformers'
forward unchanged (its `generate` runs on it as on the original).

The call (`canvas_forward`), as in `BlockDiffusionLM`:
1. Encode: the shared layers run causally over the clean row into a cache that keeps every layer's K/V
   (`DynamicCache()` without a config: the sliding-window layers are windowed by their 4-D mask, not by
   trimming); the encoder's final states give `encoder_logits` (next-token head, training only).
2. Self-conditioning (training, two passes): pass 1 decodes under no_grad without it; pass 2 feeds
   softmax(pass-1 logits)·E·√H, gated per row by `do_self_conditioning`, to DiffusionGemma's own
   self-conditioning block. With `self_conditioning_logits` given (sampling), one pass.
3. Decode: DiffusionGemma's decoder over the encoder cache, the canvas attending under the block-causal
   masks `{"full_attention", "sliding_attention"}` (docs/strategies.md §6.3).
Logits are DiffusionGemma's: 30·tanh(lm_head(h)/30) in fp32; under the fused head the cap is applied per
chunk (`strategies.head`, `softcap_in_head`).

The soft embedding reaches the decoder through a forward pre-hook on its self-conditioning block, in place
of the logits transformers would take: that lets a deferred head (`HeadProjection`) form it chunk by chunk.
The vision tower (which the architecture cannot leave out) is frozen: text never reaches it.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoConfig, DiffusionGemmaForBlockDiffusion, DynamicCache
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaTextExperts

from strategies.block_diffusion.options import DIFFUSION_GEMMA
from strategies.head import HeadProjection, softcap_logits
from strategies.model_files import resolve_model_path
from strategies.models import DLLMOutput, check_pretrained_weights, tiny_diffusion_gemma_config, tiny_shape

PUBLISHED = "DiffusionGemmaForBlockDiffusion"  # the class a checkpoint names: transformers' own


class DiffusionGemmaCanvas(DiffusionGemmaForBlockDiffusion):
    """`DiffusionGemmaForBlockDiffusion` with block_diffusion's canvas call (module docstring)."""

    softcap_in_head = True  # `strategies.head.SOFTCAP_IN_HEAD`: a deferred head may return capped projections
    shares_layers = (
        True  # encoder and decoder layers hold the same parameters (`tasks.training.distributed.shard_fsdp2`)
    )

    def __init__(self, config):
        super().__init__(config)
        config.dllm_architecture = DIFFUSION_GEMMA
        config.architectures = [PUBLISHED]
        encoder = self.model.encoder
        for module in (encoder.vision_tower, encoder.embed_vision):
            module.requires_grad_(False)
        if config.get_text_config().num_experts == 1:  # one expert for every token: no dispatch to pay for
            for module in self.modules():
                if type(module) is DiffusionGemmaTextExperts:
                    module.__class__ = OneExpert

    # ------------------------------------------------------------------ building

    @classmethod
    def from_config(cls, config) -> DiffusionGemmaCanvas:
        """The module a checkpoint's config describes, weights not loaded (`models.model_from_config_dir`)."""
        return cls(config)

    @classmethod
    def exported_generation_config(cls, settings: dict, config: dict) -> dict:
        """generation_config.json of an export (`tasks.commands.export`): what DiffusionGemma's generation reads (it
        refuses other keys), from dllm-flow's sampler `settings`: the token ids, the new tokens, and the sampler's steps
        per block as its most denoising steps per canvas. Its sampler is its own (docs/strategies.md §11.6)."""
        blocks = math.ceil(settings["max_new_tokens"] / min(config["canvas_length"], settings["dllm_block_size"]))
        ids = {k: settings[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in settings}
        return {
            **ids,
            "max_new_tokens": settings["max_new_tokens"],
            "max_denoising_steps": settings["dllm_steps"] // blocks or 1,
        }

    @classmethod
    def from_model_spec(cls, spec, tokenizer, options, seed: int) -> DiffusionGemmaCanvas:
        """The model `model:` describes: a tiny DiffusionGemma sized from it and `options`' experts, or the
        DiffusionGemma checkpoint at `model.path`."""
        m = spec.model
        if m.kind == "tiny":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return cls(cls.tiny_config(spec, tokenizer, options))
        path = resolve_model_path(m.path)
        if m.gguf_file:
            raise ValueError("model.gguf_file: a DiffusionGemma checkpoint is read from safetensors; unset it")
        config = AutoConfig.from_pretrained(path, trust_remote_code=m.trust_remote_code)
        cls.check_checkpoint_config(config, m.path)
        check_pretrained_weights(path, "model.path", config, build=cls)  # its headers, before any weight is read
        return cls.from_pretrained(path, dtype=getattr(torch, m.dtype), attn_implementation=m.attn_implementation)

    @classmethod
    def tiny_config(cls, spec, tokenizer, options):
        """The tiny DiffusionGemma `model:` sizes, with `options`' experts and `tokenizer`'s special ids (also what
        `dllm-flow plan` builds from)."""
        ids = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id}
        ids["bos_token_id"] = tokenizer.bos_token_id
        return tiny_diffusion_gemma_config(
            *tiny_shape(spec, len(tokenizer)),
            num_experts=options.num_experts,
            top_k_experts=options.top_k_experts,
            moe_intermediate_size=options.moe_intermediate_size,
            canvas_length=options.block_size,
            token_ids={k: v for k, v in ids.items() if v is not None},
            attn_implementation=spec.model.attn_implementation,
        )

    @staticmethod
    def check_checkpoint_config(config, path: str) -> None:
        """A checkpoint this shape loads is a DiffusionGemma one; another is one error naming the shape for it."""
        if config.model_type != "diffusion_gemma":
            raise ValueError(
                f"model.path {path!r} is a {config.model_type!r} checkpoint, not a DiffusionGemma one: to turn a "
                "causal LM into a block-diffusion model set dllm.architecture: stack"
            )

    # ------------------------------------------------------------------ the canvas call

    @property
    def canvas_sliding_window(self) -> int | None:
        """The window of the sliding-attention layers (None: it has none), which their canvas mask applies."""
        text = self.config.get_text_config()
        return text.sliding_window if "sliding_attention" in text.layer_types else None

    def forward(self, *args, canvas_ids: Tensor | None = None, **kwargs):
        if canvas_ids is None:  # transformers' own call
            return super().forward(*args, **kwargs)
        return self.canvas_forward(canvas_ids=canvas_ids, **kwargs)

    def canvas_forward(
        self,
        input_ids: Tensor,
        canvas_ids: Tensor,
        decoder_attention_mask: dict,
        encoder_position_ids: Tensor | None = None,
        encoder_padding_mask: Tensor | None = None,
        decoder_position_ids: Tensor | None = None,
        do_self_conditioning: Tensor | None = None,
        self_conditioning_logits: Tensor | HeadProjection | None = None,
        **_,
    ) -> DLLMOutput:
        if not isinstance(decoder_attention_mask, dict):
            raise ValueError(
                "DiffusionGemmaCanvas needs decoder_attention_mask as {'full_attention', 'sliding_attention'} masks"
            )
        if decoder_position_ids is None:
            raise ValueError("DiffusionGemmaCanvas needs decoder_position_ids (the canvas tokens' positions)")
        if self.training and do_self_conditioning is None and self_conditioning_logits is None:
            raise ValueError("do_self_conditioning must be given in training (a [B] bool tensor)")
        attention = None if encoder_padding_mask is None else (~encoder_padding_mask.bool()).long()
        encoded = self.model.encoder(
            input_ids=input_ids, attention_mask=attention, position_ids=encoder_position_ids, cache=DynamicCache()
        )
        encoder_logits = self.canvas_logits(encoded.last_hidden_state) if self.training else None

        def decode(soft: Tensor | None):
            return self.decode_canvas(encoded.cache, canvas_ids, decoder_position_ids, soft, decoder_attention_mask)

        soft = None
        if self_conditioning_logits is not None:
            soft = self.soft_embedding(self_conditioning_logits)
        elif self.training:
            with torch.no_grad():
                first = decode(None)
            soft = self.soft_embedding(first)
            soft = soft * do_self_conditioning.to(soft.dtype)[:, None, None]
        logits = decode(soft)
        # under FSDP2 this model is one unit, whose backward starts from the tensors its forward returns; a
        # deferred head returns projections, so the states they project are returned too (`head_inputs`)
        projected = tuple(x.hidden for x in (logits, encoder_logits) if isinstance(x, HeadProjection))
        return DLLMOutput(logits=logits, encoder_logits=encoder_logits, head_inputs=projected)

    def decode_canvas(self, cache, canvas_ids: Tensor, positions: Tensor, soft: Tensor | None, masks=None):
        """Logits of `canvas_ids` at `positions` over the encoder's `cache` (read only), with the soft
        embedding `soft` (None: none, DiffusionGemma's first step), under `masks` (None: all visible)."""
        with _soft_input(self.model.decoder.self_conditioning, soft):
            out = self.model.decoder(
                decoder_input_ids=canvas_ids,
                cache=cache,
                decoder_attention_mask=masks,
                decoder_position_ids=positions,
            )
        return self.canvas_logits(out.last_hidden_state)

    def canvas_logits(self, hidden: Tensor) -> Tensor | HeadProjection:
        """DiffusionGemma's soft-capped logits in fp32 (a capped `HeadProjection` under the fused head)."""
        logits = self.lm_head(hidden)
        if isinstance(logits, HeadProjection):
            return logits
        return softcap_logits(logits, self.final_logit_softcapping)

    def soft_embedding(self, logits: Tensor | HeadProjection) -> Tensor:
        """softmax(logits)·E·√H, as DiffusionGemma's decoder forms it from self-conditioning logits."""
        embed = self.model.decoder.embed_tokens
        if isinstance(logits, HeadProjection):  # deferred logits (docs/strategies.md §5.9): chunk by chunk
            soft = logits.softmax_matmul(embed.weight)
        else:
            soft = torch.softmax(logits.detach().float(), dim=-1).to(embed.weight.dtype) @ embed.weight
        return soft * embed.embed_scale.to(soft.dtype)

    # ------------------------------------------------------------------ sampling with the encoder cache

    def encoder_cache(self) -> GemmaEncoderCache:
        return GemmaEncoderCache(self)

    def decode_cached(self, cache, canvas_ids: Tensor, positions: Tensor, previous: Tensor | None) -> Tensor:
        """One sampler step over `GemmaEncoderCache.extend`'s cache: the canvas sees all of it (its
        sliding layers the window the cache keeps), as transformers' DiffusionGemma generation has it."""
        soft = None if previous is None else self.soft_embedding(previous)
        return self.decode_canvas(cache, canvas_ids, positions, soft)


class OneExpert(DiffusionGemmaTextExperts):
    """DiffusionGemma's experts when there is one (`num_experts` = `top_k_experts` = 1, a tiny config's default):
    the router sends every token to expert 0 with its weight, so the expert's MLP runs on every row as two plain
    matmuls, without the sort, gathers and grouped matmul of the dispatch (transformers' `grouped_mm` path).
    The same parameters and values (tests/unit/test_block_diffusion_gemma.py compares the two element-wise);
    the router still runs, so its parameters get the same (zero) gradients. Under bf16 autocast the two matmuls
    run in bf16, as the layer's dense MLP does (the grouped matmul is not autocast and runs in the weights' fp32)."""

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        gate, up = F.linear(hidden_states, self.gate_up_proj[0]).chunk(2, dim=-1)
        out = F.linear(self.act_fn(gate) * up, self.down_proj[0])
        return (out * top_k_weights).to(hidden_states.dtype)  # [N, H] · [N, 1], the router's fp32 weight


@contextmanager
def _soft_input(block, soft: Tensor | None):
    """While decoding, DiffusionGemma's self-conditioning block (`block(embeds, soft)`) reads `soft` in place of
    the zeros the decoder passes when given no logits."""
    if soft is None:
        yield
        return
    handle = block.register_forward_pre_hook(lambda _module, args: (args[0], soft.to(args[0].dtype)))
    try:
        yield
    finally:
        handle.remove()


class GemmaEncoderCache:
    """The context's encoder K/V for sampling (docs/decoding.md): DiffusionGemma's own cache, as its generation
    keeps it (`DynamicCache(config)`: sliding layers hold their window), extended by each finished block."""

    def __init__(self, model: DiffusionGemmaCanvas):
        self.model, self.cache, self.ids = model, None, None

    def extend(self, context: Tensor):
        """The cache after encoding `context` [1, P], forwarding only the tokens not encoded yet."""
        n = context.shape[1]
        start = 0 if self.ids is None else self.ids.shape[1]
        if start and (start > n or not torch.equal(self.ids, context[:, :start])):
            start, self.cache = 0, None  # a different context: encode from scratch
        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config.get_text_config())
        if start < n:
            positions = torch.arange(start, n, device=context.device)[None]
            self.model.model.encoder(input_ids=context[:, start:], position_ids=positions, cache=self.cache)
            self.ids = context.clone()
        return self.cache
