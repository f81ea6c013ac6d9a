"""The likelihood estimators GRPO's ratio is built from (docs/post-training.md, "Likelihood estimators"), against an
element-wise reference written here: what each view shows the denoiser, and the log-probability each completion
token gets. The denoiser is a table whose logits depend on the position, on whether the position is masked and on
how many positions of the row are masked, so every view gives different numbers."""

import math

import pytest
import torch

from tasks.posttrain.estimators import COUPLED_RANGE, coupled, one_step

MASK, V = 9, 10


class TableDenoiser:
    def __init__(self, length: int):
        gen = torch.Generator().manual_seed(3)
        self.shown, self.length = [], length
        self.clean = torch.randn(length, V, generator=gen)
        self.masked = torch.randn(length, V, generator=gen)
        self.per_mask = torch.randn(V, generator=gen)

    def logits_at(self, row: list[int], p: int) -> torch.Tensor:
        base = self.masked[p] if row[p] == MASK else self.clean[p]
        return base + sum(t == MASK for t in row) * self.per_mask

    def __call__(self, x, attention_mask):
        self.shown.append(x.clone())
        return torch.stack([torch.stack([self.logits_at(r, p) for p in range(len(r))]) for r in x.tolist()])

    def logp(self, row: list[int], p: int, token: int) -> float:
        return float(torch.log_softmax(self.logits_at(row, p), -1)[token])


PROMPT = torch.tensor([[1, 2, 3], [4, 5, 6]])
COMPLETION = torch.tensor([[7, 8, 0, 0], [8, 7, 7, 0]])


def test_one_step_masks_the_completion_and_a_share_of_the_prompt():
    for p_mask, expect_prompt in ((0.0, PROMPT), (1.0, torch.full_like(PROMPT, MASK))):
        den = TableDenoiser(7)
        got = one_step(den, PROMPT, COMPLETION, MASK, torch.Generator().manual_seed(0), p_mask_prompt=p_mask)
        (shown,) = den.shown
        assert torch.equal(shown[:, :3], expect_prompt) and (shown[:, 3:] == MASK).all()
        for b in range(2):
            for k in range(4):
                want = den.logp(shown[b].tolist(), 3 + k, int(COMPLETION[b, k]))
                assert got[b, k].item() == pytest.approx(want, abs=1e-6)
    # a share in between: the draws of the generator given, so one seed gives one view to every policy
    den = TableDenoiser(7)
    a = one_step(den, PROMPT, COMPLETION, MASK, torch.Generator().manual_seed(5), p_mask_prompt=0.5)
    b = one_step(den, PROMPT, COMPLETION, MASK, torch.Generator().manual_seed(5), p_mask_prompt=0.5)
    drawn = torch.rand(PROMPT.shape, generator=torch.Generator().manual_seed(5)) < 0.5
    assert torch.equal(den.shown[0][:, :3], torch.where(drawn, MASK, PROMPT)) and torch.equal(a, b)


def test_coupled_views_are_complementary_and_each_token_is_weighted_by_its_views_rate():
    den = TableDenoiser(7)
    got = coupled(den, PROMPT, COMPLETION, MASK, torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(1)  # the same draws, in the same order
    low, high = COUPLED_RANGE
    t = low + (high - low) * float(torch.rand((), generator=gen))
    u = torch.rand(COMPLETION.shape, generator=gen)
    (shown,) = den.shown  # the three views in one batch: full, u < t, u > t
    full, first, second = shown[:2], shown[2:4], shown[4:]
    assert (full[:, 3:] == MASK).all() and torch.equal(shown[:, :3], PROMPT.repeat(3, 1))
    assert torch.equal(first[:, 3:] == MASK, u < t) and torch.equal(second[:, 3:] == MASK, u > t)
    for b in range(2):
        for k in range(4):
            token = int(COMPLETION[b, k])
            p_full = den.logp(full[b].tolist(), 3 + k, token)
            view, rate = (first, t) if u[b, k] < t else (second, 1 - t)
            want = (p_full + den.logp(view[b].tolist(), 3 + k, token) / rate) / 2
            assert got[b, k].item() == pytest.approx(want, abs=1e-5)
    assert low <= t <= high and not math.isclose(t, 0.5)
