"""A DiffusionGemma with one expert (the tiny config's default) runs its expert as a dense MLP (`OneExpert`), not
through transformers' expert dispatch: the same values and gradients, element-wise, in a training forward and
backward of the canvas call (benchmarks/step_cost.py, issue 45)."""

import pytest
import torch
from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaTextExperts

from strategies.block_diffusion.gemma import DiffusionGemmaCanvas, OneExpert
from strategies.block_diffusion.strategy import build_response_window
from strategies.models import tiny_diffusion_gemma_config

V, BS = 48, 4


def _gemma(experts: int) -> DiffusionGemmaCanvas:
    config = tiny_diffusion_gemma_config(
        V, 64, 32, 2, 2, 1, None, num_experts=experts, top_k_experts=1, moe_intermediate_size=8, canvas_length=BS,
        token_ids={"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2},
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DiffusionGemmaCanvas(config)
    with torch.no_grad():  # an expert scale and router that are not the identity, so the weights matter
        for name, param in model.named_parameters():
            if name.endswith(("per_expert_scale", "router.scale")):
                param.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    return model


def _experts(model) -> list:
    return [m for m in model.modules() if isinstance(m, DiffusionGemmaTextExperts)]


def _dispatched(model: DiffusionGemmaCanvas, implementation: str) -> DiffusionGemmaCanvas:
    """The same module through transformers' expert dispatch (`implementation`: "grouped_mm" or "eager")."""
    for module in _experts(model):
        module.__class__ = DiffusionGemmaTextExperts
        module.config._experts_implementation = implementation  # the text config's (grouped_mm by default)
    return model


def _step(model: DiffusionGemmaCanvas) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """A training forward of the canvas call (encoder, both self-conditioning passes, decoder) and its backward."""
    g = torch.Generator().manual_seed(4)
    clean, noisy = torch.randint(3, V, (2, 14), generator=g), torch.randint(3, V, (2, 14), generator=g)
    loss = torch.ones(2, 14, dtype=torch.bool)
    loss[:, :2] = False
    attention = torch.ones(2, 14, dtype=torch.long)
    attention[1, 11:] = 0
    w = build_response_window(clean, noisy, loss, loss, torch.ones(2, 14), attention, BS, None, None)
    model.train()
    out = model(
        input_ids=clean,
        canvas_ids=w.canvas_ids,
        decoder_attention_mask=w.decoder_attention_mask,
        encoder_position_ids=w.encoder_position_ids,
        encoder_padding_mask=w.encoder_padding_mask,
        decoder_position_ids=w.decoder_position_ids,
        do_self_conditioning=torch.tensor([True, False]),
    )
    (out.logits.square().mean() + out.encoder_logits.square().mean()).backward()
    return out.logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_one_expert_runs_dense_and_more_experts_keep_the_dispatch():
    assert {type(m) for m in _experts(_gemma(1))} == {OneExpert}
    assert {type(m) for m in _experts(_gemma(2))} == {DiffusionGemmaTextExperts}


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_the_dense_expert_trains_as_the_dispatched_one_element_wise(implementation):
    dense_logits, dense_grads = _step(_gemma(1))
    moe_logits, moe_grads = _step(_dispatched(_gemma(1), implementation))
    worst = float((dense_logits - moe_logits).abs().max())
    assert torch.allclose(dense_logits, moe_logits, rtol=1e-5, atol=1e-6), worst
    assert dense_grads.keys() == moe_grads.keys()
    for name, grad in moe_grads.items():
        mine = dense_grads[name]
        if grad is None or mine is None:  # the same parameters get a gradient (the router's: zeros)
            assert grad is None and mine is None, name
            continue
        assert torch.allclose(mine, grad, rtol=1e-5, atol=1e-6), (name, float((mine - grad).abs().max()))
    # one expert: the router's choice is fixed, its projection learns nothing (its expert scale is the weight)
    routers = [g for n, g in dense_grads.items() if n.endswith(("router.proj.weight", "router.scale"))]
    assert routers and all(float(g.abs().max()) == 0 for g in routers)
    exact = all(torch.equal(dense_grads[n], g) for n, g in moe_grads.items() if g is not None)
    print(f"[measured] dense vs {implementation} expert: max |Δ logits| {worst:.1e}, gradients bitwise equal: {exact}")
