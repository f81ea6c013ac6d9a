"""Corruption kernels q(z | x): pure functions of (ids, loss mask, generator).

All take `[B, L]` ids and a `[B, L]` loss mask, corrupt only supervised positions, and draw
randomness only from the passed `torch.Generator` (never the global RNG when one is given).
"""
from __future__ import annotations

import torch
from torch import Tensor


def corrupt_uniform(input_ids: Tensor, loss_mask: Tensor, mask_token_id: int, *, eps: float = 1e-3,
                    generator: torch.Generator | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """MDLM/LLaDA absorbing kernel (spec §4.2).

    Per row: t ~ U[0,1), p = (1−eps)·t + eps; per position u ~ U[0,1), n = (u < p) ∧ ℓ;
    z = where(n, M, x). Draw order: t (B values) then u (B·L).

    Returns (noisy_ids [B,L], noise_mask [B,L] bool, p_mask [B,L] float32, p constant per row).
    """
    batch, length = input_ids.shape
    t = torch.rand(batch, generator=generator, device=input_ids.device)
    p = (1.0 - eps) * t + eps
    u = torch.rand(batch, length, generator=generator, device=input_ids.device)
    noise_mask = (u < p[:, None]) & loss_mask.bool()
    noisy = torch.where(noise_mask, torch.full_like(input_ids, mask_token_id), input_ids)
    p_mask = p[:, None].expand(batch, length).to(torch.float32).contiguous()
    return noisy, noise_mask, p_mask


def mask_at_level(input_ids: Tensor, loss_mask: Tensor, mask_token_id: int, p: Tensor,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Absorbing corruption at given per-row levels p [B] (used by the fixed-noise NELBO)."""
    u = torch.rand(input_ids.shape, generator=generator, device=input_ids.device)
    noise_mask = (u < p[:, None]) & loss_mask.bool()
    return torch.where(noise_mask, torch.full_like(input_ids, mask_token_id), input_ids), noise_mask
