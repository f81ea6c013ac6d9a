"""Self-correcting discrete diffusion (SCDD): the mask+uniform schedule and its discrete-time NELBO
(docs/strategies.md §5.8). Pure math; the strategy that drives it lives with the other strategies.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from strategies.losses import DLLMLossOutput

_TINY = 1e-30


class SCDDSchedule(NamedTuple):
    clean_mass: Tensor
    uniform_mass: Tensor
    absorbed_mass: Tensor
    gamma: Tensor  # P(not [MASK])
    rho: Tensor  # P(retained | not masked)


def scdd_schedule(t: Tensor, *, max_ratio: float, gamma_shape: float, t_peak: float) -> SCDDSchedule:
    """Beta-shaped uniform bump c(t) = scale·t^a(1−t)^b, a = g·τ, b = g·(1−τ), scaled so uniform(τ) = r.

    clean = (1−t)/(1+c), uniform = c/(1+c), absorbed = 1 − clean − uniform, gamma = clean + uniform,
    rho = clean / max(gamma, 1e-30).
    """
    if not 0 <= max_ratio < 1:
        raise ValueError(f"scdd_schedule requires 0 <= max_ratio < 1 (got {max_ratio})")
    if not 0 < t_peak < 1:
        raise ValueError(f"scdd_schedule requires 0 < t_peak < 1 (got {t_peak})")
    t = t.clamp(0, 1)
    a, b = gamma_shape * t_peak, gamma_shape * (1 - t_peak)
    peak = t_peak**a * (1 - t_peak) ** b
    c = (max_ratio / (1 - max_ratio)) / peak * t.pow(a) * (1 - t).pow(b)
    clean = (1 - t) / (1 + c)
    uniform = c / (1 + c)
    absorbed = 1 - clean - uniform
    gamma = clean + uniform
    return SCDDSchedule(clean, uniform, absorbed, gamma, clean / gamma.clamp_min(_TINY))


def _validate_chunk(chunk_size) -> int | None:
    if chunk_size is None:
        return None
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_len must be a positive int or None (got {chunk_size!r})")
    return chunk_size


def _vocab_terms(logits: Tensor, x0: Tensor, zt: Tensor, log_beta_s: Tensor, log_rho_s: Tensor, mask_id: int):
    """The vocabulary-sized part for a chunk of positions → (Σ_v τ(v), τ(x0), τ(z), log p_θ(z)), each [N]."""
    masked = logits.float().clone()
    masked[:, mask_id] = -math.inf  # the model distribution lives on the non-mask domain
    logp = torch.log_softmax(masked, dim=-1).clamp_min(math.log(_TINY))
    tau = torch.logaddexp(log_beta_s[:, None], log_rho_s[:, None] + logp)
    sigma = tau.sum(dim=1) - tau[:, mask_id]
    pick = lambda idx: tau.gather(1, idx[:, None]).squeeze(1)  # noqa: E731
    return sigma, pick(x0), pick(zt), logp.gather(1, zt[:, None]).squeeze(1)


class _RowCoefficients(NamedTuple):
    """Float64 schedule terms at (t, s = t − 1/T): one per row, or repeated over each row's positions."""

    beta_s: Tensor  # (1 − ρ_s)/K
    rho_s: Tensor  # ρ_s as scheduled (the ratios below divide by it clamped at 1e-30)
    beta_t: Tensor  # (1 − ρ_t)/K
    rho_t: Tensor
    uniform: Tensor  # (ρ_s − ρ_t)/ρ_s
    clean: Tensor  # ρ_t/ρ_s
    kappa: Tensor  # (γ_s − γ_t)/max(1 − γ_t, 1e-30)


class _VocabTerms(NamedTuple):
    """The vocabulary-sized sums per position, float64: Σ_v τ(v), τ(x0), τ(z), log p_θ(z)."""

    sigma: Tensor
    tau_x: Tensor
    tau_z: Tensor
    logp_z: Tensor


class SCDDLoss(nn.Module):
    """Discrete-time SCDD NELBO (docs/strategies.md §5.8). The p_mask slot carries the diffusion time t per row.

    Absorbed (z = M):   J = −κ·(β_s·Σ + ρ_s·τ_x)
    Visible  (z ≠ M):   J = −[β_s c_u (Σ − KΛ) + ρ_s c_u (τ_x − Λ) + β_s c_c (τ_z − Λ) + ρ_s c_c δ (τ_x − Λ)]
                            / max(β_t + ρ_t δ, 1e-30)
    per_token = T·J;  L = Σ ℓ·per_token / max(D, 1), D = num_diffusion_tokens or local Σℓ.
    Only the [chunk, V] log terms are built per chunk, each under a non-reentrant checkpoint.
    """

    def __init__(
        self,
        mask_token_id: int,
        num_timesteps: int = 1000,
        max_ratio: float = 0.1,
        gamma_shape: float = 1.0,
        t_peak: float = 0.5,
        chunk_size: int | None = 1024,
    ):
        super().__init__()
        if num_timesteps < 2:
            raise ValueError(f"SCDDLoss requires num_timesteps >= 2 (got {num_timesteps})")
        self.mask_token_id = int(mask_token_id)
        self.num_timesteps, self.max_ratio, self.gamma_shape, self.t_peak = (
            num_timesteps,
            max_ratio,
            gamma_shape,
            t_peak,
        )
        self.chunk_size = _validate_chunk(chunk_size)

    def _schedule(self, t: Tensor) -> SCDDSchedule:
        return scdd_schedule(t, max_ratio=self.max_ratio, gamma_shape=self.gamma_shape, t_peak=self.t_peak)

    def forward(
        self,
        logits: Tensor,
        target_ids: Tensor,
        noise_mask: Tensor | None,
        p_mask: Tensor,
        loss_mask: Tensor,
        *,
        loss_mask_ar: Tensor | None = None,
        num_diffusion_tokens: int | Tensor | None = None,
        num_ar_tokens: int | Tensor | None = None,
        causal_logits: Tensor | None = None,
        noisy_input_ids: Tensor | None = None,
    ) -> DLLMLossOutput:
        if noisy_input_ids is None:
            raise ValueError("SCDDLoss needs noisy_input_ids (the corrupted z_t) to score visible tokens")
        batch, length, vocab = logits.shape
        k = vocab - 1
        coef = self._row_coefficients(p_mask, k)
        row = lambda v: v[:, None].expand(batch, length).reshape(-1)  # noqa: E731  per-row → per-position

        x0, zt = target_ids.reshape(-1), noisy_input_ids.reshape(-1)
        log_bs, log_rs = row(coef.beta_s.clamp_min(_TINY).log()).float(), row(coef.rho_s.clamp_min(_TINY).log()).float()
        terms = self._chunked_vocab_terms(logits.reshape(-1, vocab), x0, zt, log_bs, log_rs)

        per_position = _RowCoefficients(*(row(v) for v in coef))
        per_token = self.num_timesteps * self._integrand(per_position, terms, x0, zt, k)
        sup = loss_mask.reshape(-1).double()
        denom = num_diffusion_tokens if num_diffusion_tokens is not None else int(sup.sum())
        total = ((per_token * sup).sum() / max(int(denom), 1)).to(logits.dtype)
        return DLLMLossOutput(total, total.detach())

    def _row_coefficients(self, p_mask: Tensor, k: int) -> _RowCoefficients:
        """The schedule terms of each row at t (its p_mask) and s = t − 1/T."""
        t = p_mask[:, 0].double().clamp(0, 1)  # per-row coefficients in float64: κ ∝ (t − s) is a small difference
        s = (t - 1.0 / self.num_timesteps).clamp_min(0)
        at_t, at_s = self._schedule(t), self._schedule(s)
        rho_s, rho_t = at_s.rho.clamp_min(_TINY), at_t.rho
        ct, ut = rho_t / rho_s, (at_s.rho - rho_t) / rho_s
        kappa = (at_s.gamma - at_t.gamma) / (1 - at_t.gamma).clamp_min(_TINY)
        beta_s, beta_t = (1 - at_s.rho) / k, (1 - rho_t) / k
        return _RowCoefficients(beta_s, at_s.rho, beta_t, rho_t, ut, ct, kappa)

    def _chunked_vocab_terms(
        self, flat_logits: Tensor, x0: Tensor, zt: Tensor, log_bs: Tensor, log_rs: Tensor
    ) -> _VocabTerms:
        """`_vocab_terms` over chunks of `chunk_size` positions, each under a non-reentrant checkpoint."""
        step = self.chunk_size or flat_logits.shape[0]
        parts = [
            checkpoint(
                _vocab_terms,
                flat_logits[i : i + step],
                x0[i : i + step],
                zt[i : i + step],
                log_bs[i : i + step],
                log_rs[i : i + step],
                self.mask_token_id,
                use_reentrant=False,
            )
            for i in range(0, flat_logits.shape[0], step)
        ]
        return _VocabTerms(*(torch.cat(p).double() for p in zip(*parts)))

    def _integrand(self, c: _RowCoefficients, terms: _VocabTerms, x0: Tensor, zt: Tensor, k: int) -> Tensor:
        """J per position (the class docstring) from per-position coefficients: J_abs where z = M, else J_vis."""
        b_s, r_s, b_t, r_t = c.beta_s, c.rho_s, c.beta_t, c.rho_t
        c_u, c_c, kap = c.uniform / k, c.clean, c.kappa
        sigma, tau_x, tau_z, logp_z = terms
        lam = torch.logaddexp(b_t.clamp_min(_TINY).log(), r_t.clamp_min(_TINY).log() + logp_z)
        delta = (zt == x0).float()
        j_abs = -kap * (b_s * sigma + r_s * tau_x)
        s_vis = (
            b_s * c_u * (sigma - k * lam)
            + r_s * c_u * (tau_x - lam)
            + b_s * c_c * (tau_z - lam)
            + r_s * c_c * delta * (tau_x - lam)
        )
        j_vis = -s_vis / (b_t + r_t * delta).clamp_min(_TINY)
        return torch.where(zt == self.mask_token_id, j_abs, j_vis)
