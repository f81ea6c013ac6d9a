"""Model adapters: the tiny causal families become bidirectional denoisers."""

import pytest
import torch

from strategies.models import build_model, model_logits, tiny_model_config


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_position_zero_sees_a_later_token(family):
    model = build_model(tiny_model_config(family, 64, 16, 32, 2, 4, 2, None, True), seed=0).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    with torch.no_grad():
        a = model_logits(model, {"input_ids": ids})
        b = model_logits(model, {"input_ids": changed})
        causal_a = model(input_ids=ids).logits
        causal_b = model(input_ids=changed).logits
    assert (a[:, 0] - b[:, 0]).abs().max() > 1e-4  # bidirectional: position 0 depends on position 11
    assert torch.allclose(causal_a[:, 0], causal_b[:, 0])  # the stock causal path does not


def test_build_is_deterministic_and_leaves_global_rng_alone():
    cfg = lambda: tiny_model_config("llama", 32, 8, 16, 1, 2, None, None, True)  # noqa: E731
    torch.manual_seed(5)
    state = torch.get_rng_state()
    a, b = build_model(cfg(), seed=3), build_model(cfg(), seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
