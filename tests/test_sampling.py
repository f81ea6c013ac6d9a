"""Absorbing sampler: no masks left, prompts untouched, windows respected, confident denoiser exact."""

import torch

from strategies.sampling import SamplerConfig, absorbing_sample, num_transfer_tokens

MASK, PAD, V = 15, 0, 16


def target_denoiser(target_fn):
    """A perfectly confident denoiser: position p always predicts target_fn(p)."""

    def denoise(x, attn):
        logits = torch.full((*x.shape, V), -20.0)
        for p in range(x.shape[1]):
            logits[:, p, target_fn(p)] = 20.0
        return logits

    return denoise


def test_transfer_schedule_spreads_remainder_first():
    sched = num_transfer_tokens(torch.tensor([10, 3]), 4)
    assert sched.tolist() == [[3, 3, 2, 2], [1, 1, 1, 0]]
    assert sched.sum(1).tolist() == [10, 3]


def test_confident_denoiser_is_reproduced_and_prompt_kept():
    prompts = [[1, 2, 3], [4, 5]]
    cfg = SamplerConfig(steps=8, max_new_tokens=8, block_size=4)
    res = absorbing_sample(
        target_denoiser(lambda p: 1 + p % 13), prompts, mask_token_id=MASK, pad_token_id=PAD, config=cfg
    )
    assert not (res.tokens == MASK).any()
    for i, p in enumerate(prompts):
        assert res.tokens[i, : len(p)].tolist() == p
        assert res.generated(i).tolist() == [1 + (len(p) + k) % 13 for k in range(8)]


def test_blocks_are_filled_left_to_right():
    """With one step per token, block b is complete before any token of block b+1 appears."""
    seen = []

    def denoise(x, attn):
        seen.append(x.clone())
        g = torch.Generator().manual_seed(len(seen))
        return torch.randn(*x.shape, V, generator=g)

    absorbing_sample(
        denoise,
        [[1, 2]],
        mask_token_id=MASK,
        pad_token_id=PAD,
        config=SamplerConfig(steps=8, max_new_tokens=8, block_size=4),
    )
    for x in seen:
        gen = x[0, 2:]
        first_block_done = not (gen[:4] == MASK).any()
        assert first_block_done or (gen[4:] == MASK).all()


def test_threshold_mode_and_random_remasking_leave_no_masks():
    for cfg in (
        SamplerConfig(steps=4, max_new_tokens=8, block_size=8, threshold=0.9),
        SamplerConfig(steps=8, max_new_tokens=8, block_size=4, remasking="random", temperature=1.0),
    ):
        res = absorbing_sample(
            target_denoiser(lambda p: 3),
            [[1]],
            mask_token_id=MASK,
            pad_token_id=PAD,
            config=cfg,
            generator=torch.Generator().manual_seed(0),
        )
        assert not (res.tokens == MASK).any() and res.tokens[0, 0] == 1


def test_threshold_mode_reveals_all_confident_tokens_in_one_forward():
    res = absorbing_sample(
        target_denoiser(lambda p: 3),
        [[1]],
        mask_token_id=MASK,
        pad_token_id=PAD,
        config=SamplerConfig(steps=8, max_new_tokens=8, block_size=8, threshold=0.9),
    )
    assert res.nfe == 1


def test_eos_stops_and_fills_tail():
    eos = 14
    res = absorbing_sample(
        target_denoiser(lambda p: eos if p >= 4 else 2),
        [[1, 1]],
        mask_token_id=MASK,
        pad_token_id=PAD,
        config=SamplerConfig(steps=16, max_new_tokens=16, block_size=4, eos_token_id=eos),
    )
    assert not (res.tokens == MASK).any() and res.nfe < 16
