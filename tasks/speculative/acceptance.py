"""Judging a DFlash draft (docs/evaluation.md §4.7): acceptance instead of likelihood.

`dflash/tau_sim` and `dflash/acc_k{k}` are teacher-forced on validation rows; the real `dflash/tau`
and `dflash/speedup` come from speculative decoding of held-out prompts, checked token for token
against the target's own greedy decoding (`dflash/exact_match`).
"""

from __future__ import annotations

import json
import time
from collections import Counter

import torch

from dllm_common.checkpoint import read_meta
from dllm_common.config import EvalConfig
from strategies import Microbatch, StepContext
from strategies.dflash.decoding import greedy_generate, speculative_generate, speculative_prompts
from strategies.dflash.dflash2 import block_predecessors, candidate_recall, selector_scores
from strategies.dflash.dflash2_config import BACKBONE, DFLASH2, DOMINO, DSPARK, SAMPLED_DEFAULT, WALK
from strategies.dflash.domino import corrected_logits
from strategies.dflash.draft import draft_block_hidden, draft_block_logits, embed_and_head
from strategies.dflash.dspark import block_predecessors_all, teacher_forced
from strategies.dflash.loss import acceptance_from_correct
from strategies.dflash.tree import DraftTree
from strategies.seeding import seeded_generator
from tasks.evaluation.likelihood import CausalLM, EvalResult, Evaluation, ar_nll_metrics, encode_prompts, exact_ar_nll
from tasks.evaluation.scoring import generative_perplexity, mean_entropy
from tasks.speculative.confidence import calibration, theta_metrics, threshold_curve
from tasks.speculative.served import paired_bootstrap, ratio, served_acceptance
from tasks.speculative.setup import draft_strategy, load_spec_target


def teacher_forced_acceptance(
    strat, draft, val, mask_id: int, settings: EvalConfig, documents=None, recall: list | None = None
) -> tuple[float, list[float], int]:
    """τ_sim and acc_k over validation rows `val` = (ids, loss_mask, attention_mask): anchors drawn with the
    eval seed, the target's features computed online, the draft's argmax compared with the true continuation;
    on packed rows (`documents`: per-token document ids) each block stays inside its document, as in training.
    A DFlash 2 draft's prediction is its selector's pick after the true predecessor (what the walk picks while
    everything before is accepted), and `recall` (a list) receives Σ true tokens among the candidates and Σ
    supervised predictions (docs/strategies.md §10.11); a Domino draft's, the argmax of its corrected logits after
    the true predecessors (§10.15), a DSpark draft's the argmax of its Markov-biased logits after them (§10.17)."""
    (ids, loss_mask, attn), batch_size, seed = val, settings.batch_size, settings.seed
    bs = strat.block_size
    ctx = StepContext(model=draft, loss_fn=None, mask_token_id=mask_id, step=0, base_seed=seed)
    corrects, masks, hits = [], [], [0.0, 0.0]
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            sl = slice(start, start + batch_size)
            rows = torch.arange(start, start + len(ids[sl]))
            docs = None if documents is None else documents[sl]
            (batch,), _, _ = strat.pre_step(ctx, [Microbatch(ids[sl], loss_mask[sl], attn[sl], rows, "val", docs)])
            e = batch.extras
            b, n = e.anchors.shape
            if draft.config.variant == DSPARK:  # the Markov bias after the true predecessors
                emb, head = embed_and_head(strat.target)
                h4 = draft_block_hidden(draft, bs, emb, e.features, e.anchors, e.keep, e.block_ids, e.documents)
                h4 = h4.view(b, n, bs, -1)
                logits = head(h4[:, :, 1:])
                bias = teacher_forced(draft, h4, block_predecessors_all(e.block_ids, e.targets, bs)).bias
                if bias is not None:
                    logits = logits + bias[:, :, 1:].to(logits.dtype)
                pred = logits.argmax(-1).reshape(b, -1)
            elif draft.config.variant in (DFLASH2, DOMINO):  # drafted serially: after the true predecessors
                emb, head = embed_and_head(strat.target)
                h = draft_block_hidden(draft, bs, emb, e.features, e.anchors, e.keep, e.block_ids, e.documents)
                h = h.view(b, n, bs, -1)[:, :, 1:].reshape(b, n * (bs - 1), -1)
                previous = block_predecessors(e.block_ids, e.targets, bs)
                if draft.config.variant == DFLASH2:
                    sel = selector_scores(draft.candidate_selector, h, head, previous, e.targets)
                    pred = sel.picks()
                    hits = [a + c for a, c in zip(hits, candidate_recall(sel, e.block_mask))]
                else:  # Domino: the corrected logits (§10.15)
                    pred = corrected_logits(draft, h, head(h), previous, emb).argmax(-1)
            else:
                logits = draft_block_logits(
                    draft, strat.target, e.features, e.anchors, e.keep, e.block_ids, e.documents, e.hints
                )
                pred = logits.view(b, n, bs, -1)[:, :, 1:].argmax(-1).reshape(b, -1)
            corrects.append(pred == e.targets)
            masks.append(e.block_mask)
    correct, block_mask = torch.cat(corrects), torch.cat(masks)
    if recall is not None:
        recall.extend(hits)
    tau, acc = acceptance_from_correct(correct, block_mask, bs)
    return tau, acc, int((block_mask.reshape(-1, bs - 1)[:, 0] > 0).sum())


def speculative_benchmark(
    target, draft, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None, lookup_ngram: int = 0
) -> dict:
    """Real τ, output equality with target-only greedy decoding, and the decode-time ratio, same prompts,
    same run: one warm-up call each, then the two decoders alternate prompt by prompt so machine drift
    hits both alike. With `lookup_ngram` the speculative decoder uses the context lookup, and the draft
    alone decodes the same prompts once more for `tau_draft` (untimed)."""

    def decode(p, n, lookup=lookup_ngram):
        return speculative_generate(target, draft, p, n, eos_token_id, lookup_ngram=lookup)

    greedy_generate(target, prompts[0], 4, eos_token_id)
    decode(prompts[0], 4)
    greedy, spec, t_greedy, t_spec = [], [], 0.0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        greedy.append(greedy_generate(target, p, max_new_tokens, eos_token_id))
        t1 = time.perf_counter()
        spec.append(decode(p, max_new_tokens))
        t_greedy, t_spec = t_greedy + t1 - t0, t_spec + time.perf_counter() - t1
    acceptance = [a for r in spec for a in r.acceptance]
    tokens = sum(len(r.tokens) for r in spec)
    extra = {}
    if lookup_ngram:
        alone = [a for p in prompts for a in decode(p, max_new_tokens, 0).acceptance]
        extra = {
            "tau_draft": sum(alone) / max(len(alone), 1),
            "lookup_share": sum(r.lookups for r in spec) / max(len(acceptance), 1),
        }
    return {
        **extra,
        "tau": sum(acceptance) / max(len(acceptance), 1),
        "speedup": t_greedy / t_spec,
        "exact_match": sum(r.tokens == g for r, g in zip(spec, greedy)) / len(prompts),
        "target_forwards": sum(r.target_forwards for r in spec),
        "tokens": tokens,
        "greedy_seconds": t_greedy,
        "speculative_seconds": t_spec,
        "histogram": dict(sorted(Counter(acceptance).items())),
        "outputs": [r.tokens for r in spec],
        "acceptance": [r.acceptance for r in spec],  # per prompt: what a paired comparison of two drafts reads
        **({"confidences": [r.confidences for r in spec]} if spec[0].confidences is not None else {}),
    }


def sampled_acceptance(
    target,
    draft,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_id,
    temperature: float,
    seed: int,
    lookup=0,
    proposals: str | None = None,
) -> dict:
    """τ of speculative sampling at `temperature` on the same prompts (docs/evaluation.md §4.7): the draft's
    proposals drawn from its distribution at that temperature, kept by the rejection step, so acceptance rewards
    the draft's whole distribution, not its argmax alone. Prompt i draws from its own generator, seeded from
    (`seed`, i): a rerun gives the same tokens, and two drafts face the same seeds. With `lookup` the draft alone
    decodes the prompts once more (`tau_draft`). `proposals`: what a DFlash 2 / Domino draft proposes from, its walk
    or its backbone (`speculative_generate`'s `sampled_proposals`; None: the draft's default)."""

    def acceptance(lookup_ngram: int) -> list[list[int]]:
        return [
            speculative_generate(
                target,
                draft,
                p,
                max_new_tokens,
                eos_token_id,
                temperature=temperature,
                generator=seeded_generator(seed * 1_000_003 + i),
                lookup_ngram=lookup_ngram,
                sampled_proposals=proposals,
            ).acceptance
            for i, p in enumerate(prompts)
        ]

    out = acceptance(lookup)
    alone = {"tau_draft": ratio(acceptance(0))} if lookup else {}
    return {"temperature": temperature, "tau": ratio(out), **alone, "acceptance": out}


# the tree evaluation's logged metrics (dflash/<name>) and the keys of `tree_acceptance` they hold
TREE_METRICS = {
    "tree_branches": "branches",
    "tau_tree": "tau",
    "tau_tree_gain": "gain",
    "tau_tree_gain_low": "gain_low",
    "tau_tree_gain_high": "gain_high",
    "tree_exact_match": "exact_match",  # must be 1: the tree keeps the target's greedy text
}


def tree_acceptance(target, draft, prompts, max_new_tokens, eos_token_id, branches, lookup, one_path, seed) -> dict:
    """τ of greedy tree verification with `branches` branches (docs/strategies.md §10.16) on the same prompts, paired
    against the one-path decoder's acceptance `one_path` (bootstrap 95 %), and the outputs checked equal to it."""
    tree = DraftTree(branches)
    runs = [
        speculative_generate(target, draft, p, max_new_tokens, eos_token_id, lookup_ngram=lookup, tree=tree)
        for p in prompts
    ]
    acceptance = [r.acceptance for r in runs]
    gain, low, high, _ = paired_bootstrap(one_path["acceptance"], acceptance, seed)
    same = sum(r.tokens == o for r, o in zip(runs, one_path["outputs"])) / len(prompts)
    return {
        "branches": branches,
        "tau": ratio(acceptance),
        "gain": gain,
        "gain_low": low,
        "gain_high": high,
        "exact_match": same,
        "acceptance": acceptance,
    }


def _at_temperature(spec, target, draft, prompts, eos_id: int | None) -> dict:
    """At `dflash.eval_temperature` (none at 0): the decoder's τ, and a serial draft's with its other proposals."""
    d, sampled = spec.dflash, {}
    if d.eval_temperature > 0:
        args = (target, draft, prompts, d.eval_max_new_tokens, eos_id, d.eval_temperature)
        sampled["sampled"] = sampled_acceptance(*args, spec.eval.seed, d.lookup_ngram)
        if (default := SAMPLED_DEFAULT.get(draft.config.variant)) is not None:
            other = BACKBONE if default == WALK else WALK
            sampled[f"sampled_{other}"] = sampled_acceptance(*args, spec.eval.seed, d.lookup_ngram, other)
    return sampled


def _confidence(spec, target, draft, prompts, eos_id: int | None, bench: dict) -> dict:
    """A DSpark draft's confidence head (docs/evaluation.md §4.7.4): its calibration on the greedy decode's realised
    acceptance, and with `dflash.eval_confidence_thresholds` the θ trade-off curve on the same prompts ({} for a draft
    without a confidence head)."""
    if "confidences" not in bench:
        return {}
    thresholds = spec.dflash.eval_confidence_thresholds
    if thresholds:
        args = (target, draft, prompts, spec.dflash.eval_max_new_tokens, eos_id, thresholds, spec.eval.seed)
        return threshold_curve(*args)
    return {"rows": [], "calibration": calibration(bench["confidences"], bench["acceptance"])}


def _shown_samples(spec, target, draft, tokenizer) -> tuple[list[str], list[list[int]]]:
    """The report's text prompts and their speculative continuations (greedy: equal to the target's own)."""
    texts = list(spec.eval.prompts[: spec.eval.num_samples]) or ["O"]
    shown = [
        speculative_generate(
            target, draft, p, spec.eval.sample_length, tokenizer.eos_token_id, lookup_ngram=spec.dflash.lookup_ngram
        ).tokens
        for p in encode_prompts(tokenizer, texts, spec.data.shape == "dialogue")
    ]
    return texts, shown


def dflash_evaluation(ev: Evaluation) -> EvalResult:
    """DFlash metrics: τ_sim and acc_k (teacher-forced), real τ and speedup from speculative decoding
    checked token for token against target-only greedy, the target's exact NLL, and samples."""
    spec, draft, tokenizer, device, scorer = ev.spec, ev.model, ev.tokenizer, ev.device, ev.scorer
    ids, loss_mask, attn = ev.val
    d = spec.dflash
    meta = read_meta(ev.ckpt)
    target = load_spec_target(spec, meta["target"]["path"], device)
    built = draft_strategy(ev.strategy, ev.options, draft, target, mask_token_id=ev.mask_id)
    strat, mask_id = built.strategy, built.mask_token_id
    draft.eval()
    recall: list[float] = []
    tau_sim, acc, blocks = teacher_forced_acceptance(strat, draft, ev.val, mask_id, spec.eval, ev.val_documents, recall)
    nll, se, n_tokens = exact_ar_nll(CausalLM(), target, ids, loss_mask, attn, spec.eval.batch_size)
    prompts = speculative_prompts(ids, attn, d.eval_prompts, d.eval_prompt_len)
    bench = speculative_benchmark(target, draft, prompts, d.eval_max_new_tokens, tokenizer.eos_token_id, d.lookup_ngram)
    sampled = _at_temperature(spec, target, draft, prompts, tokenizer.eos_token_id)
    tree = {}  # with dflash.eval_tree_branches: the same prompts, tree-verified
    if d.eval_tree_branches:
        args = (target, draft, prompts, d.eval_max_new_tokens, tokenizer.eos_token_id, d.eval_tree_branches)
        tree = tree_acceptance(*args, d.lookup_ngram, bench, spec.eval.seed)
    confidence = _confidence(spec, target, draft, prompts, tokenizer.eos_token_id, bench)
    # the same prompts through z-lab's decoder, chat-rendered with the target's template (docs/evaluation.md §4.7.1)
    served, served_report = served_acceptance(ev, target, draft, mask_id, prompts, meta)
    # the report's shared columns, from speculative decoding of the report's text prompts (no timing
    # or greedy check needed here: the benchmark above did both)
    texts, shown = _shown_samples(spec, target, draft, tokenizer)
    decoded = [tokenizer.decode(t) for t in shown]
    metrics = {
        "dflash/tau_sim": tau_sim,
        **{f"dflash/acc_k{k + 1}": a for k, a in enumerate(acc)},
        "dflash/blocks": blocks,
        "dflash/tau": bench["tau"],
        "dflash/speedup": bench["speedup"],
        "dflash/exact_match": bench["exact_match"],
        **{f"dflash/{k}": bench[k] for k in ("tau_draft", "lookup_share") if k in bench},
        **({"dflash/candidate_recall": recall[0] / max(recall[1], 1.0)} if draft.config.variant == DFLASH2 else {}),
        **{f"dflash/{k}_{how}": r[k] for how, r in sampled.items() for k in ("tau", "tau_draft") if k in r},
        **{f"dflash/{name}": tree[k] for name, k in TREE_METRICS.items() if tree},
        **served,
        **(theta_metrics(confidence) if confidence else {}),
        **ar_nll_metrics(nll, se, n_tokens),
        "eval/nfe": bench["target_forwards"] / len(bench["outputs"]),
        "eval/tokens_per_forward": bench["tokens"] / max(bench["target_forwards"], 1),
        "eval/tokens_per_s": bench["tokens"] / bench["speculative_seconds"],
        "eval/entropy": mean_entropy(shown),
    }
    if scorer is not None:
        metrics["eval/gen_ppl"], _ = generative_perplexity(*scorer, list(zip(texts, decoded)))
    text = "\n\n".join(f"### prompt: {p!r}\n{t}" for p, t in zip(texts, decoded))
    report = {**{k: v for k, v in bench.items() if k not in ("outputs", "confidences")}, "served": served_report}
    if confidence:
        report["confidence"] = confidence
    report.update(sampled)
    if tree:
        report["tree"] = tree
    return EvalResult(strat, metrics, [], text, {"speculative.json": json.dumps(report, indent=2)})
