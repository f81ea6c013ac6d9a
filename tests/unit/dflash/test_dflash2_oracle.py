"""dllm-flow's DFlash, DFlash 2 and JetSpec drafts against an independent implementation (docs/strategies.md §10.11,
§10.14): z-lab's `dflash` package (0.1.0, installed `--no-deps`: Makefile `NODEPS`) loads the exported folder with its
own `DFlashDraftModel` / `DFlash2DraftModel.from_pretrained` (a JetSpec draft: `DFlashDraftModel` with `is_causal:
true`) and must give the same block logits (≤ 1e-5, fp32) and, through its own `dflash_generate`, the same greedy
tokens and acceptance lengths as dllm-flow's decoder.

The end of the token budget is counted differently: z-lab drafts the last cycle with a block cut to the tokens
left (its non-causal attention and convolutions then see fewer positions), so its last cycle's acceptance may
differ; every earlier cycle must match."""

import time

import pytest
import torch
from stagekit import tiny_dflash_target, tiny_draft_config

from strategies import Microbatch, StepContext, assemble_strategy
from strategies.dflash.decoding import greedy_generate, sample_continuations, speculative_generate
from strategies.dflash.draft import DFlashDraftConfig, DFlashDraftModel, draft_block_logits, target_features
from strategies.dflash.features import OnlineFeatures

zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash package (make install: NODEPS) is not installed")

MASK, V, BS = 63, 64, 4
SHAPES = {"variant": "dflash2", "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}
VARIANTS = {"dflash": {}, "dflash2": SHAPES, "jetspec": {"variant": "jetspec"}}
# causal and windowed in every layer: z-lab hides keys k > q and q − k ≥ 5 (prompts reach 8 tokens, past the window)
WINDOWED = {"variant": "jetspec", "sliding_window": 5, "layer_types": ["sliding_attention"] * 2}
# the training options of each variant: DFlash 2's shapes, JetSpec's forward KL to the target's top 16 tokens
OPTIONS = {
    "dflash2": {"draft_variant": "dflash2", "selector_top_k": 4, "conv_group_size": 8, "selector_rank": 8},
    "jetspec": {"draft_variant": "jetspec", "distill_top_k": 16, "kd_temperature": 2.0},
}
PROMPTS = ([1, 2, 3], [5, 9, 9, 4, 2, 7], [3, 1, 4, 1, 5, 3, 1, 4], [7, 7, 2])


@pytest.fixture(scope="module")
def target():
    return tiny_dflash_target()


def _cfg(**kw) -> DFlashDraftConfig:
    return tiny_draft_config(**kw)


def _randomized(cfg, seed=1) -> DFlashDraftModel:
    torch.manual_seed(seed)
    draft = DFlashDraftModel(cfg).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "conv" in name or "selector" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return draft


def _zlab(draft, folder):
    """The folder dllm-flow exports, loaded by z-lab's own class for its architecture; no weight left out."""
    draft.save(folder)
    cls = zlab.DFlash2DraftModel if draft.config.variant == "dflash2" else zlab.DFlashDraftModel
    model, info = cls.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model.eval()


def _max_block_logit_difference(target, draft, theirs) -> float:
    """Largest |Δ logit| over blocks drafted after each prefix of each prompt (anchor = the last prompt token)."""
    worst = 0.0
    with torch.no_grad():
        for prompt in PROMPTS:
            for end in range(2, len(prompt) + 1):
                ctx_ids, anchor_tok = torch.tensor([prompt[: end - 1]]), prompt[end - 1]
                feats, _, _ = target_features(target, ctx_ids, draft.config.target_layer_ids)
                block = torch.tensor([[anchor_tok] + [MASK] * (BS - 1)])
                anchor, keep = torch.tensor([[end - 1]]), torch.ones(1, 1, dtype=torch.bool)
                ours = draft_block_logits(draft, target, feats, anchor, keep, block)
                hidden = theirs(
                    position_ids=torch.arange(end - 1 + BS)[None],
                    noise_embedding=target.get_input_embeddings()(block),
                    target_hidden=feats,
                )
                worst = max(worst, float((ours - theirs.compute_logits(hidden, target.lm_head)).abs().max()))
    return worst


@pytest.mark.parametrize("variant", [*sorted(VARIANTS), "jetspec-windowed"])
def test_the_independent_implementation_gives_the_same_block_logits(target, variant, tmp_path):
    draft = _randomized(_cfg(**VARIANTS.get(variant, WINDOWED)))
    theirs = _zlab(draft, tmp_path)
    assert all(layer.self_attn.is_causal == variant.startswith("jetspec") for layer in theirs.layers)
    assert _max_block_logit_difference(target, draft, theirs) <= 1e-5


def _trained(target, variant, steps=20) -> DFlashDraftModel:
    """A draft of `variant` trained a little on the target's own greedy text, so blocks are partly accepted; the
    JetSpec loss (the forward KL alone) must fall on fixed anchors. DFlash 2's total first rises: its selector term
    grows as the true token enters the candidates more often."""
    torch.manual_seed(0)
    draft = DFlashDraftModel(_cfg(**VARIANTS[variant]))
    prompts = torch.randint(0, 60, (16, 4), generator=torch.Generator().manual_seed(1))
    rows = sample_continuations(target, prompts, 28, temperature=0.0)
    built = assemble_strategy(
        "dflash",
        {"block_size": BS, "num_blocks_per_sample": 4} | OPTIONS[variant],
        draft,
        None,
        mask_token_id=MASK,
        resources={
            "target": target,
            "features": OnlineFeatures(target, list(draft.config.target_layer_ids), top_k=16),
        },
    )
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    mb = Microbatch(rows, torch.ones_like(rows, dtype=torch.float32), torch.ones_like(rows), torch.arange(len(rows)))

    def step(i: int, train: bool) -> float:
        ctx = StepContext(model=draft, loss_fn=built.loss_fn, mask_token_id=MASK, step=i, base_seed=0)
        (batch,), n, _ = built.strategy.pre_step(ctx, [mb])
        out = built.strategy.forward_backward(ctx, batch, num_diffusion_tokens=n, num_ar_tokens=n, is_train=train)
        return float(out.total_loss.detach())

    before = step(10_000, False)  # the same anchors before and after
    for i in range(steps):
        step(i, True)
        opt.step()
        opt.zero_grad()
    after = step(10_000, False)
    assert variant != "jetspec" or after < 0.97 * before
    return draft.eval()


@pytest.mark.parametrize("variant", ["dflash2", "jetspec"])
def test_the_independent_decoder_gives_the_same_greedy_tokens_and_acceptance(target, variant, tmp_path, monkeypatch):
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its timing synchronizes CUDA; none here
    draft = _trained(target, variant)
    theirs = _zlab(draft, tmp_path)
    assert _max_block_logit_difference(target, draft, theirs) <= 1e-5
    accepted = 0
    for prompt in PROMPTS:
        ours = speculative_generate(target, draft, prompt, 24)
        stats = zlab.dflash_generate(theirs, target, torch.tensor([prompt]), 24, None, return_stats=True)
        assert ours.tokens == stats.output_ids[0, len(prompt) :].tolist() == greedy_generate(target, prompt, 24)
        assert ours.acceptance[:-1] == stats.acceptance_lengths[:-1]
        accepted += sum(ours.acceptance[:-1]) - len(ours.acceptance[:-1])
    assert accepted > 0  # some proposals stood: the comparison saw the selector's path, not just the bonus tokens
