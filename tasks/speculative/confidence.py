"""A DSpark draft's confidence head judged (docs/evaluation.md §4.7.4): how well its predicted acceptance matches the
acceptance greedy speculative decoding realises (AUROC, ECE), and what confidence-scheduled verification trades
(docs/strategies.md §10.17): per threshold θ, τ, the tokens the target verifies per committed token and decode time,
each against whole-block verification of the same draft on the same prompts, paired over prompts.
"""

from __future__ import annotations

import time

import torch

from strategies.dflash.decoding import speculative_generate
from strategies.dflash.dspark import CONFIDENCE_RULES
from tasks.speculative.served import RESAMPLES, paired_bootstrap, ratio

ECE_BINS = 10


def realised(confidences: list[list[list[float]]], acceptance: list[list[int]]) -> tuple[list[float], list[int]]:
    """(predicted, realised) over every proposal whose fate greedy verification decided: in a cycle that accepted a
    proposals, those a (realised 1) and, when one was rejected, the first rejected (0); the rest were never judged on
    their own (each confidence predicts acceptance given that everything before stood). Per prompt, per cycle."""
    pred, real = [], []
    for per_prompt, acc in zip(confidences, acceptance):
        for conf, committed in zip(per_prompt, acc):
            accepted = committed - 1
            for k, c in enumerate(conf[: accepted + 1]):
                pred.append(float(c))
                real.append(int(k < accepted))
    return pred, real


def auroc(pred: list[float], real: list[int]) -> float | None:
    """The probability that an accepted proposal was given a higher confidence than a rejected one (ties count half;
    the Mann–Whitney statistic); None when either class is empty."""
    pos = torch.tensor([p for p, r in zip(pred, real) if r], dtype=torch.float64)
    neg = torch.tensor([p for p, r in zip(pred, real) if not r], dtype=torch.float64)
    if not len(pos) or not len(neg):
        return None
    greater = (pos[:, None] > neg[None, :]).double().sum() + 0.5 * (pos[:, None] == neg[None, :]).double().sum()
    return float(greater / (len(pos) * len(neg)))


def ece(pred: list[float], real: list[int], bins: int = ECE_BINS) -> float | None:
    """Expected calibration error: Σ_b (n_b / n)·|mean confidence_b − acceptance rate_b| over `bins` equal bins."""
    if not pred:
        return None
    p, r = torch.tensor(pred, dtype=torch.float64), torch.tensor(real, dtype=torch.float64)
    index = (p * bins).long().clamp(max=bins - 1)
    total = 0.0
    for b in range(bins):
        inside = index == b
        if inside.any():
            total += float(inside.sum()) / len(p) * abs(float(p[inside].mean() - r[inside].mean()))
    return total


def calibration(confidences, acceptance) -> dict:
    """The confidence head against realised acceptance: AUROC, ECE, mean predicted and realised, how many judged."""
    pred, real = realised(confidences, acceptance)
    return {
        "auroc": auroc(pred, real),
        "ece": ece(pred, real),
        "predicted": sum(pred) / max(len(pred), 1),
        "realised": sum(real) / max(len(real), 1),
        "judged": len(pred),
    }


def _bootstrap_ratio(num_a, den_a, num_b, den_b, seed: int) -> tuple[float, float, float]:
    """(Σb_num/Σb_den) ÷ (Σa_num/Σa_den) over prompts and its 95 % interval, prompts resampled in pairs."""
    n, gen = len(num_a), torch.Generator().manual_seed(seed)

    def value(idx):
        a = sum(num_a[i] for i in idx) / max(sum(den_a[i] for i in idx), 1e-12)
        b = sum(num_b[i] for i in idx) / max(sum(den_b[i] for i in idx), 1e-12)
        return b / max(a, 1e-12)

    draws = torch.tensor([value(torch.randint(0, n, (n,), generator=gen).tolist()) for _ in range(RESAMPLES)])
    return value(range(n)), float(draws.quantile(0.025)), float(draws.quantile(0.975))


def threshold_curve(target, draft, prompts, max_new_tokens: int, eos_token_id, thresholds, seed: int) -> dict:
    """Whole-block verification (θ = 0) and each θ under both cut rules (`product`, dllm-flow's; `position`,
    DeepSpec's) on the same prompts, greedy, the decoders alternating prompt by prompt so machine drift hits them
    alike (one warm-up call each first): per (rule, θ), τ and its paired gain, target tokens verified per committed
    token and decode time as ratios to θ = 0 (paired bootstrap 95 %), and whether the outputs are θ = 0's token for
    token (they must be: both are the target's greedy text)."""
    settings = [("whole", 0.0), *[(rule, float(t)) for rule in CONFIDENCE_RULES for t in thresholds]]

    def decode(p, n, setting):
        rule, t = setting
        rule = "product" if rule == "whole" else rule
        return speculative_generate(target, draft, p, n, eos_token_id, confidence_threshold=t, confidence_rule=rule)

    for setting in settings:
        decode(prompts[0], 4, setting)
    runs = {s: [] for s in settings}
    seconds = {s: [] for s in settings}
    for p in prompts:
        for setting in settings:
            t0 = time.perf_counter()
            runs[setting].append(decode(p, max_new_tokens, setting))
            seconds[setting].append(time.perf_counter() - t0)
    whole = runs[settings[0]]
    rows = [
        _curve_row(setting, runs[setting], seconds[setting], whole, seconds[settings[0]], seed) for setting in settings
    ]
    return {
        "rows": rows,
        "calibration": calibration([r.confidences or [] for r in whole], [r.acceptance for r in whole]),
    }


def _curve_row(setting, res, seconds, whole, whole_seconds, seed: int) -> dict:
    """One (rule, θ) of the curve against whole blocks on the same prompts."""
    acc = [r.acceptance for r in res]
    gain, low, high, _ = paired_bootstrap([r.acceptance for r in whole], acc, seed)
    committed, mine = [sum(r.acceptance) for r in whole], [sum(r.acceptance) for r in res]
    verified = [sum(v + 1 for v in r.verified) for r in res]
    v_ratio = _bootstrap_ratio([sum(v + 1 for v in r.verified) for r in whole], committed, verified, mine, seed)
    t_ratio = _bootstrap_ratio(whole_seconds, committed, seconds, mine, seed)
    return {
        "rule": setting[0],
        "theta": setting[1],
        "tau": ratio(acc),
        "tau_gain": gain,
        "tau_gain_low": low,
        "tau_gain_high": high,
        "verified_per_token": sum(verified) / max(sum(mine), 1),
        "verified_ratio": v_ratio[0],
        "verified_ratio_low": v_ratio[1],
        "verified_ratio_high": v_ratio[2],
        "seconds": sum(seconds),
        "time_ratio": t_ratio[0],
        "time_ratio_low": t_ratio[1],
        "time_ratio_high": t_ratio[2],
        "target_forwards": sum(r.target_forwards for r in res),
        "exact_match": sum(r.tokens == w.tokens for r, w in zip(res, whole)) / len(res),
    }


def theta_metrics(curve: dict) -> dict:
    """The logged `dflash/*` metrics of a threshold curve: the calibration, and per θ > 0 its τ, verified-per-token and
    time ratios (θ written with its digits: `theta0.5_tau` under the product rule, `theta0.5_position_tau` under
    DeepSpec's per-position rule)."""
    cal = curve["calibration"]
    out = {f"dflash/confidence_{k}": v for k, v in cal.items() if v is not None}
    for row in curve["rows"][1:]:
        name = f"dflash/theta{row['theta']:g}" + ("_position" if row["rule"] == "position" else "")
        out.update({f"{name}_{k}": row[k] for k in ("tau", "verified_per_token", "time_ratio", "exact_match")})
    return out
