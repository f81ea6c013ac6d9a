"""`dllm-flow plan` covers the GRPO stage (docs/post-training.md): its update traced through the stage's own
estimator and objective on fake tensors. The traced numbers move as the settings say they must."""

import pytest

from strategies.options import load_config
from tasks.commands.plan import Cluster, plan_strategy
from tasks.commands.plan.posttrain import plan_grpo


def _plans(*overrides):
    spec = load_config("configs/grpo.yaml", list(overrides), note=False)
    cluster = Cluster(gpus=1, device="cuda", memory=None)
    return spec, plan_grpo(spec, plan_strategy(spec, "mdlm", cluster, variants=False, sizing=False), cluster)


def test_the_reference_is_one_more_copy_of_the_weights_and_only_when_beta_is_set():
    _, with_ref = _plans()
    _, without = _plans("grpo.beta=0")
    assert with_ref.reference > 0 and without.reference == 0
    assert with_ref.resident - without.resident == with_ref.reference


def test_coupled_scores_three_views_and_costs_about_three_forwards_of_one_step():
    _, coupled = _plans("grpo.estimator=coupled", "grpo.beta=0")
    _, one = _plans("grpo.estimator=one_step", "grpo.beta=0")
    assert coupled.rows == 3 * one.rows
    assert coupled.activations > 2 * one.activations
    # rollouts are the same; the update's forward and backward are three times one step's
    assert coupled.step_flops > one.step_flops


def test_more_prompts_and_inner_updates_cost_proportionally():
    _, base = _plans("grpo.beta=0")
    _, twice = _plans("grpo.beta=0", "grpo.prompts_per_step=32")
    assert twice.step_flops == pytest.approx(2 * base.step_flops)
    _, mu = _plans("grpo.beta=0", "grpo.inner_updates=2")
    assert mu.step_flops > base.step_flops


def test_spg_scores_its_draws_and_needs_no_old_policy_pass():
    _, one = _plans("grpo.estimator=one_step", "grpo.beta=0")
    _, spg = _plans("grpo.estimator=elbo_eubo", "grpo.beta=0", "grpo.likelihood_draws=4")
    assert spg.rows == 4 * one.rows and spg.reference == 0
    _, mu = _plans("grpo.estimator=elbo_eubo", "grpo.beta=0", "grpo.likelihood_draws=4", "grpo.inner_updates=2")
    # a second inner update adds one update's cost and no forward of the drawing policy (SPG has no ratio)
    rollouts_and_one = 2 * spg.step_flops - mu.step_flops
    assert 0 < rollouts_and_one < spg.step_flops


def test_under_lora_the_reference_costs_no_copy():
    _, full = _plans()
    _, lora = _plans("grpo.peft={r: 4}")
    assert full.reference > 0 and lora.reference == 0
