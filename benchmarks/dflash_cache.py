"""DFlash: draft training step with cached target features vs an online target forward, and the
memory of the dense DFlash mask vs the flex `BlockMask`, in one run.

1. Step time. The same draft, batches, anchors and optimizer; one side reads the target's hidden
   states from a bf16 safetensors cache written by `strategies.dflash.features` (memory-mapped, as the
   `cache_target` stage writes it), the other runs the frozen target every step (the reference's
   way). The target has at least 4x the draft's parameters. Blocks of steps alternate between the
   sides to cancel machine drift; the ratio of median step times is printed.
2. Mask memory at N = 8, 32, 128 blocks: bytes of the dense additive mask `[B, 1, N·bs, S + N·bs]`
   (fp32 and bf16) vs the tensors of the flex `BlockMask` (128-token tiles).
3. Flex training memory on a GPU: peak CUDA memory of one draft step per mask kind, when CUDA is visible.

    python benchmarks/dflash_cache.py [--steps 20] [--batch 32] [--seq 128]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch

from strategies import Microbatch, SetupContext, StepContext
from strategies.dflash.blocks import build_target_layer_ids, create_dflash_block_mask, create_dflash_sdpa_mask
from strategies.dflash.draft import DFlashDraftConfig, DFlashDraftModel
from strategies.dflash.features import CachedFeatures, write_feature_cache
from strategies.dflash.strategy import DFlashStrategy
from strategies.models import build_model, count_parameters, tiny_model_config


def make_pair(vocab: int, seq: int, hidden: int, target_layers: int, draft_layers: int, block: int):
    target = (
        build_model(
            tiny_model_config("llama", vocab, seq, hidden, target_layers, 4, None, None, True),
            seed=0,
            dllm_attention="causal",
        )
        .eval()
        .requires_grad_(False)
    )
    ids = build_target_layer_ids(target_layers, draft_layers)
    torch.manual_seed(1)
    draft = DFlashDraftModel(DFlashDraftConfig(hidden, draft_layers, 4, block, ids, vocab - 1))
    return target, draft


def strategy_for(target, draft, features, blocks: int):
    s = DFlashStrategy()
    s.create_loss_fn({"block_size": draft.config.block_size, "num_blocks_per_sample": blocks})
    s.setup_extra(
        SetupContext(
            model=draft,
            tokenizer=None,
            mask_token_id=draft.config.mask_token_id,
            extras={"target": target, **({"features": features} if features else {})},
        )
    )
    return s


def step(strategy, draft, opt, mb, step_no: int) -> float:
    ctx = StepContext(model=draft, loss_fn=None, mask_token_id=draft.config.mask_token_id, step=step_no, base_seed=0)
    batches, n, _ = strategy.pre_step(ctx, [mb])
    out = strategy.forward_backward(ctx, batches[0], num_diffusion_tokens=n, num_ar_tokens=n, is_train=True)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(out.total_loss.detach())


def step_times(args) -> None:
    target, draft = make_pair(args.vocab, args.seq, args.hidden, args.target_layers, args.draft_layers, args.block)
    n_t, n_d = count_parameters(target), count_parameters(draft)
    rows = args.batch * (args.steps + 2)
    data = torch.randint(0, args.vocab - 1, (rows, args.seq), generator=torch.Generator().manual_seed(0))
    ones = torch.ones(data.shape)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        index = write_feature_cache(target, {"train": data}, draft.config.target_layer_ids, tmp, dtype="bf16")
        build = time.perf_counter() - t0
        sides = {}
        for name, feats in (("cached", CachedFeatures(tmp)), ("online", None)):
            d = copy.deepcopy(draft)
            sides[name] = (strategy_for(target, d, feats, args.blocks), d, torch.optim.AdamW(d.parameters(), lr=1e-3))

        def run(name, s):
            strat, d, opt = sides[name]
            r = torch.arange(s * args.batch, (s + 1) * args.batch)
            mb = Microbatch(data[r], ones[r], ones[r].long(), r)
            t = time.perf_counter()
            loss = step(strat, d, opt, mb, s)
            return time.perf_counter() - t, loss

        times = {"cached": [], "online": []}
        losses = {"cached": [], "online": []}
        for s in range(2):  # warm-up, not timed
            run("cached", s), run("online", s)
        for start in range(2, args.steps + 2, args.every):
            for name in ("cached", "online"):
                for s in range(start, min(start + args.every, args.steps + 2)):
                    dt, loss = run(name, s)
                    times[name].append(dt)
                    losses[name].append(loss)
    cached, online = statistics.median(times["cached"]), statistics.median(times["online"])
    drift = max(abs(a - b) / abs(b) for a, b in zip(losses["cached"], losses["online"]))
    print(
        f"threads={torch.get_num_threads()} batch={args.batch} seq={args.seq} block={args.block} "
        f"blocks/sample={args.blocks} steps={args.steps}"
    )
    print(
        f"target {args.target_layers} layers: {n_t / 1e6:.2f} M params; draft {args.draft_layers} layer(s): "
        f"{n_d / 1e6:.2f} M params (target/draft = {n_t / n_d:.1f}x)"
    )
    print(
        f"cache: {rows} rows, layers {draft.config.target_layer_ids}, bf16, {index['bytes'] / 2**20:.1f} MiB, "
        f"built in {build:.1f} s"
    )
    print(f"draft step, cached features (median): {cached * 1000:8.1f} ms")
    print(f"draft step, online target   (median): {online * 1000:8.1f} ms")
    print(
        f"ratio online/cached                  : {online / cached:8.2f}x   "
        f"(max relative loss gap {drift:.1e}: bf16 cache)"
    )


def block_mask_bytes(mask) -> int:
    seen, total = set(), 0
    for value in vars(mask).values():
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            total += value.numel() * value.element_size()
    return total


def mask_memory(args) -> None:
    print(f"\nmask memory: batch={args.mask_batch}, context S={args.mask_ctx}, block size {args.mask_block}")
    print(f"{'N':>5} {'dense fp32':>12} {'dense bf16':>12} {'flex BlockMask':>15} {'dense/flex (bf16)':>18}")
    for n in (8, 32, 128):
        gen = torch.Generator().manual_seed(n)
        anchors = torch.randint(1, args.mask_ctx - args.mask_block, (args.mask_batch, n), generator=gen)
        keep = torch.ones_like(anchors, dtype=torch.bool)
        q, kv = n * args.mask_block, args.mask_ctx + n * args.mask_block
        dense_bf16 = args.mask_batch * q * kv * 2
        if dense_bf16 <= 2**31:  # materialize it when it fits, to measure rather than compute
            dense = create_dflash_sdpa_mask(anchors, keep, args.mask_ctx, args.mask_block, dtype=torch.bfloat16)
            dense_bf16 = dense.numel() * dense.element_size()
            del dense
        flex = block_mask_bytes(create_dflash_block_mask(anchors, keep, args.mask_ctx, args.mask_block))
        print(
            f"{n:>5} {dense_bf16 * 2 / 2**20:>10.1f}Mi {dense_bf16 / 2**20:>10.1f}Mi {flex / 2**10:>13.1f}Ki "
            f"{dense_bf16 / flex:>17.0f}x"
        )


def gpu_training_memory(args) -> None:
    if not torch.cuda.is_available():
        print("\nflex training memory: no CUDA device visible here; run this script on a GPU machine to measure it")
        return
    target, draft = make_pair(
        args.vocab, args.mask_ctx, args.hidden, args.target_layers, args.draft_layers, args.mask_block
    )
    target, draft = target.cuda(), draft.cuda()
    data = torch.randint(0, args.vocab - 1, (args.mask_batch, args.mask_ctx), device="cuda")
    ones = torch.ones(data.shape, device="cuda")
    print(f"\nflex training memory (CUDA, batch {args.mask_batch}, S={args.mask_ctx}, bs={args.mask_block})")
    for n in (8, 32, 128):
        row = []
        for backend in ("sdpa", "flex_attention"):
            strat = strategy_for(target, draft, None, n)
            strat.backend = backend
            opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            try:
                step(strat, draft, opt, Microbatch(data, ones, ones.long(), None), 0)
                torch.cuda.synchronize()
                row.append(f"{backend} {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
            except torch.OutOfMemoryError:
                row.append(f"{backend} OOM")
            torch.cuda.empty_cache()
        print(f"  N={n:>3}: " + ", ".join(row))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5, help="steps per side before switching")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--target-layers", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4, help="anchor blocks per sample in the timed steps")
    ap.add_argument("--mask-batch", type=int, default=2)
    ap.add_argument("--mask-ctx", type=int, default=2048)
    ap.add_argument("--mask-block", type=int, default=16)
    args = ap.parse_args()
    step_times(args)
    mask_memory(args)
    gpu_training_memory(args)


if __name__ == "__main__":
    main()
