"""Stage `evaluate[strategy]`: likelihood metrics on validation rows, sample quality and sampling
cost at several step budgets, and a reproducibility card (evaluation spec, metric names shared).

NELBO (evaluation spec §4.1): for each row, K stratified times t_k = (k + u)/K over the full
range (0, 1), u seeded per batch; the one-sample estimate (1/t)·Σ_{masked ∧ supervised} −log p_θ
is averaged over k. `eval/nelbo` = Σ_rows S_i / Σ_rows n_i (nats per supervised token) with the
ratio estimator's standard error; `eval/ppl_bound` = exp(nelbo) bounds the perplexity.

DFlash (evaluation spec §4.7) is judged by acceptance instead: `dflash/tau_sim` and `dflash/acc_k{k}`
teacher-forced on validation rows, and the real `dflash/tau` and `dflash/speedup` from speculative
decoding of held-out prompts, checked token for token against the target's greedy decoding.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers

from dllm_common.checkpoint import DIGESTS, load_weights_into, read_meta
from dllm_common.config import PipelineSpec
from dllm_common.store import sha256_file, stage_key
from strategies import Microbatch, StepContext, assemble_strategy, strategy_class
from strategies.dflash import acceptance_from_correct, draft_block_logits, greedy_generate, speculative_generate
from strategies.losses import causal_nll_rows
from strategies.models import model_from_config_dir
from strategies.options import resolve_options
from strategies.sampling import SamplerConfig, trim_at_eos
from strategies.seeding import seeded_generator
from tasks.common import StageRef, code_version, prefect_task, store_for
from tasks.dflash_setup import draft_strategy, load_spec_target
from tasks.prepare_data import load_split, load_tokenizer
from tasks.runtime import resolve_device, tracking_for
from tasks.scoring import generative_perplexity, load_scorer, mean_entropy
from tasks.train import model_dir

STAGE = "evaluate"


def stage_of(
    spec: PipelineSpec, strategy: str, trained: StageRef, data: StageRef, workdir: str, **_
) -> tuple[str, str]:
    config = {"strategy": strategy, "eval": spec.eval.model_dump(mode="json")}
    settings = strategy_class(strategy).eval_settings(spec)  # e.g. DFlash's speculative decoding settings
    if settings:
        config["settings"] = settings
    key = stage_key(
        STAGE,
        config,
        {"train": trained.key, "data": data.key},
        code_version("strategies", "tasks.evaluate", "tasks.dflash_setup"),
    )
    return STAGE, key


def eval_artifact_path(key: str) -> str:
    """Each evaluation's artifacts under its own folder of the trained model's run: re-evaluating a
    model (another eval setting) never overwrites what an earlier pipeline run's report read."""
    return f"eval/{key[:12]}"


def ratio_with_se(sums: list[float], counts: list[int]) -> tuple[float, float]:
    """r = ΣS/Σn and its delta-method standard error over rows."""
    n = len(sums)
    total_n = sum(counts)
    r = sum(sums) / max(total_n, 1)
    if n < 2:
        return r, float("nan")
    mean_n = total_n / n
    var = sum((s - r * c) ** 2 for s, c in zip(sums, counts)) / (n * (n - 1))
    return r, math.sqrt(var) / mean_n


def fixed_noise_nelbo(
    strategy, model, ids, loss_mask, mask_token_id: int, t_samples: int, batch_size: int, seed: int
) -> tuple[float, float, int]:

    sums, counts = [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            x, lm = ids[start : start + batch_size], loss_mask[start : start + batch_size]
            gen = seeded_generator(seed * 1_000_003 + start, x.device)
            u = torch.rand(len(x), generator=gen, device=x.device)
            total = torch.zeros(len(x), device=x.device)
            for k in range(t_samples):
                t = ((k + u) / t_samples).clamp_min(1e-6)
                total += strategy.nelbo_rows(model, x, lm, mask_token_id, t, gen)
            sums.extend((total / t_samples).tolist())
            counts.extend(lm.sum(dim=1).long().tolist())
    nelbo, se = ratio_with_se(sums, counts)
    return nelbo, se, sum(counts)


def exact_ar_nll(strategy, model, ids, loss_mask, attention_mask, batch_size: int) -> tuple[float, float, int]:
    """Exact causal NLL per supervised token where the model has a causal path (I-DLM clean half)."""

    sums, counts = [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            sl = slice(start, start + batch_size)
            row_sums, row_counts = strategy.ar_nll_rows(model, ids[sl], loss_mask[sl], attention_mask[sl])
            sums.extend(row_sums.tolist())
            counts.extend(row_counts.long().tolist())
    nll, se = ratio_with_se(sums, counts)
    return nll, se, sum(counts)


def ar_nll_metrics(nll: float, se: float, n_tokens: int) -> dict:
    """The exact causal NLL's metric names (the same for every model that has a causal path)."""
    return {"eval/ar_nll": nll, "eval/ar_nll_se": se, "eval/ar_ppl": math.exp(min(nll, 50.0)), "eval/tokens": n_tokens}


def encode_prompts(tokenizer, texts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt: through the chat template (with generation prompt) for dialogue models."""
    if chat:
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in texts
        ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def sampler_config(spec: PipelineSpec, strategy, steps: int, eos_token_id: int | None):

    e = spec.eval
    return SamplerConfig(
        steps=steps,
        max_new_tokens=e.sample_length,
        block_size=e.sample_block_size,
        temperature=e.temperature,
        remasking="low_confidence",
        threshold=e.threshold,
        eos_token_id=eos_token_id,
        logit_shift=strategy.logit_shift,
    )


def draw_samples(
    strategy,
    model,
    tokenizer,
    mask_token_id: int,
    spec: PipelineSpec,
    prompts: list[list[int]],
    steps: int,
    device: str,
) -> tuple[list[list[int]], dict]:
    """Generated token ids (cut at EOS) for each prompt at one step budget, and the sampling-cost metrics."""

    cfg = sampler_config(spec, strategy, steps, tokenizer.eos_token_id)
    gen = torch.Generator(device=device).manual_seed(spec.eval.seed)
    t0 = time.perf_counter()
    result = strategy.sample(
        model,
        prompts,
        mask_token_id=mask_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
        config=cfg,
        generator=gen,
        device=device,
    )
    seconds = time.perf_counter() - t0
    ids = [trim_at_eos(result.generated(i), tokenizer.eos_token_id) for i in range(len(prompts))]
    per_row = spec.eval.sample_length
    stats = {
        "eval/nfe": float(result.nfe),
        "eval/tokens_per_forward": per_row / max(result.nfe, 1e-9),
        "eval/tokens_per_s": len(prompts) * per_row / seconds,
    }
    return ids, stats


def sample_quality(
    strategy, model, tokenizer, mask_token_id: int, spec: PipelineSpec, device: str, scorer=None
) -> tuple[dict, list[dict], str]:
    """Samples at every step budget of the quality-vs-NFE curve: (headline metrics at `sample_steps`,
    curve points, the headline samples as text). gen_ppl needs a scorer; entropy is always there."""

    e = spec.eval
    texts = list(e.prompts[: e.num_samples]) or ["O"]
    prompts = encode_prompts(tokenizer, texts, spec.data.shape == "dialogue")
    budgets = e.budgets()
    headline, curve, samples_text = {}, [], ""
    for steps in budgets:
        ids, stats = draw_samples(strategy, model, tokenizer, mask_token_id, spec, prompts, steps, device)
        decoded = [tokenizer.decode(i) for i in ids]
        point = {"steps": steps, **{k.split("/")[1]: v for k, v in stats.items()}, "entropy": mean_entropy(ids)}
        if scorer is not None:
            point["gen_ppl"], point["gen_ppl_tokens"] = generative_perplexity(*scorer, list(zip(texts, decoded)))
        curve.append(point)
        if steps == budgets[0]:
            headline = {f"eval/{k}": v for k, v in point.items() if k not in ("steps", "gen_ppl_tokens")}
            samples_text = "\n\n".join(f"### prompt: {p!r}\n{t}" for p, t in zip(texts, decoded))
    return headline, curve, samples_text


# Card fields that change a result: two evaluations that differ on one are not silently compared.
RESULT_FIELDS = (
    "data_key",
    "eval.val_rows",
    "eval.t_samples",
    "eval.batch_size",
    "eval.seed",
    "sampler.steps",
    "sampler.max_new_tokens",
    "sampler.block_size",
    "sampler.temperature",
    "sampler.remasking",
    "sampler.threshold",
    "eval.nfe_budgets",
    "eval.prompts",
    "scorer",
    "dtype",
    "device",
    "versions.torch",
    "versions.transformers",
)


def repro_card(
    spec: PipelineSpec,
    strategy_name: str,
    strategy,
    model,
    ckpt: Path,
    data_key: str,
    device: str,
    eos_token_id: int | None,
) -> dict:
    """Everything needed to reproduce (or refuse to compare) this evaluation's numbers."""

    e = spec.eval
    sampler = asdict(sampler_config(spec, strategy, e.sample_steps, eos_token_id))
    return {
        "strategy": strategy_name,
        "sampler_name": strategy.sampler_name,
        "sampler": sampler,
        "eval": {
            "val_rows": e.val_rows,
            "t_samples": e.t_samples,
            "batch_size": e.batch_size,
            "seed": e.seed,
            "nfe_budgets": e.budgets(),
            "prompts": list(e.prompts[: e.num_samples]),
        },
        "train_seed": spec.train.seed,
        "data_key": data_key,
        "scorer": e.scorer.model_dump(mode="json") if e.scorer else None,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": device,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "checkpoint_digest": sha256_file(ckpt / DIGESTS) if (ckpt / DIGESTS).is_file() else None,
    }


@dataclass(frozen=True)
class Evaluation:
    """What an evaluation reads: the trained model and its tokenizer, the validation rows, the scorer."""

    spec: PipelineSpec
    strategy: str
    model: torch.nn.Module
    tokenizer: object
    mask_id: int
    ckpt: Path
    val: tuple  # (ids, loss_mask, attention_mask) of the first `eval.val_rows` validation rows
    device: str
    scorer: tuple | None

    @property
    def options(self):
        return resolve_options(self.spec, self.strategy)


@dataclass
class EvalResult:
    strategy: object  # the assembled strategy (its sampler goes on the reproducibility card)
    metrics: dict
    curve: list
    samples: str
    files: dict = field(default_factory=dict)  # further artifacts, name → text


def _write_result(ev: Evaluation, result: EvalResult, data_key: str, out: Path) -> None:
    card = repro_card(
        ev.spec, ev.strategy, result.strategy, ev.model, ev.ckpt, data_key, ev.device, ev.tokenizer.eos_token_id
    )
    files = {
        "metrics.json": json.dumps(result.metrics, indent=2),
        "samples.txt": result.samples,
        "curve.json": json.dumps(result.curve, indent=2),
        "repro_card.json": json.dumps(card, indent=2, sort_keys=True),
        **result.files,
    }
    for name, content in files.items():
        (out / name).write_text(content)


def _log_to_training_run(spec: PipelineSpec, trained: StageRef, entry, workdir: str) -> None:
    """Metrics on the trained model's run, the quality-vs-NFE curve, artifacts under `eval/<key>/`."""
    metrics = json.loads((entry.path / "metrics.json").read_text())
    curve = json.loads((entry.path / "curve.json").read_text())
    tracker = tracking_for(spec, workdir).reopen(trained.mlflow_run_id)
    tracker.log_metrics(metrics, step=spec.train.steps)
    for point in curve:  # the quality-vs-NFE curve, one MLflow step per step budget
        tracker.log_metrics({f"eval_curve/{k}": v for k, v in point.items() if k != "steps"}, step=point["steps"])
    for name in sorted(entry.manifest["files"]):
        tracker.log_artifact(entry.path / name, eval_artifact_path(entry.key))
    tracker.close()


def evaluate(spec: PipelineSpec, strategy: str, trained: StageRef, data: StageRef, workdir: str) -> StageRef:
    """Evaluate the trained model (or reuse the published evaluation) and log it to the model's run."""
    stage, key = stage_of(spec, strategy, trained, data, workdir)

    def build(out: Path) -> dict:
        device = resolve_device(spec.train.device)
        ckpt = model_dir(trained)
        scorer = load_scorer(spec.eval.scorer, workdir) if spec.eval.scorer is not None else None
        val = tuple(t[: spec.eval.val_rows].to(device) for t in load_split(data.path, "val"))
        ev = Evaluation(
            spec,
            strategy,
            _load_model(ckpt, device),
            load_tokenizer(str(ckpt)),
            read_meta(ckpt)["mask_token_id"],
            ckpt,
            val,
            device,
            scorer,
        )
        run = dflash_evaluation if strategy_class(strategy).evaluation == "speculative" else _dllm_evaluation
        result = run(ev)
        _write_result(ev, result, data.key, out)
        info = {"metrics": result.metrics, "train_run_id": trained.mlflow_run_id}
        return {"strategy": strategy, "upstream": {"train": trained.key}, "info": info}

    entry, reused = store_for(workdir).reuse_or_build(stage, key, build)
    if not reused and trained.mlflow_run_id:
        _log_to_training_run(spec, trained, entry, workdir)
    return _ref(entry, strategy, reused)


def _dllm_evaluation(ev: Evaluation) -> EvalResult:
    """Bound / exact NLL on validation rows, then samples over the step budgets."""
    spec, (ids, loss_mask, attn) = ev.spec, ev.val
    built = assemble_strategy(ev.strategy, ev.options, ev.model, ev.tokenizer, mask_token_id=ev.mask_id)
    strat, mask_id = built.strategy, built.mask_token_id
    metrics: dict = {}
    if "nelbo" in strat.likelihoods:  # strategies with a diffusion ELBO
        nelbo, se, n_tokens = fixed_noise_nelbo(
            strat, ev.model, ids, loss_mask, mask_id, spec.eval.t_samples, spec.eval.batch_size, spec.eval.seed
        )
        metrics.update(
            {
                "eval/nelbo": nelbo,
                "eval/nelbo_se": se,
                "eval/ppl_bound": math.exp(min(nelbo, 50.0)),
                "eval/tokens": n_tokens,
            }
        )
    if "ar_nll" in strat.likelihoods:  # strategies with an exact causal path
        metrics.update(ar_nll_metrics(*exact_ar_nll(strat, ev.model, ids, loss_mask, attn, spec.eval.batch_size)))
    headline, curve, text = sample_quality(strat, ev.model, ev.tokenizer, mask_id, spec, ev.device, ev.scorer)
    metrics.update(headline)
    return EvalResult(strat, metrics, curve, text)


# ------------------------------------------------------------------ DFlash (evaluation spec §4.7)


def teacher_forced_acceptance(
    strat, draft, ids, loss_mask, attn, mask_id: int, batch_size: int, seed: int
) -> tuple[float, list[float], int]:
    """τ_sim and acc_k over validation rows: anchors drawn with the eval seed, the target's features
    computed online, the draft's argmax compared with the true continuation (no generation)."""

    bs = strat.block_size
    ctx = StepContext(model=draft, loss_fn=None, mask_token_id=mask_id, step=0, base_seed=seed)
    corrects, masks = [], []
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            sl = slice(start, start + batch_size)
            mb = Microbatch(ids[sl], loss_mask[sl], attn[sl], torch.arange(start, start + len(ids[sl])), "val")
            (batch,), _, _ = strat.pre_step(ctx, [mb])
            e = batch.extras
            logits = draft_block_logits(draft, strat.target, e.features, e.anchors, e.keep, e.block_ids)
            b, n = e.anchors.shape
            pred = logits.view(b, n, bs, -1)[:, :, 1:].argmax(-1).reshape(b, -1)
            corrects.append(pred == e.targets)
            masks.append(e.block_mask)
    correct, block_mask = torch.cat(corrects), torch.cat(masks)
    tau, acc = acceptance_from_correct(correct, block_mask, bs)
    return tau, acc, int((block_mask.reshape(-1, bs - 1)[:, 0] > 0).sum())


def speculative_prompts(ids, attn, count: int, length: int) -> list[list[int]]:
    """Held-out prompts: the first `length` tokens of `count` validation rows spread over the split."""
    rows = [r for r in range(len(ids)) if int(attn[r].sum()) >= length + 1]
    if not rows:
        raise ValueError(f"no validation row has more than dflash.eval_prompt_len={length} tokens; lower it")
    stride = max(len(rows) // count, 1)
    return [ids[r, :length].tolist() for r in rows[::stride][:count]]


def speculative_benchmark(
    target, draft, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None
) -> dict:
    """Real τ, output equality with target-only greedy decoding, and the decode-time ratio, same prompts,
    same run: one warm-up call each, then the two decoders alternate prompt by prompt so machine drift
    hits both alike."""

    greedy_generate(target, prompts[0], 4, eos_token_id)
    speculative_generate(target, draft, prompts[0], 4, eos_token_id)
    greedy, spec, t_greedy, t_spec = [], [], 0.0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        greedy.append(greedy_generate(target, p, max_new_tokens, eos_token_id))
        t1 = time.perf_counter()
        spec.append(speculative_generate(target, draft, p, max_new_tokens, eos_token_id))
        t_greedy, t_spec = t_greedy + t1 - t0, t_spec + time.perf_counter() - t1
    acceptance = [a for r in spec for a in r.acceptance]
    tokens = sum(len(r.tokens) for r in spec)
    return {
        "tau": sum(acceptance) / max(len(acceptance), 1),
        "speedup": t_greedy / t_spec,
        "exact_match": sum(r.tokens == g for r, g in zip(spec, greedy)) / len(prompts),
        "target_forwards": sum(r.target_forwards for r in spec),
        "tokens": tokens,
        "greedy_seconds": t_greedy,
        "speculative_seconds": t_spec,
        "histogram": dict(sorted(Counter(acceptance).items())),
        "outputs": [r.tokens for r in spec],
    }


def dflash_evaluation(ev: Evaluation) -> EvalResult:
    """DFlash metrics: τ_sim and acc_k (teacher-forced), real τ and speedup from speculative decoding
    checked token for token against target-only greedy, the target's exact NLL, and samples."""
    spec, draft, tokenizer, device, scorer = ev.spec, ev.model, ev.tokenizer, ev.device, ev.scorer
    ids, loss_mask, attn = ev.val
    d = spec.dflash
    target = load_spec_target(spec, read_meta(ev.ckpt)["target"]["path"], device)
    built = draft_strategy(ev.strategy, ev.options, draft, tokenizer, target, mask_token_id=ev.mask_id)
    strat, mask_id = built.strategy, built.mask_token_id
    draft.eval()
    tau_sim, acc, blocks = teacher_forced_acceptance(
        strat, draft, ids, loss_mask, attn, mask_id, spec.eval.batch_size, spec.eval.seed
    )
    nll, se, n_tokens = exact_ar_nll(_CausalTarget(), target, ids, loss_mask, attn, spec.eval.batch_size)
    bench = speculative_benchmark(
        target,
        draft,
        speculative_prompts(ids, attn, d.eval_prompts, d.eval_prompt_len),
        d.eval_max_new_tokens,
        tokenizer.eos_token_id,
    )
    # the report's shared columns, from speculative decoding of the report's text prompts (no timing
    # or greedy check needed here: the benchmark above did both)
    texts = list(spec.eval.prompts[: spec.eval.num_samples]) or ["O"]
    shown = [
        speculative_generate(target, draft, p, spec.eval.sample_length, tokenizer.eos_token_id).tokens
        for p in encode_prompts(tokenizer, texts, spec.data.shape == "dialogue")
    ]
    decoded = [tokenizer.decode(t) for t in shown]
    metrics = {
        "dflash/tau_sim": tau_sim,
        **{f"dflash/acc_k{k + 1}": a for k, a in enumerate(acc)},
        "dflash/blocks": blocks,
        "dflash/tau": bench["tau"],
        "dflash/speedup": bench["speedup"],
        "dflash/exact_match": bench["exact_match"],
        **ar_nll_metrics(nll, se, n_tokens),
        "eval/nfe": bench["target_forwards"] / len(bench["outputs"]),
        "eval/tokens_per_forward": bench["tokens"] / max(bench["target_forwards"], 1),
        "eval/tokens_per_s": bench["tokens"] / bench["speculative_seconds"],
        "eval/entropy": mean_entropy(shown),
    }
    if scorer is not None:
        metrics["eval/gen_ppl"], _ = generative_perplexity(*scorer, list(zip(texts, decoded)))
    text = "\n\n".join(f"### prompt: {p!r}\n{t}" for p, t in zip(texts, decoded))
    report = {k: v for k, v in bench.items() if k != "outputs"}
    return EvalResult(strat, metrics, [], text, {"speculative.json": json.dumps(report, indent=2)})


class _CausalTarget:
    """`exact_ar_nll` over a plain causal LM (the DFlash target)."""

    @staticmethod
    def ar_nll_rows(model, ids, loss_mask, attention_mask):

        return causal_nll_rows(
            model(input_ids=ids, attention_mask=attention_mask).logits, ids, loss_mask, attention_mask
        )


def _load_model(ckpt: Path, device: str):

    model = model_from_config_dir(ckpt)
    load_weights_into(model, ckpt)  # verifies every digest first
    return model.to(device).eval()


def _ref(entry, strategy: str, reused: bool) -> StageRef:
    info = entry.manifest["info"]
    return StageRef(
        f"evaluate[{strategy}]",
        entry.key,
        str(entry.path),
        reused=reused,
        mlflow_run_id=info.get("train_run_id"),
        info=info,
    )


evaluate_task = prefect_task(evaluate, name="evaluate", stage_of=stage_of)
