"""Stage `evaluate[strategy]`: likelihood metrics on validation rows, sample quality and sampling
cost at several step budgets, and a reproducibility card (evaluation spec, metric names shared).

NELBO (evaluation spec §4.1): for each row, K stratified times t_k = (k + u)/K over the full
range (0, 1), u seeded per batch; the one-sample estimate (1/t)·Σ_{masked ∧ supervised} −log p_θ
is averaged over k. `eval/nelbo` = Σ_rows S_i / Σ_rows n_i (nats per supervised token) with the
ratio estimator's standard error; `eval/ppl_bound` = exp(nelbo) bounds the perplexity.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from dllm_common.config import PipelineSpec
from dllm_common.store import stage_key
from tasks.common import StageRef, code_version, prefect_task, store_for

STAGE = "evaluate"


def stage_of(spec: PipelineSpec, strategy: str, trained: StageRef, data: StageRef, workdir: str, **_) -> tuple[str, str]:
    key = stage_key(STAGE, {"strategy": strategy, "eval": spec.eval.model_dump(mode="json")},
                    {"train": trained.key, "data": data.key}, code_version("strategies", "tasks.evaluate"))
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


def fixed_noise_nelbo(strategy, model, ids, loss_mask, mask_token_id: int, t_samples: int, batch_size: int,
                      seed: int) -> tuple[float, float, int]:
    import torch

    from strategies.seeding import seeded_generator

    sums, counts = [], []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(ids), batch_size):
            x, lm = ids[start:start + batch_size], loss_mask[start:start + batch_size]
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
    import torch

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


def encode_prompts(tokenizer, texts: list[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt: through the chat template (with generation prompt) for dialogue models."""
    if chat:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 for p in texts]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def sampler_config(spec: PipelineSpec, strategy, steps: int, eos_token_id: int | None):
    from strategies.sampling import SamplerConfig

    e = spec.eval
    return SamplerConfig(steps=steps, max_new_tokens=e.sample_length, block_size=e.sample_block_size,
                         temperature=e.temperature, remasking="low_confidence", threshold=e.threshold,
                         eos_token_id=eos_token_id, logit_shift=strategy.logit_shift)


def draw_samples(strategy, model, tokenizer, mask_token_id: int, spec: PipelineSpec, prompts: list[list[int]],
                 steps: int, device: str) -> tuple[list[list[int]], dict]:
    """Generated token ids (cut at EOS) for each prompt at one step budget, and the sampling-cost metrics."""
    import torch

    from strategies.sampling import trim_at_eos

    cfg = sampler_config(spec, strategy, steps, tokenizer.eos_token_id)
    gen = torch.Generator(device=device).manual_seed(spec.eval.seed)
    t0 = time.perf_counter()
    result = strategy.sample(model, prompts, mask_token_id=mask_token_id, pad_token_id=tokenizer.pad_token_id or 0,
                             config=cfg, generator=gen, device=device)
    seconds = time.perf_counter() - t0
    ids = [trim_at_eos(result.generated(i), tokenizer.eos_token_id) for i in range(len(prompts))]
    per_row = spec.eval.sample_length
    stats = {"eval/nfe": float(result.nfe), "eval/tokens_per_forward": per_row / max(result.nfe, 1e-9),
             "eval/tokens_per_s": len(prompts) * per_row / seconds}
    return ids, stats


def sample_quality(strategy, model, tokenizer, mask_token_id: int, spec: PipelineSpec, device: str, scorer=None
                   ) -> tuple[dict, list[dict], str]:
    """Samples at every step budget of the quality-vs-NFE curve: (headline metrics at `sample_steps`,
    curve points, the headline samples as text). gen_ppl needs a scorer; entropy is always there."""
    from tasks.scoring import generative_perplexity, mean_entropy

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
RESULT_FIELDS = ("data_key", "eval.val_rows", "eval.t_samples", "eval.batch_size", "eval.seed", "sampler.steps",
                 "sampler.max_new_tokens", "sampler.block_size", "sampler.temperature", "sampler.remasking",
                 "sampler.threshold", "eval.nfe_budgets", "eval.prompts", "scorer", "dtype", "device",
                 "versions.torch", "versions.transformers")


def repro_card(spec: PipelineSpec, strategy_name: str, strategy, model, ckpt: Path, data_key: str, device: str,
               eos_token_id: int | None) -> dict:
    """Everything needed to reproduce (or refuse to compare) this evaluation's numbers."""
    import platform
    from dataclasses import asdict

    import torch
    import transformers

    from dllm_common.checkpoint import DIGESTS
    from dllm_common.store import sha256_file

    e = spec.eval
    sampler = asdict(sampler_config(spec, strategy, e.sample_steps, eos_token_id))
    return {
        "strategy": strategy_name, "sampler_name": strategy.sampler_name, "sampler": sampler,
        "eval": {"val_rows": e.val_rows, "t_samples": e.t_samples, "batch_size": e.batch_size, "seed": e.seed,
                 "nfe_budgets": e.budgets(), "prompts": list(e.prompts[: e.num_samples])},
        "train_seed": spec.train.seed, "data_key": data_key,
        "scorer": e.scorer.model_dump(mode="json") if e.scorer else None,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "device": device,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "checkpoint_digest": sha256_file(ckpt / DIGESTS) if (ckpt / DIGESTS).is_file() else None,
    }


def evaluate(spec: PipelineSpec, strategy: str, trained: StageRef, data: StageRef, workdir: str) -> StageRef:
    import torch

    from dllm_common.checkpoint import read_meta
    from dllm_common.tracking import Tracking
    from tasks.prepare_data import load_split, load_tokenizer
    from tasks.train import model_dir, prepare_strategy, resolve_device

    store = store_for(workdir)
    stage, key = stage_of(spec, strategy, trained, data, workdir)
    if (hit := store.lookup(stage, key)) is not None:
        return _ref(hit, strategy, reused=True)
    device = resolve_device(spec.train.device)
    ckpt = model_dir(trained)
    model = _load_model(ckpt, device)
    tokenizer = load_tokenizer(str(ckpt))
    mask_id = read_meta(ckpt)["mask_token_id"]
    ids, loss_mask, attn = (t[: spec.eval.val_rows].to(device) for t in load_split(data.path, "val"))
    strat, _, mask_id = prepare_strategy(strategy, spec, model, tokenizer, mask_id)
    metrics: dict = {}
    if hasattr(strat, "nelbo_rows"):  # strategies with a diffusion ELBO
        nelbo, se, n_tokens = fixed_noise_nelbo(strat, model, ids, loss_mask, mask_id, spec.eval.t_samples,
                                                spec.eval.batch_size, spec.eval.seed)
        metrics.update({"eval/nelbo": nelbo, "eval/nelbo_se": se, "eval/ppl_bound": math.exp(min(nelbo, 50.0)),
                        "eval/tokens": n_tokens})
    if hasattr(strat, "ar_nll_rows"):  # strategies with an exact causal path
        nll, se, n_tokens = exact_ar_nll(strat, model, ids, loss_mask, attn, spec.eval.batch_size)
        metrics.update({"eval/ar_nll": nll, "eval/ar_nll_se": se, "eval/ar_ppl": math.exp(min(nll, 50.0)),
                        "eval/tokens": n_tokens})
    scorer = None
    if spec.eval.scorer is not None:
        from tasks.scoring import load_scorer

        scorer = load_scorer(spec.eval.scorer, workdir)
    headline, curve, text = sample_quality(strat, model, tokenizer, mask_id, spec, device, scorer)
    metrics.update(headline)
    card = repro_card(spec, strategy, strat, model, ckpt, data.key, device, tokenizer.eos_token_id)
    with store.publish(STAGE, key, {"strategy": strategy, "upstream": {"train": trained.key},
                                    "info": {"metrics": metrics, "train_run_id": trained.mlflow_run_id}}) as tmp:
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2))
        (tmp / "samples.txt").write_text(text)
        (tmp / "curve.json").write_text(json.dumps(curve, indent=2))
        (tmp / "repro_card.json").write_text(json.dumps(card, indent=2, sort_keys=True))
    entry = store.lookup(STAGE, key)
    if trained.mlflow_run_id:
        tracking = Tracking(Path(workdir), spec.tracking.uri, spec.tracking.experiment or spec.pipeline.name)
        tracker = tracking.reopen(trained.mlflow_run_id)
        tracker.log_metrics(metrics, step=spec.train.steps)
        for point in curve:  # the quality-vs-NFE curve, one MLflow step per step budget
            tracker.log_metrics({f"eval_curve/{k}": v for k, v in point.items() if k != "steps"}, step=point["steps"])
        for name in ("metrics.json", "samples.txt", "curve.json", "repro_card.json"):
            tracker.log_artifact(entry.path / name, eval_artifact_path(key))
        tracker.close()
    return _ref(entry, strategy, reused=False)


def _load_model(ckpt: Path, device: str):
    from dllm_common.checkpoint import load_weights_into
    from strategies.models import model_from_config_dir

    model = model_from_config_dir(ckpt)
    load_weights_into(model, ckpt)  # verifies every digest first
    return model.to(device).eval()


def _ref(entry, strategy: str, reused: bool) -> StageRef:
    info = entry.manifest["info"]
    return StageRef(f"evaluate[{strategy}]", entry.key, str(entry.path), reused=reused,
                    mlflow_run_id=info.get("train_run_id"), info=info)


evaluate_task = prefect_task(evaluate, name="evaluate", stage_of=stage_of)
