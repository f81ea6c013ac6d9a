"""What the DFlash unit tests share besides the model pair (conftest.py): the strategy assembled over a pair, its step
context, a batch and its loss."""

import torch

from strategies import Microbatch, StepContext, assemble_strategy
from strategies.dflash.features import OnlineFeatures

MASK = 63


def _strategy(target, draft, features=None, **cfg):
    """DFlash assembled for `draft` (online target features unless `features` is given): strategy + loss."""
    if features is None:
        features = OnlineFeatures(target, list(draft.config.target_layer_ids))
    return assemble_strategy(
        "dflash",
        {"block_size": 4, "num_blocks_per_sample": 3, **cfg},
        draft,
        None,
        mask_token_id=MASK,
        resources={"target": target, "features": features},
    )


def _ctx(built, draft, step=0):
    return StepContext(model=draft, loss_fn=built.loss_fn, mask_token_id=MASK, step=step, base_seed=7)


def _batch():
    ids = torch.randint(0, 60, (4, 24), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    return ids, Microbatch(ids, torch.ones_like(ids, dtype=torch.float32), attn, torch.arange(4))


def _loss(built, draft, mb, step=0):
    ctx = _ctx(built, draft, step)
    batches, n, _ = built.strategy.pre_step(ctx, [mb])
    out = built.strategy.forward_backward(ctx, batches[0], num_diffusion_tokens=n, num_ar_tokens=n, is_train=False)
    return out, batches


def greedy_rows(target):
    """The target's greedy continuations of 16 random 4-token prompts (32 tokens a row): what the tests train on."""
    from strategies.dflash.decoding import sample_continuations

    prompts = torch.randint(0, 60, (16, 4), generator=torch.Generator().manual_seed(1))
    return sample_continuations(target, prompts, 28, temperature=0.0)


def train_draft(built, draft, rows, steps: int, lr: float = 3e-3):
    """`steps` AdamW steps of the assembled strategy `built` on `rows` (one micro-batch, every token supervised)."""
    opt = torch.optim.AdamW(draft.parameters(), lr=lr)
    mb = Microbatch(rows, torch.ones_like(rows, dtype=torch.float32), torch.ones_like(rows), torch.arange(len(rows)))
    for i in range(steps):
        ctx = StepContext(model=draft, loss_fn=built.loss_fn, mask_token_id=MASK, step=i, base_seed=0)
        (batch,), n, _ = built.strategy.pre_step(ctx, [mb])
        built.strategy.forward_backward(ctx, batch, num_diffusion_tokens=n, num_ar_tokens=n, is_train=True)
        opt.step()
        opt.zero_grad()
    return draft.eval()


def trained_dspark(target, head_type: str = "vanilla", steps: int = 40, **options):
    """A tiny DSpark draft (rank 8, the given Markov head) trained `steps` steps on the target's greedy text, that
    text and the assembled strategy: what the DSpark tests decode with and export."""
    from stagekit import tiny_draft_config

    from strategies.dflash.draft import DFlashDraftModel

    torch.manual_seed(0)
    draft = DFlashDraftModel(tiny_draft_config(variant="dspark", markov_rank=8, markov_head_type=head_type))
    rows = greedy_rows(target)
    cfg = {"draft_variant": "dspark", "dspark_markov_rank": 8, "dspark_markov_head_type": head_type, **options}
    built = _strategy(target, draft, **cfg)
    return train_draft(built, draft, rows, steps), rows, built


def second_token_pvalue(target, draft, runs: int = 200, **decoding) -> float:
    """T = 1: the chi-square p-value of the second generated token (the first the draft proposes) over `runs` decodes
    of [1, 2, 3] against the target's own marginal, over its 7 likeliest tokens and the rest."""
    from scipy.stats import chisquare

    from strategies.dflash.decoding import speculative_generate

    prompt, v = [1, 2, 3], target.get_input_embeddings().weight.shape[0]
    with torch.no_grad():
        p1 = torch.softmax(target(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        rows = torch.cat([torch.tensor([prompt]).expand(v, -1), torch.arange(v)[:, None]], dim=1)
        p2 = (p1[:, None] * torch.softmax(target(input_ids=rows).logits[:, -1], -1)).sum(0).double()
    top = p2.topk(7).indices.tolist()
    g, seen = torch.Generator().manual_seed(0), torch.zeros(8)
    for _ in range(runs):
        token = speculative_generate(target, draft, prompt, 2, temperature=1.0, generator=g, **decoding).tokens[1]
        seen[top.index(token) if token in top else 7] += 1
    expected = torch.cat([p2[top], (1 - p2[top].sum()).reshape(1)]) * runs
    return float(chisquare(seen.numpy(), expected.numpy()).pvalue)
