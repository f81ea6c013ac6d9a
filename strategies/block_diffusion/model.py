"""Block diffusion's model shape (docs/strategies.md §9.5): an encoder pass over the clean sequence and a canvas
decoder pass over its K/V, on one shared causal stack, with self-conditioning."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from strategies.block_diffusion.options import BLOCK_DIFFUSION
from strategies.head import HeadProjection
from strategies.models import DLLMOutput


class BlockDiffusionLM(nn.Module):
    """DiffusionGemma-shaped block-diffusion model on one shared causal stack (docs/strategies.md §9.5).

    1. Encode: the stack runs causally over the clean sequence; each layer's (K, V) is kept and the
       final hidden states give `encoder_logits` (next-token AR head, training only).
    2. Self-conditioning (training, two-pass): pass 1 decodes under no_grad with no self-conditioning;
       pass 2 adds `self_cond(softmax(pass-1 logits) @ E)` to the canvas embeddings, per example
       gated by `do_self_conditioning`. Pass 1 always runs. Eval: one pass, zero soft embedding.
    3. Decode: every layer attends over `concat(encoder K/V of that layer, canvas K/V)` under the
       block-causal mask of docs/strategies.md §6.3 (`decoder_attention_mask`, keep-mask or additive).
    The lm_head is shared by both passes (tied to the embedding when the config ties them).
    """

    def __init__(self, lm: nn.Module, mask_token_id: int | None = None):
        """`mask_token_id` is not used: the canvas is noised with uniform random tokens."""
        super().__init__()
        self.lm = lm
        self.config = lm.config
        self.config.dllm_architecture = BLOCK_DIFFUSION
        hidden = lm.config.hidden_size
        self.self_cond = nn.Linear(hidden, hidden, bias=False)
        nn.init.zeros_(self.self_cond.weight)  # starts as "no self-conditioning"

    @property
    def backbone(self) -> nn.Module:
        return self.lm.model

    def encode(self, input_ids: Tensor, position_ids: Tensor | None, padding_mask: Tensor | None):
        attn = None if padding_mask is None else (~padding_mask.bool()).long()
        out = self.backbone(input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=True)
        kv = [(layer.keys, layer.values) for layer in out.cache.layers]
        return out.last_hidden_state, kv

    def decode(self, kv, canvas_ids: Tensor, mask: Tensor, position_ids: Tensor, soft: Tensor | None) -> Tensor:

        cache = DynamicCache(config=self.config)
        for layer_idx, (k, v) in enumerate(kv):  # a fresh cache per pass: the canvas K/V never leak between passes
            cache.update(k, v, layer_idx)
        embeds = self.backbone.embed_tokens(canvas_ids)
        if soft is not None:
            embeds = embeds + self.self_cond(soft)
        out = self.backbone(
            inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids, cache=cache, use_cache=True
        )
        return self.lm.lm_head(out.last_hidden_state).float()

    def forward(
        self,
        input_ids: Tensor | None = None,
        canvas_ids: Tensor | None = None,
        decoder_attention_mask: Tensor | dict | None = None,
        encoder_position_ids: Tensor | None = None,
        encoder_padding_mask: Tensor | None = None,
        decoder_position_ids: Tensor | None = None,
        decoder_padding_mask: Tensor | None = None,
        do_self_conditioning: Tensor | None = None,
        self_conditioning_logits: Tensor | None = None,
        **_,
    ) -> DLLMOutput:
        if input_ids is None or canvas_ids is None or decoder_attention_mask is None:
            raise ValueError("BlockDiffusionLM.forward needs input_ids, canvas_ids and decoder_attention_mask")
        if isinstance(decoder_attention_mask, dict):
            decoder_attention_mask = decoder_attention_mask["full_attention"]
        if decoder_position_ids is None:
            if canvas_ids.shape[1] != input_ids.shape[1]:
                raise ValueError("decoder_position_ids is required when the canvas is shorter than the sequence")
            decoder_position_ids = torch.arange(canvas_ids.shape[1], device=canvas_ids.device)[None].expand_as(
                canvas_ids
            )
        if self.training and do_self_conditioning is None and self_conditioning_logits is None:
            raise ValueError("do_self_conditioning must be given in training (a [B] bool tensor)")
        hidden, kv = self.encode(input_ids, encoder_position_ids, encoder_padding_mask)
        encoder_logits = self.lm.lm_head(hidden).float() if self.training else None
        soft = None
        if self_conditioning_logits is not None:
            soft = self._soft_embedding(self_conditioning_logits)
        elif self.training:
            with torch.no_grad():
                first = self.decode(kv, canvas_ids, decoder_attention_mask, decoder_position_ids, None)
            soft = self._soft_embedding(first) * do_self_conditioning.to(first.dtype)[:, None, None]
        logits = self.decode(kv, canvas_ids, decoder_attention_mask, decoder_position_ids, soft)
        return DLLMOutput(logits=logits, encoder_logits=encoder_logits)

    def decode_cached(self, kv, canvas_ids: Tensor, positions: Tensor, previous: Tensor | None) -> Tensor:
        """One sampler step over `EncoderCache.extend`'s K/V: the canvas sees the whole context and itself. (The
        sampler builds that cache, `strategies.block_diffusion.sampling.encoder_cache`: decoding code stays out of
        the model shape, which every training stage's key holds.)"""
        width = kv[0][0].shape[-2] + canvas_ids.shape[1]
        mask = torch.ones(1, 1, canvas_ids.shape[1], width, dtype=torch.bool, device=canvas_ids.device)
        soft = None if previous is None else self._soft_embedding(previous)
        return self.decode(kv, canvas_ids, mask, positions, soft)

    def _soft_embedding(self, logits: Tensor | HeadProjection) -> Tensor:
        weight = self.backbone.embed_tokens.weight
        if isinstance(logits, HeadProjection):  # deferred logits (docs/strategies.md §5.9): chunk by chunk
            return logits.softmax_matmul(weight)
        return torch.softmax(logits.detach().float(), dim=-1).to(weight.dtype) @ weight
