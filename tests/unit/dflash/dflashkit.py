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
