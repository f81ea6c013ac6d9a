"""Corruption kernels q(z | x): pure functions of (ids, loss mask, generator).

All take `[B, L]` ids and a `[B, L]` loss mask, corrupt only supervised positions, and draw
randomness only from the passed `torch.Generator` (never the global RNG when one is given).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor


def check_args(
    caller: str,
    *,
    eps: float | None = None,
    integers: dict[str, tuple[object, int]] | None = None,
    positive: dict[str, object] | None = None,
    levels: dict[str, object] | None = None,
    batch: int | None = None,
) -> None:
    """The scalar and per-row argument checks of the kernels (one error naming the caller, the argument, its
    value and the valid range), run before any computation: 0 ≤ eps < 1; `integers` {name: (value, minimum)}
    are integers ≥ minimum; `positive` {name: value} are finite reals > 0; `levels` {name: value} are
    probabilities in [0, 1], each a scalar or a 1-D tensor of one level per row ([batch], or [1] for all rows).
    Levels hold one value per row, so checking their range costs nothing next to the kernel."""
    if eps is not None and not 0 <= eps < 1:
        raise ValueError(f"{caller}: eps (the minimum noise level) must be in [0, 1), got {eps!r}")
    for name, (value, minimum) in (integers or {}).items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ValueError(f"{caller}: {name} must be an integer >= {minimum}, got {value!r}")
    for name, value in (positive or {}).items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < math.inf:
            raise ValueError(f"{caller}: {name} must be a finite number > 0, got {value!r}")
    for name, value in (levels or {}).items():
        rows = f"[batch] = ({batch},)" if batch is not None else "[batch]"
        if isinstance(value, Tensor):
            if value.dim() > 1 or (value.dim() == 1 and value.shape[0] not in (1, batch)):
                raise ValueError(
                    f"{caller}: {name} must be a scalar or a tensor of shape {rows} (one level per row of "
                    f"input_ids) or [1], got shape {tuple(value.shape)}"
                )
            if value.numel() == 0:
                continue
            lo, hi = float(value.min()), float(value.max())
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            lo = hi = float(value)
        else:
            raise ValueError(
                f"{caller}: {name} must be a scalar or a tensor of shape {rows}, got {type(value).__name__}"
            )
        if not (0 <= lo and hi <= 1):  # also refuses NaN
            got = f"{lo:g}" if lo == hi else f"values from {lo:g} to {hi:g}"
            raise ValueError(f"{caller}: {name} must be a probability in [0, 1], got {got}")


def as_rows(level: Tensor | float, like: Tensor) -> Tensor:
    """A level checked by `check_args` (a scalar, [1] or [B]) as a 1-D tensor on `like`'s device, ready for
    `level[:, None]`."""
    if isinstance(level, Tensor):
        return level.reshape(-1)
    return torch.tensor([float(level)], dtype=torch.float32, device=like.device)


def check_rows(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: object = None,
    *,
    eps: float | None = None,
    vocab_size: int | None = None,
    min_vocab: int = 1,
    levels: dict[str, object] | None = None,
    integers: dict[str, tuple[object, int]] | None = None,
    positive: dict[str, object] | None = None,
    caller: str = "corruption",
) -> None:
    """The argument checks every kernel shares (one error naming the argument): integer `[B, L]` ids, a loss
    mask of the same shape, an integer [MASK] id inside the vocabulary (an integer ≥ `min_vocab`), then the
    scalar and per-row checks of `check_args` (eps, integer sizes, positive ratios, levels against B). Shapes,
    dtypes and per-row levels only: no pass over the [B, L] values, so the checks cost nothing next to the kernel."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        what = (
            f"{input_ids.dtype} of shape {tuple(input_ids.shape)}" if isinstance(input_ids, Tensor) else type(input_ids)
        )
        raise ValueError(f"{caller}: input_ids must be an integer tensor [batch, length], got {what}")
    if not isinstance(loss_mask, Tensor) or loss_mask.shape != input_ids.shape:
        shape = tuple(loss_mask.shape) if isinstance(loss_mask, Tensor) else type(loss_mask).__name__
        raise ValueError(f"{caller}: loss_mask must have input_ids' shape {tuple(input_ids.shape)}, got {shape}")
    if vocab_size is not None:
        integers = {"vocab_size": (vocab_size, min_vocab), **(integers or {})}
    check_args(caller, integers=integers)
    if mask_token_id is not None:
        if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, numbers.Integral) or mask_token_id < 0:
            raise ValueError(f"{caller}: mask_token_id must be a non-negative integer, got {mask_token_id!r}")
        if vocab_size is not None and mask_token_id >= vocab_size:
            raise ValueError(
                f"{caller}: mask_token_id {mask_token_id} is outside the vocabulary of {vocab_size} tokens"
            )
    check_args(caller, eps=eps, positive=positive, levels=levels, batch=input_ids.shape[0])


def corrupt_uniform(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    *,
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """MDLM/LLaDA absorbing kernel (docs/strategies.md §4.2).

    Per row: t ~ U[0,1), p = (1−eps)·t + eps; per position u ~ U[0,1), n = (u < p) ∧ ℓ;
    z = where(n, M, x). Draw order: t (B values) then u (B·L).

    Returns (noisy_ids [B,L], noise_mask [B,L] bool, p_mask [B,L] float32, p constant per row).
    """
    check_rows(input_ids, loss_mask, mask_token_id, eps=eps, caller="corrupt_uniform")
    batch, length = input_ids.shape
    t = torch.rand(batch, generator=generator, device=input_ids.device)
    p = (1.0 - eps) * t + eps
    u = torch.rand(batch, length, generator=generator, device=input_ids.device)
    noise_mask = (u < p[:, None]) & loss_mask.bool()
    noisy = torch.where(noise_mask, torch.full_like(input_ids, mask_token_id), input_ids)
    p_mask = p[:, None].expand(batch, length).to(torch.float32).contiguous()
    return noisy, noise_mask, p_mask


def mask_at_level(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    p: Tensor | float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Absorbing corruption at given per-row levels p [B] in [0, 1] (or one level for all rows: a scalar or
    [1]); used by the fixed-noise NELBO."""
    check_rows(input_ids, loss_mask, mask_token_id, levels={"p": p}, caller="mask_at_level")
    p = as_rows(p, input_ids)
    u = torch.rand(input_ids.shape, generator=generator, device=input_ids.device)
    noise_mask = (u < p[:, None]) & loss_mask.bool()
    return torch.where(noise_mask, torch.full_like(input_ids, mask_token_id), input_ids), noise_mask


# ---------------------------------------------------------------- exact-k kernels (docs/strategies.md §4.1, §4.3)


def gumbel_topk_rows(log_w: Tensor, k: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Sample k_i items per row without replacement, P ∝ exp(log_w) (Plackett–Luce via Gumbel top-k).

    log_w [N, D] (−inf = never chosen), k [N] → bool [N, D] with exactly min(k_i, #finite) Trues.
    g = −log(−log(U + 1e-9) + 1e-9); the k_i largest of log_w + g are chosen.
    """
    u = torch.rand(log_w.shape, generator=generator, device=log_w.device)
    scores = log_w + -torch.log(-torch.log(u + 1e-9) + 1e-9)
    order = scores.argsort(dim=1, descending=True)
    ranks = torch.arange(log_w.shape[1], device=log_w.device)[None, :]
    chosen_sorted = ranks < k[:, None]
    chosen = torch.zeros_like(chosen_sorted).scatter(1, order, chosen_sorted)
    return chosen & torch.isfinite(log_w)


def corrupt_blockwise(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    *,
    block_size: int | None = None,
    eps: float = 1e-3,
    half_life_ratio: float = 0.25,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Exact-k masking with a bias toward later positions (hybrid strategy, docs/strategies.md §4.3).

    Sequence path (block_size None): per row m ~ eps + (1−eps)·U, k = clamp(round(m·L), 1, L),
    log w_i = λ(1−m)·i with λ = ln 2 / (half_life_ratio·L); p_mask = m.
    Block path: per block m_j, k_j = clamp(round(m_j·len_j), 0, len_j), λ = ln 2/(half_life_ratio·bs),
    positions past a short last block get −inf; p_mask = the block's m_j.
    Positions are chosen among all slots, then unsupervised picks are dropped (so realized k ≤ k).
    Draw order: all m's, then the Gumbel uniforms.
    """
    check_rows(
        input_ids,
        loss_mask,
        mask_token_id,
        eps=eps,
        integers={} if block_size is None else {"block_size": (block_size, 1)},
        positive={"half_life_ratio": half_life_ratio},
        caller="corrupt_blockwise",
    )
    batch, length = input_ids.shape
    device = input_ids.device
    if block_size is None:
        m = eps + (1 - eps) * torch.rand(batch, generator=generator, device=device)
        k = (m * length).round().clamp(1, length).long()
        lam = math.log(2) / (half_life_ratio * length)
        log_w = lam * (1 - m)[:, None] * torch.arange(length, device=device)[None, :]
        chosen = gumbel_topk_rows(log_w, k, generator)
        p = m[:, None].expand(batch, length)
    else:
        n_blocks = math.ceil(length / block_size)
        m = eps + (1 - eps) * torch.rand(batch * n_blocks, generator=generator, device=device)
        starts = torch.arange(n_blocks, device=device) * block_size
        lens = (length - starts).clamp(max=block_size).repeat(batch)
        k = (m * lens).round().clamp(min=0).minimum(lens).long()
        lam = math.log(2) / (half_life_ratio * block_size)
        local = torch.arange(block_size, device=device)[None, :]
        log_w = lam * (1 - m)[:, None] * local
        log_w = log_w.masked_fill(local >= lens[:, None], -math.inf)
        chosen = gumbel_topk_rows(log_w, k, generator).view(batch, n_blocks * block_size)[:, :length]
        p = m.view(batch, n_blocks).repeat_interleave(block_size, dim=1)[:, :length]
    noise_mask = chosen & loss_mask.bool()
    noisy = torch.where(noise_mask, torch.full_like(input_ids, mask_token_id), input_ids)
    return noisy, noise_mask, p.to(torch.float32).contiguous()


# ---------------------------------------------------------------- uniform-replacement kernels (§4.4–4.6)


def corrupt_uniform_random(
    input_ids: Tensor,
    loss_mask: Tensor,
    vocab_size: int,
    *,
    block_size: int | None = None,
    eps: float = 1e-3,
    generator: torch.Generator | None = None,
    return_level: bool = False,
) -> tuple[Tensor, Tensor, Tensor] | tuple[Tensor, Tensor, Tensor, Tensor]:
    """D3PM-uniform kernel (DiffusionGemma, docs/strategies.md §4.4): replace with uniform random tokens, no [MASK].

    One level t ~ eps + (1−eps)·U per row (or per block of `block_size`); n = (u < t) ∧ ℓ;
    replacement r ~ Uniform{0..V−1} (may equal the clean token). p_mask is all ones (flat loss).
    Draw order: t, u (B·L), r (B·L); the draws after t are `replace_at_level`'s.

    Returns (noisy_ids [B,L], noise_mask [B,L] bool, p_mask [B,L] float32 ones); with `return_level` also the
    levels t it drew, `[B]` (or `[B, n_blocks]` with `block_size`), for a loss that is weighted by t or
    conditioned on it: the same values, from the same draws, as without it.
    """
    check_rows(
        input_ids,
        loss_mask,
        eps=eps,
        vocab_size=vocab_size,
        integers={} if block_size is None else {"block_size": (block_size, 1)},
        caller="corrupt_uniform_random",
    )
    batch, length = input_ids.shape
    device = input_ids.device
    if block_size is None:
        level = eps + (1 - eps) * torch.rand(batch, generator=generator, device=device)
        t = level[:, None].expand(batch, length)
    else:
        n_blocks = math.ceil(length / block_size)
        level = eps + (1 - eps) * torch.rand(batch, n_blocks, generator=generator, device=device)
        t = level.repeat_interleave(block_size, dim=1)[:, :length]
    noisy, noise_mask = _replace_where_below(input_ids, loss_mask, vocab_size, t, generator)
    p_mask = torch.ones(batch, length, dtype=torch.float32, device=device)
    return (noisy, noise_mask, p_mask, level) if return_level else (noisy, noise_mask, p_mask)


def replace_at_level(
    input_ids: Tensor,
    loss_mask: Tensor,
    vocab_size: int,
    t: Tensor | float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Uniform-replacement corruption at given per-row levels t [B] in [0, 1] (or one level for all rows: a
    scalar or [1]): the uniform counterpart of `mask_at_level`, used by the fixed-noise bound of the uniform
    process. n = (u < t) ∧ ℓ, z = where(n, r, x) with r ~ Uniform{0..V−1}; draw order u (B·L), r (B·L), as
    in `corrupt_uniform_random` after its levels. Returns (noisy_ids [B,L], noise_mask [B,L] bool)."""
    check_rows(input_ids, loss_mask, vocab_size=vocab_size, levels={"t": t}, caller="replace_at_level")
    return _replace_where_below(input_ids, loss_mask, vocab_size, as_rows(t, input_ids)[:, None], generator)


def _replace_where_below(
    input_ids: Tensor, loss_mask: Tensor, vocab_size: int, t: Tensor, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """The draws of the uniform kernel after its levels: u (B·L), then r (B·L); `t` broadcasts to [B, L]."""
    batch, length = input_ids.shape
    device = input_ids.device
    u = torch.rand(batch, length, generator=generator, device=device)
    r = torch.randint(0, vocab_size, (batch, length), generator=generator, device=device, dtype=input_ids.dtype)
    noise_mask = (u < t) & loss_mask.bool()
    return torch.where(noise_mask, r, input_ids), noise_mask


def corrupt_all_masked(
    input_ids: Tensor, loss_mask: Tensor, mask_token_id: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """I-DLM kernel (docs/strategies.md §4.5): every supervised token becomes [MASK]; deterministic; p_mask = 1."""
    check_rows(input_ids, loss_mask, mask_token_id, caller="corrupt_all_masked")
    noise_mask = loss_mask.bool()
    noisy = torch.where(noise_mask, torch.full_like(input_ids, mask_token_id), input_ids)
    return noisy, noise_mask, torch.ones(input_ids.shape, dtype=torch.float32, device=input_ids.device)


def corrupt_mix(
    input_ids: Tensor,
    loss_mask: Tensor,
    mask_token_id: int,
    vocab_size: int,
    *,
    mask_prob: Tensor | float,
    uniform_prob: Tensor | float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """SCDD forward kernel (docs/strategies.md §4.6): absorb to [MASK] or move to a *different* non-mask token.

    One u ~ U[0,1) per position: absorbed = u < mask_prob ∧ ℓ; transitioned =
    mask_prob ≤ u < mask_prob + uniform_prob ∧ ℓ ∧ x ≠ M. The replacement is uniform over the V−2
    tokens that are neither [MASK] nor the clean token: d ~ U{0..V−3}, shifted past min(x,M) then
    max(x,M). Returns (z, n) with n == (z ≠ x). mask_prob and uniform_prob are per-row probabilities
    ([B], or a scalar / [1] for all rows) with mask_prob + uniform_prob ≤ 1. Draw order: u (B·L) then d (B·L).
    """
    check_rows(
        input_ids,
        loss_mask,
        mask_token_id,
        vocab_size=vocab_size,
        min_vocab=3,
        levels={"mask_prob": mask_prob, "uniform_prob": uniform_prob},
        caller="corrupt_mix",
    )
    mask_prob, uniform_prob = as_rows(mask_prob, input_ids), as_rows(uniform_prob, input_ids)
    total = (mask_prob + uniform_prob).max()
    if total > 1 + 1e-5:
        raise ValueError(f"corrupt_mix requires mask_prob + uniform_prob <= 1 (got up to {float(total):.6f})")
    device = input_ids.device
    u = torch.rand(input_ids.shape, generator=generator, device=device)
    d = torch.randint(0, vocab_size - 2, input_ids.shape, generator=generator, device=device, dtype=input_ids.dtype)
    sup = loss_mask.bool()
    mp, up = mask_prob[:, None], uniform_prob[:, None]
    absorbed = (u < mp) & sup
    transitioned = (u >= mp) & (u < mp + up) & sup & (input_ids != mask_token_id)
    lo = torch.minimum(input_ids, torch.full_like(input_ids, mask_token_id))
    hi = torch.maximum(input_ids, torch.full_like(input_ids, mask_token_id))
    d = d + (d >= lo).to(d.dtype)
    d = (d + (d >= hi).to(d.dtype)).clamp(max=vocab_size - 1)
    noisy = torch.where(absorbed, torch.full_like(input_ids, mask_token_id), torch.where(transitioned, d, input_ids))
    return noisy, absorbed | transitioned


def gumbel_topk(log_w: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """1-D form of `gumbel_topk_rows`: exactly k Trues over `log_w [D]`."""
    return gumbel_topk_rows(log_w[None, :], torch.tensor([k], device=log_w.device), generator)[0]
