"""A DFlash 2 draft under DistributedDataParallel and FSDP2 (docs/strategies.md §10.11): the selector scores after
the wrapped forward, on the unwrapped module (FSDP2 keeps the root unit's parameters gathered until backward), and
its gradients are still all-reduced: two gloo CPU processes with two rows each give the one-process loss and
gradient of all four rows."""

import pytest
import torch
from rankkit import run_ranks
from stagekit import tiny_dflash_target, tiny_draft_config

from strategies import Microbatch, StepContext, assemble_strategy
from strategies.base import global_sum
from strategies.dflash.draft import DFlashDraftModel
from strategies.dflash.features import OnlineFeatures

# top 32 of 64 tokens: an untrained draft's candidates hold the true token often enough that the selector's CE,
# and so every selector weight's gradient, is not zero (top 4 held none, and the check compared zeros)
SHAPES = {"conv_group_size": 8, "selector_rank": 8, "selector_top_k": 32}


def _pair():
    cfg = tiny_draft_config(variant="dflash2", **SHAPES)
    torch.manual_seed(1)
    draft = DFlashDraftModel(cfg)
    with torch.no_grad():  # off the identity, so every DFlash 2 weight has a gradient
        draft.candidate_selector.successor_codebook.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    return tiny_dflash_target(), draft


def _step(model, draft, target, rows, rank=0, world=1):
    built = assemble_strategy(
        "dflash",
        {"block_size": 4, "num_blocks_per_sample": 3, "draft_variant": "dflash2"} | SHAPES,
        draft,
        None,
        mask_token_id=draft.config.mask_token_id,
        resources={"target": target, "features": OnlineFeatures(target, list(draft.config.target_layer_ids))},
    )
    ids = torch.randint(0, 60, (4, 24), generator=torch.Generator().manual_seed(3))[rows]
    ones = torch.ones_like(ids)
    ctx = StepContext(
        model=model,
        loss_fn=built.loss_fn,
        mask_token_id=draft.config.mask_token_id,
        step=3,
        base_seed=7,
        dp_rank=rank,
        dp_size=world,
        loss_scale=float(world),
    )
    (batch,), n, _ = built.strategy.pre_step(ctx, [Microbatch(ids, ones.float(), ones, torch.tensor(rows))])
    out = built.strategy.forward_backward(
        ctx, batch, num_diffusion_tokens=global_sum(n), num_ar_tokens=n, is_train=True
    )
    return global_sum(float(out.total_loss.detach()))


def _worker(rank: int, world: int, out_file: str, mode: str):
    from torch.nn.parallel import DistributedDataParallel

    from tasks.training.distributed import shard_fsdp2

    target, draft = _pair()
    if mode == "fsdp2":
        shard_fsdp2(draft)  # as training shards a draft: each layer, then the root (fc, norms, selector)
    model = DistributedDataParallel(draft) if mode == "ddp" else draft
    loss = _step(model, draft, target, list(range(rank, 4, world)), rank, world)
    grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in draft.parameters()]
    if rank == 0:
        torch.save({"loss": loss, "grads": grads}, out_file)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_dflash2_draft_data_parallel_matches_one_process(tmp_path, mode):
    target, draft = _pair()
    loss = _step(draft, draft, target, [0, 1, 2, 3])
    selector = [n for n, p in draft.named_parameters() if "selector" in n and float(p.grad.abs().sum()) > 0]
    assert len(selector) == 3, "the selector's weights must have a gradient for the check to mean anything"
    run_ranks(_worker, str(tmp_path / "rank0.pt"), mode, tmp_path=tmp_path)
    two = torch.load(tmp_path / "rank0.pt")
    assert two["loss"] == pytest.approx(loss, rel=1e-5)
    names = [n for n, _ in draft.named_parameters()]
    for name, p, g in zip(names, draft.parameters(), two["grads"]):
        assert g is not None, name
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=name)
