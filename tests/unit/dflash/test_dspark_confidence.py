"""A DSpark draft's confidence head judged (docs/evaluation.md §4.7.4): the proposals greedy verification decides, AUROC
and ECE by hand, and the θ curve on a trained tiny draft (every θ keeps the target's greedy text; cutting verifies
fewer tokens)."""

import pytest
from dflashkit import trained_dspark
from stagekit import tiny_dflash_target

from strategies.dflash.decoding import speculative_prompts
from tasks.speculative.confidence import auroc, calibration, ece, realised, theta_metrics, threshold_curve


def test_the_proposals_whose_fate_was_decided():
    """A cycle that committed c tokens accepted c − 1 proposals and (when it verified more) rejected the next; what
    came after was never judged."""
    confidences = [[[0.9, 0.8, 0.7], [0.6, 0.5, 0.4]], [[0.3, 0.2]]]
    acceptance = [[4, 2], [1]]  # all 3 accepted (+ bonus); 1 accepted then 1 rejected; the first rejected
    pred, real = realised(confidences, acceptance)
    assert pred == [0.9, 0.8, 0.7, 0.6, 0.5, 0.3] and real == [1, 1, 1, 1, 0, 0]


def test_auroc_and_ece_by_hand():
    # accepted 0.9, 0.6; rejected 0.6, 0.2: pairs (0.9>0.6) (0.9>0.2) (0.6=0.6 half) (0.6>0.2) → 3.5 / 4
    assert auroc([0.9, 0.6, 0.6, 0.2], [1, 1, 0, 0]) == pytest.approx(0.875)
    assert auroc([0.5, 0.4], [1, 1]) is None
    # bins of 0.1: {0.05: realised 0} {0.95, 0.95: realised 1, 0} → (1/3)·0.05 + (2/3)·|0.95 − 0.5|
    assert ece([0.05, 0.95, 0.95], [0, 1, 0]) == pytest.approx(0.05 / 3 + 2 / 3 * 0.45)
    cal = calibration([[[0.9, 0.2]]], [[2]])
    assert cal["judged"] == 2 and cal["auroc"] == 1.0 and cal["realised"] == 0.5


def test_the_theta_curve_keeps_the_targets_text_and_verifies_less():
    target = tiny_dflash_target()
    draft, rows, _ = trained_dspark(target)
    prompts = speculative_prompts(rows, rows.new_ones(rows.shape), 4, 6)
    curve = threshold_curve(target, draft, prompts, 20, None, [0.5, 0.9], seed=0)
    whole, half, strict, *position = curve["rows"]
    assert [(r["rule"], r["theta"]) for r in position] == [("position", 0.5), ("position", 0.9)]
    assert whole["theta"] == 0.0 and whole["verified_ratio"] == 1.0 and whole["tau_gain"] == 0.0
    assert all(r["exact_match"] == 1.0 for r in curve["rows"])
    assert strict["verified_per_token"] <= half["verified_per_token"] <= whole["verified_per_token"]
    assert strict["verified_per_token"] < whole["verified_per_token"]
    assert strict["verified_ratio_low"] <= strict["verified_ratio"] <= strict["verified_ratio_high"]
    logged = theta_metrics(curve)
    assert logged["dflash/theta0.5_tau"] == half["tau"] and "dflash/confidence_ece" in logged
    assert logged["dflash/theta0.9_position_tau"] == position[1]["tau"]


def test_the_reports_confidence_line():
    from tasks.speculative.table import confidence_cell

    m = {
        "dflash/tau": 5.0,
        "dflash/confidence_auroc": 0.8,
        "dflash/confidence_ece": 0.05,
        **{f"dflash/theta0.5_{k}": v for k, v in {"tau": 4.5, "verified_per_token": 1.25, "time_ratio": 0.9}.items()},
        **{f"dflash/theta0.1_{k}": v for k, v in {"tau": 4.9, "verified_per_token": 1.5, "time_ratio": 0.95}.items()},
    }
    assert confidence_cell("dflash", m) == (
        "dflash: AUROC 0.800, ECE 0.050 (whole blocks: 5.00; θ 0.1: τ 4.90, 1.50 verified per token, time × 0.95; "
        "θ 0.5: τ 4.50, 1.25 verified per token, time × 0.90)"
    )
    assert confidence_cell("dflash", {"dflash/confidence_ece": 0.1}) == "dflash: AUROC –, ECE 0.100"
