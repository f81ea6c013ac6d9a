"""SCDD's discrete-time NELBO over the mask + uniform schedule (docs/strategies.md §5.8), with a hand-written
backward for its vocabulary-sized terms. The schedule is in `strategies.scdd.schedule`.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor, nn

from strategies.head import HeadProjection, Logits, RowKernel
from strategies.losses import DLLMLossOutput
from strategies.scdd.schedule import TINY, SCDDSchedule, scdd_schedule

if TYPE_CHECKING:  # annotations only (the contract's types, strategies.base)
    from strategies.base import CorruptedBatch, TokenCounts


def _validate_chunk(chunk_size) -> int | None:
    if chunk_size is None:
        return None
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_len must be a positive int or None (got {chunk_size!r})")
    return chunk_size


class _VocabTermsFn(torch.autograd.Function):
    """The vocabulary-sized part of the SCDD NELBO for rows of logits [N, V], with a hand-written backward.

    With p = softmax over the non-[MASK] domain and τ(v) = log(β_s + ρ_s·p(v)) (β_s, ρ_s clamped at 1e-30):
    outputs Σ_{v≠M} τ(v), τ(x0), τ(z), log p(z) — each [N], float32. Forward is one exp and one log per
    logit; backward recomputes p from the saved per-row max and normalizer (nothing [N, V] is kept besides
    the logits themselves) and forms the gradient in closed form:
        ∂τ(v)/∂log p(v) = w_v = ρ_s p(v) / (β_s + ρ_s p(v)),
        G_v = g_Σ·w_v + g_x·w_x·[v = x0] + g_z·w_z·[v = z] + g_lp·[v = z]
        ∂/∂logit_u = G_u − p(u)·Σ_v G_v   (u ≠ M; the [MASK] logit gets no gradient)
    At z = [MASK], log p(z) is reported as log 1e-30 (a constant; the loss never reads it there).
    Both passes walk `chunk` rows at a time, so their fp32 temporaries are [chunk, V]; the gradient is
    written into one [N, V] tensor.
    """

    @staticmethod
    def forward(ctx, logits, x0, zt, log_beta, log_rho, mask_id, chunk):
        beta, rho = log_beta.float().exp(), log_rho.float().exp()
        work = _Scratch(logits, chunk)
        parts = [
            _forward_rows(work.take(rows), logits[rows], x0[rows], zt[rows], beta[rows], rho[rows], mask_id)
            for rows in work.chunks()
        ]
        sigma, tau_x, tau_z, logp_z, row_max, norm = (torch.cat(p) for p in zip(*parts))
        ctx.save_for_backward(logits, x0, zt, beta, rho, row_max, norm)
        ctx.mask_id, ctx.chunk = mask_id, chunk
        return sigma, tau_x, tau_z, logp_z

    @staticmethod
    def backward(ctx, g_sigma, g_x, g_z, g_lp):
        logits, x0, zt, beta, rho, row_max, norm = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        work = _Scratch(logits, ctx.chunk)
        for rows in work.chunks():
            pick = (logits[rows], x0[rows], zt[rows], beta[rows], rho[rows], row_max[rows], norm[rows])
            grads = (g_sigma[rows], g_x[rows], g_z[rows], g_lp[rows])
            _grad_rows(work.take(rows), grad[rows], *pick, grads, ctx.mask_id)
        return grad.to(logits.dtype), None, None, None, None, None, None


class _Scratch:
    """One fp32 [chunk, V] buffer reused by every chunk (fresh vocabulary-sized allocations cost page faults): the
    exponentials of a chunk whose logits must stay as they are (the caller's logits, saved for backward)."""

    def __init__(self, logits: Tensor, chunk: int):
        self.rows, self.chunk = logits.shape[0], chunk
        self.a = torch.empty((min(chunk, self.rows), logits.shape[1]), dtype=torch.float32, device=logits.device)

    def chunks(self):
        return (slice(i, min(i + self.chunk, self.rows)) for i in range(0, self.rows, self.chunk))

    def take(self, rows: slice) -> Tensor:
        return self.a[: rows.stop - rows.start]


def _exp_into(buffer: Tensor, logits: Tensor, row_max: Tensor, mask_id: int) -> Tensor:
    """exp(logit − row max) written into `buffer` (which may be `logits` itself), 0 at the [MASK] column."""
    exp = torch.sub(logits, row_max[:, None], out=buffer).exp_()
    exp[:, mask_id] = 0
    return exp


def _forward_rows(buffer: Tensor, logits, x0, zt, beta, rho, mask_id):
    """The terms of `_VocabTermsFn` for a chunk of rows; its one vocabulary-sized temporary is `buffer` (the
    logits themselves where they may be overwritten: the fused head's chunk)."""
    row_max = _row_max_without(logits, mask_id)
    logit_z = logits.gather(1, zt[:, None])[:, 0].float()  # read before `buffer` may overwrite the logits
    exp = _exp_into(buffer, logits, row_max, mask_id)
    norm = exp.sum(dim=1)
    tau = torch.addcmul(beta[:, None], exp, (rho / norm)[:, None], out=exp).log_()  # log(β + ρ·p), in place
    sigma = tau.sum(dim=1) - tau[:, mask_id]  # the [MASK] column holds log β
    tau_x, tau_z = tau.gather(1, x0[:, None])[:, 0], tau.gather(1, zt[:, None])[:, 0]
    logp_z = logit_z - row_max - norm.log()
    logp_z = torch.where(zt == mask_id, torch.full_like(logp_z, math.log(TINY)), logp_z)
    return sigma, tau_x, tau_z, logp_z, row_max, norm


def _grad_rows(buffer: Tensor, out: Tensor, logits, x0, zt, beta, rho, row_max, norm, grads, mask_id) -> Tensor:
    """∂loss/∂logits for a chunk of rows into `out` (returned): the closed form of `_VocabTermsFn`, with
    w = ρp/(β + ρp) = 1 − β·r, r = 1/(β + ρp), so that G − p·ΣG = g_Σ − g_Σβ·r − p·ΣG off the sparse terms.
    The exponentials go to `buffer` (the logits themselves where they may be overwritten), r to `out`."""
    g_sigma, g_x, g_z, g_lp = grads
    g_lp = torch.where(zt == mask_id, torch.zeros_like(g_lp), g_lp)  # log p(z) is a constant at z = [MASK]
    exp = _exp_into(buffer, logits, row_max, mask_id)
    scale = rho / norm  # ρ·p = scale·exp
    recip = torch.addcmul(beta[:, None], exp, scale[:, None], out=out)
    recip[:, mask_id] = math.inf  # w = 0 there
    recip.reciprocal_()
    r_x, r_z = recip.gather(1, x0[:, None])[:, 0], recip.gather(1, zt[:, None])[:, 0]
    w_x, w_z = 1 - beta * r_x, 1 - beta * r_z
    w_sum = torch.linalg.vecdot(exp, recip) * scale  # Σ ρp·r directly: (V − 1) − β·Σr would cancel
    total = g_sigma * w_sum + g_x * w_x + g_z * w_z + g_lp
    torch.addcmul(g_sigma[:, None], recip, (-g_sigma * beta)[:, None], out=out)  # over r, in place
    out.addcmul_(exp, (total / norm)[:, None], value=-1.0)
    out.scatter_add_(1, x0[:, None], (g_x * w_x)[:, None])
    out.scatter_add_(1, zt[:, None], (g_z * w_z + g_lp)[:, None])
    out[:, mask_id] = 0
    return out


class _SCDDRows(RowKernel):
    """`_VocabTermsFn`'s forward and closed-form gradient as a `RowKernel` for the fused head. The chunk's logits
    are built for the kernel alone and dropped after it (`strategies.head.FusedHeadRows`), so both passes work in
    them in place: the forward allocates nothing vocabulary-sized, the backward only the gradient it returns."""

    def __init__(self, mask_id: int):
        self.mask_id = mask_id

    def forward(self, logits, x0, zt, log_beta, log_rho):
        *terms, row_max, norm = _forward_rows(logits, logits, x0, zt, log_beta.exp(), log_rho.exp(), self.mask_id)
        return tuple(terms), (row_max, norm)

    def backward(self, logits, saved, args, grads):
        (row_max, norm), (x0, zt, log_beta, log_rho) = saved, args
        out = torch.empty_like(logits)
        beta, rho = log_beta.exp(), log_rho.exp()
        return _grad_rows(logits, out, logits, x0, zt, beta, rho, row_max, norm, grads, self.mask_id)


def _row_max_without(logits: Tensor, mask_id: int) -> Tensor:
    sides = [part.amax(dim=1) for part in (logits[:, :mask_id], logits[:, mask_id + 1 :]) if part.shape[1]]
    return functools.reduce(torch.maximum, sides).float()


def _vocab_terms(logits: Tensor, x0, zt, log_beta, log_rho, mask_id: int, chunk: int | None = None):
    """(Σ_{v≠M} τ(v), τ(x0), τ(z), log p_θ(z)) for rows of logits, τ(v) = log(β_s + ρ_s·p_θ(v)), `chunk` rows
    at a time (None: all at once); see `_VocabTermsFn`."""
    return _VocabTermsFn.apply(logits, x0, zt, log_beta, log_rho, int(mask_id), chunk or max(logits.shape[0], 1))


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


WEIGHTINGS = ("elbo", "flat")


class SCDDLoss(nn.Module):
    """Discrete-time SCDD NELBO (docs/strategies.md §5.8). `batch.p_mask` carries the diffusion time t per row,
    `batch.noisy_ids` the corrupted z_t, `batch.clean_ids` x0.

    Absorbed (z = M):   J = −κ·(β_s·Σ + ρ_s·τ_x)
    Visible  (z ≠ M):   J = −[β_s c_u (Σ − KΛ) + ρ_s c_u (τ_x − Λ) + β_s c_c (τ_z − Λ) + ρ_s c_c δ (τ_x − Λ)]
                            / max(β_t + ρ_t δ, 1e-30)
    per_token = T·J;  L = Σ ℓ·per_token / max(D, 1), D = `counts.diffusion` or local Σℓ.
    The vocabulary-sized terms come from `_VocabTermsFn` (closed-form backward), `chunk_size` positions at a time.

    `weighting="flat"` multiplies each row's per_token by f(t) = min(1, 1/(T·κ·ρ_s)), the inverse of the weight
    the bound puts on −log p_θ(x0) at a [MASK] (≈ 1/t): a reweighting over time that trains every row at the
    scale of a plain cross-entropy (docs/strategies.md §5.8). At uniform_ratio 0 it is MDLM's flat loss exactly.
    `bound()` is the same loss with the bound's weights, which evaluation always reports.
    """

    def __init__(
        self,
        mask_token_id: int,
        num_timesteps: int = 1000,
        max_ratio: float = 0.1,
        gamma_shape: float = 1.0,
        t_peak: float = 0.5,
        chunk_size: int | None = 1024,
        weighting: str = "elbo",
    ):
        super().__init__()
        if num_timesteps < 2:
            raise ValueError(f"SCDDLoss requires num_timesteps >= 2 (got {num_timesteps})")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"SCDDLoss weighting must be one of {WEIGHTINGS} (got {weighting!r})")
        self.weighting = weighting
        self.mask_token_id = int(mask_token_id)
        self.num_timesteps, self.max_ratio, self.gamma_shape, self.t_peak = (
            num_timesteps,
            max_ratio,
            gamma_shape,
            t_peak,
        )
        self.chunk_size = _validate_chunk(chunk_size)

    def bound(self) -> SCDDLoss:
        """This loss with the bound's own weights (itself when it has them)."""
        if self.weighting == "elbo":
            return self
        return SCDDLoss(
            self.mask_token_id, self.num_timesteps, self.max_ratio, self.gamma_shape, self.t_peak, self.chunk_size
        )

    def _schedule(self, t: Tensor) -> SCDDSchedule:
        return scdd_schedule(t, max_ratio=self.max_ratio, gamma_shape=self.gamma_shape, t_peak=self.t_peak)

    def forward(
        self, logits: Tensor, batch: CorruptedBatch, counts: TokenCounts, *, causal_logits: Tensor | None = None
    ) -> DLLMLossOutput:
        if batch.noisy_ids is None:
            raise ValueError("SCDDLoss needs batch.noisy_ids (the corrupted z_t) to score visible tokens")
        rows, length, vocab = logits.shape
        k = vocab - 1
        coef = self._row_coefficients(batch.p_mask, k)
        row = lambda v: v[:, None].expand(rows, length).reshape(-1)  # noqa: E731  per-row → per-position

        x0, zt = batch.clean_ids.reshape(-1), batch.noisy_ids.reshape(-1)
        log_bs, log_rs = row(coef.beta_s.clamp_min(TINY).log()).float(), row(coef.rho_s.clamp_min(TINY).log()).float()
        terms = self._chunked_vocab_terms(logits.reshape(-1, vocab), x0, zt, log_bs, log_rs)

        per_position = _RowCoefficients(*(row(v) for v in coef))
        per_token = self.num_timesteps * self._integrand(per_position, terms, x0, zt, k)
        if self.weighting == "flat":  # 1 / (the bound's weight on −log p_θ(x0) at a [MASK]), at most 1
            masked_weight = self.num_timesteps * per_position.kappa * per_position.rho_s
            per_token = per_token / masked_weight.clamp_min(1.0)
        sup = batch.loss_mask.reshape(-1).double()
        denom = counts.diffusion if counts.diffusion is not None else int(sup.sum())
        total = ((per_token * sup).sum() / max(int(denom), 1)).to(logits.dtype)
        return DLLMLossOutput(total, total.detach())

    def _row_coefficients(self, p_mask: Tensor, k: int) -> _RowCoefficients:
        """The schedule terms of each row at t (its p_mask) and s = t − 1/T."""
        t = p_mask[:, 0].double().clamp(0, 1)  # per-row coefficients in float64: κ ∝ (t − s) is a small difference
        s = (t - 1.0 / self.num_timesteps).clamp_min(0)
        at_t, at_s = self._schedule(t), self._schedule(s)
        rho_s, rho_t = at_s.rho.clamp_min(TINY), at_t.rho
        ct, ut = rho_t / rho_s, (at_s.rho - rho_t) / rho_s
        kappa = (at_s.gamma - at_t.gamma) / (1 - at_t.gamma).clamp_min(TINY)
        beta_s, beta_t = (1 - at_s.rho) / k, (1 - rho_t) / k
        return _RowCoefficients(beta_s, at_s.rho, beta_t, rho_t, ut, ct, kappa)

    def _chunked_vocab_terms(
        self, flat_logits: Logits, x0: Tensor, zt: Tensor, log_bs: Tensor, log_rs: Tensor
    ) -> _VocabTerms:
        """`_vocab_terms` over chunks of `chunk_size` positions; a `HeadProjection` runs the same kernel fused
        with the head (`strategies.head.FusedHeadRows`), chunked by its own size."""
        if isinstance(flat_logits, HeadProjection):
            terms = flat_logits.rowwise(_SCDDRows(self.mask_token_id), x0, zt, log_bs, log_rs)
        else:
            terms = _vocab_terms(flat_logits, x0, zt, log_bs, log_rs, self.mask_token_id, chunk=self.chunk_size)
        return _VocabTerms(*(p.double() for p in terms))

    def _integrand(self, c: _RowCoefficients, terms: _VocabTerms, x0: Tensor, zt: Tensor, k: int) -> Tensor:
        """J per position (the class docstring) from per-position coefficients: J_abs where z = M, else J_vis."""
        b_s, r_s, b_t, r_t = c.beta_s, c.rho_s, c.beta_t, c.rho_t
        c_u, c_c, kap = c.uniform / k, c.clean, c.kappa
        sigma, tau_x, tau_z, logp_z = terms
        lam = torch.logaddexp(b_t.clamp_min(TINY).log(), r_t.clamp_min(TINY).log() + logp_z)
        delta = (zt == x0).float()
        j_abs = -kap * (b_s * sigma + r_s * tau_x)
        s_vis = (
            b_s * c_u * (sigma - k * lam)
            + r_s * c_u * (tau_x - lam)
            + b_s * c_c * (tau_z - lam)
            + r_s * c_c * delta * (tau_x - lam)
        )
        j_vis = -s_vis / (b_t + r_t * delta).clamp_min(TINY)
        return torch.where(zt == self.mask_token_id, j_abs, j_vis)
