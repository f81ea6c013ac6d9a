"""A DFlash 2 draft under DistributedDataParallel and FSDP2 (docs/strategies.md §10.11): the selector scores after
the wrapped forward, on the unwrapped module (FSDP2 keeps the root unit's parameters gathered until backward), and
its gradients are still all-reduced: two gloo CPU processes with two rows each give the one-process loss and
gradient of all four rows."""

import pytest
import torch

from strategies import Microbatch, StepContext, assemble_strategy
from strategies.base import global_sum
from strategies.dflash.blocks import _build_target_layer_ids
from strategies.dflash.draft import DFlashDraftConfig, DFlashDraftModel
from strategies.dflash.features import OnlineFeatures
from strategies.models import build_model, tiny_model_config

MASK = 63


def _pair():
    target = build_model(tiny_model_config("llama", 64, 128, 32, 5, 4, None, None, False), seed=0)
    cfg = DFlashDraftConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        block_size=4,
        target_layer_ids=_build_target_layer_ids(5, 2),
        mask_token_id=MASK,
        num_target_layers=5,
        vocab_size=64,
        variant="dflash2",
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=4,
    )
    torch.manual_seed(1)
    draft = DFlashDraftModel(cfg)
    with torch.no_grad():  # off the identity, so every DFlash 2 weight has a gradient
        draft.candidate_selector.successor_codebook.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    return target.eval().requires_grad_(False), draft


def _step(model, draft, target, rows, rank=0, world=1):
    built = assemble_strategy(
        "dflash",
        {"block_size": 4, "num_blocks_per_sample": 3, "draft_variant": "dflash2"}
        | {"conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4},
        draft,
        None,
        mask_token_id=MASK,
        resources={"target": target, "features": OnlineFeatures(target, list(draft.config.target_layer_ids))},
    )
    ids = torch.randint(0, 60, (4, 24), generator=torch.Generator().manual_seed(3))[rows]
    ones = torch.ones_like(ids)
    ctx = StepContext(
        model=model,
        loss_fn=built.loss_fn,
        mask_token_id=MASK,
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


def _worker(rank: int, world: int, init_file: str, out_file: str, mode: str):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tasks.training.distributed import shard_fsdp2

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        target, draft = _pair()
        if mode == "fsdp2":
            shard_fsdp2(draft)  # as training shards a draft: each layer, then the root (fc, norms, selector)
        model = DistributedDataParallel(draft) if mode == "ddp" else draft
        loss = _step(model, draft, target, list(range(rank, 4, world)), rank, world)
        grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in draft.parameters()]
        if rank == 0:
            torch.save({"loss": loss, "grads": grads}, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_a_dflash2_draft_data_parallel_matches_one_process(tmp_path, mode):
    import torch.multiprocessing as mp

    target, draft = _pair()
    loss = _step(draft, draft, target, [0, 1, 2, 3])
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path / "rank0.pt"), mode), nprocs=2, join=True)
    two = torch.load(tmp_path / "rank0.pt")
    assert two["loss"] == pytest.approx(loss, rel=1e-5)
    names = [n for n, _ in draft.named_parameters()]
    for name, p, g in zip(names, draft.parameters(), two["grads"]):
        assert g is not None, name
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6, msg=name)
