"""Acceptance as it will be served (docs/evaluation.md §4.7.1): the draft exported in the z-lab layout, loaded
by z-lab's own `DFlashDraftModel` / `DFlash2DraftModel` (PyPI `dflash` 0.1.0, the independent implementation that
SGLang's and vLLM's DFlash follow) and decoded by its `dflash_generate`, in-process, on the evaluation's prompts
rendered as a user turn with the target's own chat template (its `enable_thinking` switch set by
`dflash.eval_enable_thinking` where the template has one). Beside it, dllm-flow's decoder on the same rendered
prompts and on the raw validation prompts (today's `dflash/tau`), so a gap splits into the engine's share and the
prompt format's.

Counting: z-lab shortens a block to the tokens left in the budget (and cuts what a cycle commits there), dllm-flow
drafts a full block and trims the text afterwards; every τ here counts only the cycles whose whole block and bonus
token fit in the budget, and never a prompt's last (EOS) cycle (`full_cycles`; `dflash/tau_full_cycles` is today's τ
counted that way). The gap's noise is a paired bootstrap over prompts (Efron & Tibshirani 1993, ch. 6; the
ratio-of-sums τ recomputed on each resample, seeded by `eval.seed`): beyond noise when its 95% percentile interval
excludes 0. The causes checked are `strategies.dflash.served_checks`'s.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from strategies.dflash.config import CONFIG, ZLAB
from strategies.dflash.decoding import speculative_generate
from strategies.dflash.dflash2_config import DFLASH2, DOMINO, DSPARK
from strategies.dflash.served_checks import (
    CAUSES,
    chat_prompt,
    engine_field_problems,
    has_thinking_switch,
    mask_served_problem,
    target_config_ids,
    target_tokenizer,
    template_token_ids,
    tokenizer_problems,
)
from strategies.dflash.serving_layout import write_serving_layout
from strategies.models import tokenizer_token_ids

PRETRAIN_STAGE = (
    "pretrain_target"  # tasks.speculative.target.PRETRAIN: a target pretrained here (on plain text unless chat)
)
RESAMPLES = 2000


def zlab_module():
    """z-lab's `dflash.model`, or None where the package is not installed."""
    try:
        import dflash.model as zlab
    except ImportError:
        return None
    return zlab


def zlab_draft(zlab, draft, tokenizer, folder: Path, dtype: torch.dtype, device):
    """The draft written as `dllm-flow export --format zlab` writes it (config.json with the tokenizer's special ids,
    model.safetensors) into `folder`, loaded by z-lab's class for its architecture; (model, config.json read)."""
    cfg = dataclasses.replace(draft.config, **tokenizer_token_ids(tokenizer))
    tensors = {k: v.detach().cpu() for k, v in draft.state_dict().items()}
    write_serving_layout(folder, cfg, tensors, ZLAB, {})
    cls = zlab.DFlash2DraftModel if draft.config.variant == DFLASH2 else zlab.DFlashDraftModel
    model = cls.from_pretrained(str(folder), dtype=torch.float32)
    return model.to(device=device, dtype=dtype).eval(), json.loads((folder / CONFIG).read_text())


@contextmanager
def _cpu_timing(zlab):
    """`dflash_generate(return_stats=True)` times with `torch.cuda.synchronize`: a plain clock without CUDA."""
    original = zlab._cuda_time
    if not torch.cuda.is_available():
        zlab._cuda_time = time.perf_counter
    try:
        yield
    finally:
        zlab._cuda_time = original


def render_prompts(raw: list[list[int]], trained, served, chat: bool, thinking: bool | None) -> list[list[int]]:
    """Each validation prompt as the engine gets it: its text (decoded with the training tokenizer) as one user turn
    through the served tokenizer's chat template with the generation prompt; `chat` False: the prompts as they are."""
    if not chat:
        return [list(p) for p in raw]
    return [chat_prompt(served, trained.decode(p, skip_special_tokens=True), thinking) for p in raw]


def full_cycles(acc: list[int], budget: int, block_size: int) -> list[int]:
    """The cycles both decoders run alike: those whose whole block and bonus token fit in the budget (Σ committed
    before it + block_size < budget: z-lab neither shortens the block nor cuts what it commits), never the last."""
    out, done = [], 0
    for a in acc[:-1]:
        if done + block_size >= budget:
            break
        out.append(a)
        done += a
    return out


def ratio(acc: list[list[int]]) -> float:
    """τ over prompts: Σ committed tokens ÷ Σ cycles."""
    cycles = sum(len(a) for a in acc)
    return sum(sum(a) for a in acc) / max(cycles, 1)


def paired_bootstrap(a: list[list[int]], b: list[list[int]], seed: int, resamples: int = RESAMPLES):
    """τ(b) − τ(a) and its 95% percentile interval, prompts resampled in pairs."""
    n = len(a)
    gen = torch.Generator().manual_seed(seed)
    diffs = []
    for _ in range(resamples):
        idx = torch.randint(0, n, (n,), generator=gen).tolist()
        diffs.append(ratio([b[i] for i in idx]) - ratio([a[i] for i in idx]))
    d = torch.tensor(diffs, dtype=torch.float64)
    return ratio(b) - ratio(a), float(d.quantile(0.025)), float(d.quantile(0.975)), float(d.std())


def served_causes(draft, mask_id: int, target, trained, served, chat_trained: bool, chat: bool, raw: dict, theirs):
    """(cause, line) for every likely cause of a served gap found on this draft, target and tokenizers."""
    cfg = draft.config
    found = []
    problem = mask_served_problem(mask_id, target_config_ids(target), template_token_ids(served) if chat else None)
    if problem:
        found.append(("mask_alias", problem))
    found += tokenizer_problems(trained, served, chat_trained)
    if chat and not chat_trained:
        found.append(("format", "the draft trained on plain text rows (data.shape: pretrain) and is served chat turns"))
    ours = {"block_size": cfg.block_size, "mask_token_id": mask_id, "target_layer_ids": list(cfg.target_layer_ids)}
    lines = engine_field_problems(raw, ours)
    loaded = {"block_size": theirs.block_size, "mask_token_id": theirs.mask_token_id}
    loaded["target_layer_ids"] = [int(i) for i in theirs.target_layer_ids]
    lines += [f"z-lab's loader took {k} {loaded[k]}, dllm-flow uses {v}" for k, v in ours.items() if loaded[k] != v]
    found += [("engine_fields", line) for line in lines]
    return found


def _decode_both(zlab, theirs, target, draft, raw_prompts, prompts, ev) -> tuple[list, list, list, int]:
    """Full-cycle acceptance of our decoder on the raw and the served prompts and of z-lab's on the served ones, and
    how many served prompts both decoded to the same tokens."""
    n, eos, bs = ev.spec.dflash.eval_max_new_tokens, ev.tokenizer.eos_token_id, draft.config.block_size
    ours_raw, ours_served, served, same = [], [], [], 0
    with _cpu_timing(zlab):
        for p, q in zip(raw_prompts, prompts):
            ours_raw.append(full_cycles(speculative_generate(target, draft, p, n, eos).acceptance, n, bs))
            mine = speculative_generate(target, draft, q, n, eos)
            stats = zlab.dflash_generate(
                theirs, target, torch.tensor([q], device=target.device), n, None if eos is None else [eos],
                return_stats=True,
            )  # fmt: skip
            ours_served.append(full_cycles(mine.acceptance, n, bs))
            served.append(full_cycles(list(stats.acceptance_lengths), n, bs))
            same += int(mine.tokens == stats.output_ids[0, len(q) :].tolist())
    return ours_raw, ours_served, served, same


def served_acceptance(ev, target, draft, mask_id: int, raw_prompts: list[list[int]], meta: dict) -> tuple[dict, dict]:
    """The `dflash/*served*` metrics and the `served` part of speculative.json (docs/evaluation.md §4.7.1)."""
    d, tokenizer = ev.spec.dflash, ev.tokenizer
    skipped = 3 if not getattr(d, "eval_served", True) else 2 if draft.config.copy_hint else 0
    skipped = skipped or (5 if draft.config.variant in (DOMINO, DSPARK) else 0)  # no package decodes these
    zlab = zlab_module() if not skipped else None
    if not skipped and zlab is None:
        skipped = 1
    if skipped:
        return {"dflash/tau_served_prompts": 0, "dflash/served_skipped": skipped}, {"skipped": skipped}
    record = meta.get("target") or {}
    served_tok = target_tokenizer(record.get("path")) or tokenizer
    template = getattr(served_tok, "chat_template", None)
    plain_target = record.get("stage") == PRETRAIN_STAGE and not meta.get("chat")  # pretrained here on plain text
    chat = bool(template) and not plain_target
    thinking = getattr(d, "eval_enable_thinking", None) if chat and has_thinking_switch(template) else None
    prompts = render_prompts(raw_prompts, tokenizer, served_tok, chat, thinking)
    dtype = next(target.parameters()).dtype
    with tempfile.TemporaryDirectory() as tmp:
        theirs, raw = zlab_draft(zlab, draft, tokenizer, Path(tmp), dtype, next(target.parameters()).device)
    ours_raw, ours_served, served, same = _decode_both(zlab, theirs, target, draft, raw_prompts, prompts, ev)
    if not any(served) or not any(ours_raw):  # every prompt done in one cycle: nothing left once the last is dropped
        return {"dflash/tau_served_prompts": 0, "dflash/served_skipped": 4}, {"skipped": 4}
    gap, lo, hi, se = paired_bootstrap(ours_raw, served, ev.spec.eval.seed)
    causes = served_causes(draft, mask_id, target, tokenizer, served_tok, bool(meta.get("chat")), chat, raw, theirs)
    metrics = {
        "dflash/tau_served": ratio(served),
        "dflash/tau_served_ours": ratio(ours_served),
        "dflash/tau_full_cycles": ratio(ours_raw),
        "dflash/tau_served_prompts": len(prompts),
        "dflash/tau_served_gap": gap,
        "dflash/tau_served_gap_lo": lo,
        "dflash/tau_served_gap_hi": hi,
        "dflash/tau_served_gap_se": se,
        "dflash/tau_served_mismatch": int(lo > 0 or hi < 0),
        "dflash/served_exact_match": same / len(prompts),
        "dflash/served_chat": int(chat),
        **({"dflash/served_thinking": int(thinking)} if thinking is not None else {}),
        **{f"dflash/served_cause_{c}": int(any(c == k for k, _ in causes)) for c in CAUSES},
    }
    reason = None if chat else "the target was pretrained here on plain text" if plain_target else "no chat template"
    report = {
        "chat": chat,
        "plain_reason": reason,
        "thinking": thinking,
        "counting": "cycles whose block and bonus fit in the budget, never a prompt's last (z-lab cuts the rest)",
        "causes": [{"cause": c, "detail": line} for c, line in causes],
        "acceptance": {"ours_validation": ours_raw, "ours_served": ours_served, "served": served},
    }
    return metrics, report
