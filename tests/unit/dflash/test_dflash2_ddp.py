"""DFlash 2 and Domino drafts under DistributedDataParallel and FSDP2 (docs/strategies.md §10.11, §10.15): the
selector and the correction head run after the wrapped forward, on the unwrapped module (FSDP2 keeps the root unit's
parameters gathered until backward), and their gradients are still all-reduced: two gloo CPU processes with two
rows each give the one-process loss and gradient of all four rows."""

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
DOMINO = {"gru_hidden_dim": 12, "emb_dim": 8}


def _pair(variant: str):
    cfg = tiny_draft_config(variant=variant, **(SHAPES if variant == "dflash2" else DOMINO))
    torch.manual_seed(1)
    draft = DFlashDraftModel(cfg)
    with torch.no_grad():  # off the identity / zero start, so every weight of the variant has a gradient
        g = torch.Generator().manual_seed(2)
        if variant == "dflash2":
            draft.candidate_selector.successor_codebook.normal_(0, 0.3, generator=g)
        else:
            draft.embed_proj[2].weight.normal_(0, 0.3, generator=g)
    return tiny_dflash_target(), draft


def _options(variant: str) -> dict:
    if variant == "dflash2":
        return {"draft_variant": "dflash2"} | SHAPES
    return {"draft_variant": "domino"} | {f"domino_{k}": v for k, v in DOMINO.items()}


def _step(model, draft, target, rows, rank=0, world=1):
    variant = draft.config.variant
    built = assemble_strategy(
        "dflash",
        {"block_size": 4, "num_blocks_per_sample": 3} | _options(variant),
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
        total_steps=10,  # Domino's curriculum: both its losses at step 3
    )
    (batch,), n, _ = built.strategy.pre_step(ctx, [Microbatch(ids, ones.float(), ones, torch.tensor(rows))])
    out = built.strategy.forward_backward(
        ctx, batch, num_diffusion_tokens=global_sum(n), num_ar_tokens=n, is_train=True
    )
    return global_sum(float(out.total_loss.detach()))


def _worker(rank: int, world: int, out_file: str, mode: str, variant: str):
    from torch.nn.parallel import DistributedDataParallel

    from tasks.training.distributed import shard_fsdp2

    target, draft = _pair(variant)
    if mode == "fsdp2":
        shard_fsdp2(draft)  # as training shards a draft: each layer, then the root (fc, norms, selector)
    model = DistributedDataParallel(draft) if mode == "ddp" else draft
    loss = _step(model, draft, target, list(range(rank, 4, world)), rank, world)
    grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in draft.parameters()]
    if rank == 0:
        torch.save({"loss": loss, "grads": grads}, out_file)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("variant", ["dflash2", "domino"])
def test_a_draft_with_a_serial_part_data_parallel_matches_one_process(tmp_path, mode, variant):
    target, draft = _pair(variant)
    loss = _step(draft, draft, target, [0, 1, 2, 3])
    part = "selector" if variant == "dflash2" else "_gru"
    moving = [n for n, p in draft.named_parameters() if part in n and float(p.grad.abs().sum()) > 0]
    assert len(moving) == (3 if variant == "dflash2" else 2), (
        "the variant's weights must have a gradient for the check to mean anything"
    )
    run_ranks(_worker, str(tmp_path / "rank0.pt"), mode, variant, tmp_path=tmp_path)
    two = torch.load(tmp_path / "rank0.pt")
    assert two["loss"] == pytest.approx(loss, rel=1e-5)
    names = [n for n, _ in draft.named_parameters()]
    for name, p, g in zip(names, draft.parameters(), two["grads"]):
        assert g is not None, name
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=name)
