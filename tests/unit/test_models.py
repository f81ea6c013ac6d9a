"""Model adapters: the tiny causal families become bidirectional denoisers; the optional time conditioning."""

import pytest
import torch

from dllm_common.checkpoint import load_weights_into, write_checkpoint
from strategies.models import (
    add_time_conditioning,
    build_model,
    model_from_config_dir,
    model_logits,
    time_embedding,
    tiny_model_config,
)


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


# ------------------------------------------------------------------ time conditioning (docs/strategies.md §8.2)


def _tiny(vocab=32):
    return build_model(tiny_model_config("llama", vocab, 8, 16, 1, 2, None, None, True), seed=0)


def test_time_conditioning_starts_neutral_then_reads_each_rows_time_with_gradients():
    model = _tiny()
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    before = model_logits(model, {"input_ids": ids})
    torch.manual_seed(5)
    state = torch.get_rng_state()
    emb = add_time_conditioning(model)
    assert torch.equal(torch.get_rng_state(), state)  # initialized from its own seed
    assert add_time_conditioning(model) is emb and time_embedding(model) is emb and model.config.dllm_time_conditioning
    assert torch.allclose(model_logits(model, {"input_ids": ids}, time=torch.tensor([0.1, 0.9])), before)  # zero-init
    torch.nn.init.normal_(emb.mlp[2].weight, std=0.05)  # as after some training
    early, late = (model_logits(model, {"input_ids": ids}, time=t) for t in (0.1, 0.9))
    assert (early - late).abs().max() > 1e-3
    mixed = model_logits(model, {"input_ids": ids}, time=torch.tensor([0.1, 0.9]))  # one time per row
    assert torch.allclose(mixed[0], early[0], atol=1e-6) and torch.allclose(mixed[1], late[1], atol=1e-6)
    assert torch.allclose(model_logits(model, {"input_ids": ids}), before)  # no time given: nothing added
    model_logits(model, {"input_ids": ids}, time=torch.tensor([0.3, 0.6])).logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in emb.parameters())
    assert time_embedding(_tiny()) is None


def test_time_conditioned_checkpoint_round_trip_and_a_plain_one_loads_as_before(tmp_path):
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    timed = _tiny()
    torch.nn.init.normal_(add_time_conditioning(timed).mlp[2].weight, std=0.05)
    write_checkpoint(tmp_path / "timed", timed, meta={"step": 1})
    rebuilt = model_from_config_dir(tmp_path / "timed")
    load_weights_into(rebuilt, tmp_path / "timed")  # strict: the time embedding's weights are in the file
    t = torch.tensor([0.2, 0.7])
    assert torch.equal(
        model_logits(rebuilt, {"input_ids": ids}, time=t), model_logits(timed, {"input_ids": ids}, time=t)
    )

    plain = _tiny()
    write_checkpoint(tmp_path / "plain", plain, meta={"step": 1})
    again = model_from_config_dir(tmp_path / "plain")
    load_weights_into(again, tmp_path / "plain")
    assert time_embedding(again) is None and set(again.state_dict()) == set(plain.state_dict())
    assert not any("time" in k for k in again.state_dict())
    assert torch.equal(model_logits(again, {"input_ids": ids}), model_logits(plain, {"input_ids": ids}))
