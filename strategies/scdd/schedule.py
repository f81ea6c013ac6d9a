"""SCDD's noise schedule (docs/strategies.md §5.8): the mass of the clean, uniform and absorbed channels at
time t, and the training grid times are drawn from."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from strategies.corruption import check_args

TINY = 1e-30


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
    return SCDDSchedule(clean, uniform, absorbed, gamma, clean / gamma.clamp_min(TINY))


def scdd_grid_times(
    batch: int,
    num_timesteps: int,
    eps: float,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> Tensor:
    """SCDD time sampling (docs/strategies.md §5.8): u' = (1−eps)u + eps, t = (⌊u'·T⌋ + 1)/T, then t ≤ 1 − 1/T.
    T = num_timesteps ≥ 2 (the inner grid {1/T, …, (T−1)/T} is empty for T = 1)."""
    check_args("scdd_grid_times", eps=eps, integers={"batch": (batch, 0), "num_timesteps": (num_timesteps, 2)})
    u = (1 - eps) * torch.rand(batch, generator=generator, device=device) + eps
    t = (torch.floor(u * num_timesteps) + 1) / num_timesteps
    return t.clamp(max=1 - 1 / num_timesteps)
