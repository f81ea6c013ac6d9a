"""Stage `evaluate[strategy]`: fixed-noise NELBO on validation rows plus a few samples.

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


def draw_samples(strategy, model, tokenizer, mask_token_id: int, spec: PipelineSpec, chat: bool, device: str):
    import torch

    from strategies.sampling import SamplerConfig, trim_at_eos

    e = spec.eval
    prompts_text = list(e.prompts[: e.num_samples]) or ["O"]
    if chat:
        encoded = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                   for p in prompts_text]
        prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in encoded]
    else:
        prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts_text]
    cfg = SamplerConfig(steps=e.sample_steps, max_new_tokens=e.sample_length, block_size=e.sample_block_size,
                        temperature=e.temperature, remasking="low_confidence", eos_token_id=tokenizer.eos_token_id,
                        logit_shift=strategy.logit_shift)
    gen = torch.Generator(device=device).manual_seed(e.seed)
    t0 = time.perf_counter()
    result = strategy.sample(model, prompts, mask_token_id=mask_token_id, pad_token_id=tokenizer.pad_token_id or 0,
                             config=cfg, generator=gen, device=device)
    seconds = time.perf_counter() - t0
    texts = [tokenizer.decode(trim_at_eos(result.generated(i), tokenizer.eos_token_id)) for i in range(len(prompts))]
    n_tokens = len(prompts) * e.sample_length
    stats = {"eval/nfe": result.nfe, "eval/tokens_per_forward": n_tokens / max(result.nfe, 1) / len(prompts),
             "eval/tokens_per_s": n_tokens / seconds}
    return list(zip(prompts_text, texts)), stats


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
    samples, sample_stats = draw_samples(strat, model, tokenizer, mask_id, spec, spec.data.shape == "dialogue", device)
    metrics.update(sample_stats)
    text = "\n\n".join(f"### prompt: {p!r}\n{t}" for p, t in samples)
    with store.publish(STAGE, key, {"strategy": strategy, "upstream": {"train": trained.key},
                                    "info": {"metrics": metrics, "train_run_id": trained.mlflow_run_id}}) as tmp:
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=2))
        (tmp / "samples.txt").write_text(text)
    entry = store.lookup(STAGE, key)
    if trained.mlflow_run_id:
        tracking = Tracking(Path(workdir), spec.tracking.uri, spec.tracking.experiment or spec.pipeline.name)
        tracker = tracking.reopen(trained.mlflow_run_id)
        tracker.log_metrics(metrics, step=spec.train.steps)
        tracker.log_artifact(entry.path / "samples.txt", "eval")
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
