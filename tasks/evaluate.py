"""Stage `evaluate[strategy]`: likelihood metrics on validation rows, sample quality and sampling
cost at several step budgets, and a reproducibility card (docs/evaluation.md; metric names shared by
every strategy). The likelihood estimators are in `tasks.evaluation.likelihood`; a strategy evaluated by
acceptance instead (`evaluation == "speculative"`, DFlash) goes through `tasks.speculative.acceptance`. With
`eval.lm_eval` set, lm-evaluation-harness tasks run on the trained model too (`tasks.evaluation.lm_eval_model`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch
import transformers

from dllm_common.checkpoint import DIGESTS, checkpoint_digest, read_meta
from dllm_common.config import ConfigError, PipelineSpec, canonical_json, context_overflow
from dllm_common.harness_tasks import LMEVAL_MISSING
from dllm_common.store import stage_key
from strategies import assemble_strategy, strategy_class
from strategies.base_evaluation import SampleRequest
from strategies.registry import SAMPLERS
from strategies.sampling import SamplerConfig, trim_at_eos
from tasks.common import StageRef, prefect_task, stage_code_version, store_for, tracking_for
from tasks.data.tokenizer import load_tokenizer
from tasks.devices import resolve_device
from tasks.evaluation.chat import accuracy_metrics, answer_stats, held_out_problems
from tasks.evaluation.context import sampling_context
from tasks.evaluation.data_row import data_row_metrics
from tasks.evaluation.likelihood import (
    EvalResult,
    Evaluation,
    ar_nll_metrics,
    bits_per_byte,
    encode_prompts,
    exact_ar_nll,
    fixed_noise_nelbo,
    supervised_bytes,
)
from tasks.evaluation.scoring import gen_ppl_with_interval, load_scorer, mean_entropy, prompt_nll
from tasks.evaluation.trained_model import checkpoint_tokenizer, load_trained_model
from tasks.rows import document_ids, load_split, open_doc_starts
from tasks.speculative.acceptance import dflash_evaluation
from tasks.train import model_dir

__all__ = ["encode_prompts", "evaluate", "evaluate_task", "stage_of"]

STAGE = "evaluate"


def eval_slice(spec: PipelineSpec, strategy: str) -> dict:
    """The settings an evaluation of `strategy` runs with (its key's config part, recorded on the MLflow run its
    metrics land in): `eval:` with the strategy's overrides, the strategy's own evaluation settings, lm-eval's
    versions."""
    spec = for_strategy(spec, strategy)
    harness = spec.eval.lm_eval
    config = {
        "strategy": strategy,
        "eval": spec.eval.model_dump(mode="json", exclude={"lm_eval"} if harness is None else None),
    }
    settings = strategy_class(strategy).eval_settings(spec)  # e.g. DFlash's speculative decoding settings
    if settings:
        config["settings"] = settings
    if harness is not None:
        config["lm_eval"] = harness_versions(harness.include_path)
    return config


def code_key(spec: PipelineSpec, strategy: str, train_key: str, data_key: str) -> str:
    """The evaluation's key less the checkpoint's content digest: what the settings, the training's key and the
    code decide, computable before any training (docs/results/quickstart.json records it)."""
    upstream = {"train": train_key, "data": data_key}
    return stage_key(STAGE, eval_slice(spec, strategy), upstream, stage_code_version(__name__, strategy))


def stage_of(
    spec: PipelineSpec, strategy: str, trained: StageRef, data: StageRef, workdir: str, **_
) -> tuple[str, str]:
    config = eval_slice(spec, strategy)
    # the checkpoint's content digest: a training rebuilt bit for bit (a damaged entry) keeps its evaluations,
    # one rebuilt with other weights (another machine's numerics) is evaluated again
    upstream = {"train": trained.key, "checkpoint": checkpoint_digest(model_dir(trained)), "data": data.key}
    return STAGE, stage_key(STAGE, config, upstream, stage_code_version(__name__, strategy))


def for_strategy(spec: PipelineSpec, strategy: str) -> PipelineSpec:
    """The spec as `strategy` is evaluated: `eval.overrides.<strategy>` applied to `eval:`."""
    return spec.model_copy(update={"eval": spec.eval.for_strategy(strategy)})


def harness_versions(include_path: str | None) -> dict:
    """What else decides lm-eval numbers: the harness's version and the bytes of the local task files."""
    try:
        versions = {"lm_eval": importlib.metadata.version("lm_eval")}
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(LMEVAL_MISSING) from None
    if include_path is not None:
        h = hashlib.sha256()
        root = Path(include_path)
        for f in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
        versions["include_path_sha256"] = h.hexdigest()
    return versions


def check_samples_fit(spec: PipelineSpec, data: StageRef) -> None:
    """Each eval prompt, tokenized as evaluation will, plus `eval.sample_length` fits the context of the model that
    samples it (the rule and wording of `dllm-flow generate`'s own check). Run once the data's tokenizer exists and
    before any training: a sample beyond the context decodes for minutes and means nothing. Config load has
    already refused what the config alone shows (dllm_common/config/spec.py: PipelineSpec)."""
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    e = spec.eval
    texts = list(e.prompts[: e.num_samples]) or ["O"]
    prompts = encode_prompts(tokenizer, texts, spec.data.shape == "dialogue")
    labels = [f"eval.prompts[{i}] {t!r}" if e.num_samples else f"the default prompt {t!r}" for i, t in enumerate(texts)]
    for strategy in spec.pipeline.strategies:
        context, context_of = sampling_context(spec, strategy)
        if context is None:
            continue
        for label, ids in zip(labels, prompts):
            problem = context_overflow(
                len(ids), e.sample_length, context, prompt=label, new="eval.sample_length", context_of=context_of
            )
            if problem:
                raise ConfigError(f"{problem} (evaluate[{strategy}]'s samples)")


def eval_artifact_path(key: str) -> str:
    """Each evaluation's artifacts under its own folder of the trained model's run: re-evaluating a
    model (another eval setting) never overwrites what an earlier pipeline run's report read."""
    return f"eval/{key[:12]}"


def sampler_config(spec: PipelineSpec, strategy, steps: int, eos_token_id: int | None, greedy: bool = False):
    """The sampler settings of `eval:` (`greedy`: the same at temperature 0, for the report's second table)."""
    e = spec.eval
    return SamplerConfig(
        steps=steps,
        max_new_tokens=e.sample_length,
        block_size=e.sample_block_size,
        temperature=0.0 if greedy else e.temperature,
        top_k=e.top_k,
        top_p=e.top_p,
        remasking=e.remasking,
        threshold=e.threshold,
        eos_token_id=eos_token_id,
        logit_shift=strategy.logit_shift,
        # speculative decoding's context lookup (docs/strategies.md §10.8): recorded on the card, compared
        lookup_ngram=spec.dflash.lookup_ngram if strategy.evaluation == "speculative" else 0,
    )


def draw_samples(
    ev: Evaluation, strategy, mask_token_id: int, prompts: list[list[int]], steps: int, greedy: bool = False
) -> tuple[list[list[int]], dict]:
    """Generated token ids (cut at EOS) for each prompt at one step budget, and the sampling-cost metrics."""
    spec, model, tokenizer, device = ev.spec, ev.model, ev.tokenizer, ev.device
    cfg = sampler_config(spec, strategy, steps, tokenizer.eos_token_id, greedy)
    gen = torch.Generator(device=device).manual_seed(spec.eval.seed)
    t0 = time.perf_counter()
    request = SampleRequest(prompts, mask_token_id, tokenizer.pad_token_id or 0, cfg, gen, device)
    result = strategy.sample(model, request)
    seconds = time.perf_counter() - t0
    ids = [trim_at_eos(result.generated(i), tokenizer.eos_token_id) for i in range(len(prompts))]
    per_row = spec.eval.sample_length
    stats = {
        "eval/nfe": float(result.nfe),
        "eval/tokens_per_forward": per_row / max(result.nfe, 1e-9),
        "eval/tokens_per_s": len(prompts) * per_row / seconds,
    }
    if result.revised is not None:  # samplers that can change a token after placing it (SCDD)
        stats["eval/revised_tokens"] = float(result.revised)
    if spec.data.shape == "dialogue":  # how a chat model's answers end (docs/post-training.md, "Evaluation")
        raw = [result.generated(i).tolist() for i in range(len(prompts))]
        stats.update(answer_stats(raw, tokenizer.eos_token_id))
    return ids, stats


def sample_quality(ev: Evaluation, strategy, mask_token_id: int) -> tuple[dict, list[dict], str]:
    """Samples at every step budget of the quality-vs-NFE curve: (headline metrics at `sample_steps`,
    curve points, the headline samples as text). gen_ppl needs a scorer; entropy is always there."""
    spec, tokenizer, scorer = ev.spec, ev.tokenizer, ev.scorer
    e = spec.eval
    texts = list(e.prompts[: e.num_samples]) or ["O"]
    prompts = encode_prompts(tokenizer, texts, spec.data.shape == "dialogue")
    budgets = e.budgets()

    def point_at(steps: int, greedy: bool = False) -> tuple[dict, str]:
        ids, stats = draw_samples(ev, strategy, mask_token_id, prompts, steps, greedy)
        decoded = [tokenizer.decode(i) for i in ids]
        point = {"steps": steps, **{k.split("/")[1]: v for k, v in stats.items()}, "entropy": mean_entropy(ids)}
        if scorer is not None:
            point.update(gen_ppl_with_interval(*prompt_nll(*scorer, list(zip(texts, decoded)))))
        return point, "\n\n".join(f"### prompt: {p!r}\n{t}" for p, t in zip(texts, decoded))

    headline, curve, samples_text = {}, [], ""
    for steps in budgets:
        point, text = point_at(steps)
        curve.append(point)
        if steps == budgets[0]:
            headline = {f"eval/{k}": v for k, v in point.items() if k not in ("steps", "gen_ppl_tokens")}
            samples_text = text
    if e.greedy and e.temperature > 0:  # the report's second table: the same budget at temperature 0
        point, text = point_at(budgets[0], greedy=True)
        headline.update({f"eval/greedy_{k}": point[k] for k in GREEDY_KEYS if k in point})
        samples_text += "\n\n## greedy (temperature 0)\n\n" + text
    headline.update(data_row_metrics(ev, prompts))
    return headline, curve, samples_text


# what the greedy second table keeps of a sample point (logged as eval/greedy_<key>)
GREEDY_KEYS = ("gen_ppl", "gen_ppl_lo", "gen_ppl_hi", "entropy", "revised_tokens")


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
    "sampler.top_k",
    "sampler.top_p",
    "sampler.remasking",
    "sampler.threshold",
    "sampler.lookup_ngram",
    "eval.nfe_budgets",
    "eval.prompts",
    "eval.data_rows",
    "eval.greedy",
    "scorer",
    "dtype",
    "device",
    "versions.torch",
    "versions.transformers",
)


def repro_card(ev: Evaluation, strategy, data_key: str) -> dict:
    """Everything needed to reproduce (or refuse to compare) this evaluation's numbers."""
    spec, strategy_name, model, ckpt, device = ev.spec, ev.strategy, ev.model, ev.ckpt, ev.device
    eos_token_id = ev.tokenizer.eos_token_id
    e = spec.eval
    sampler = asdict(sampler_config(spec, strategy, e.sample_steps, eos_token_id))
    card = {
        "strategy": strategy_name,
        "sampler_name": strategy.sampler_name,
        "sampler": sampler,
        # the settings of `sampler` that the strategy's own sampler reads (its registration's `SamplerInfo`)
        "sampler_settings": list(SAMPLERS[strategy.samplers[0]].settings),
        "eval": {
            "val_rows": e.val_rows,
            "t_samples": e.t_samples,
            "batch_size": e.batch_size,
            "seed": e.seed,
            "nfe_budgets": e.budgets(),
            "prompts": list(e.prompts[: e.num_samples]),
            "data_rows": e.data_rows,
            "greedy": e.greedy,
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
        "checkpoint_digest": checkpoint_digest(ckpt) if (ckpt / DIGESTS).is_file() else None,
    }
    if strategy_name in e.overrides:  # the sampler settings this strategy sets itself: deliberate, not a mismatch
        card["sampler_overrides"] = sorted(e.overrides[strategy_name].values())
    if e.lm_eval is not None:  # only then: cards of evaluations without harness tasks are unchanged
        card["lm_eval"] = {**e.lm_eval.model_dump(mode="json"), **harness_versions(e.lm_eval.include_path)}
    return card


def _write_result(ev: Evaluation, result: EvalResult, data_key: str, out: Path) -> None:
    card = repro_card(ev, result.strategy, data_key)
    files = {
        "metrics.json": json.dumps(result.metrics, indent=2),
        "samples.txt": result.samples,
        "curve.json": json.dumps(result.curve, indent=2),
        "repro_card.json": json.dumps(card, indent=2, sort_keys=True),
        **result.files,
    }
    for name, content in files.items():
        (out / name).write_text(content)


EVAL_TAG = "dllm.eval"  # dllm.eval.<key[:12]>: one evaluation's settings; dllm.eval.latest: whose metrics show


def evaluation_tags(tracker, key: str, settings: dict) -> dict[str, str]:
    """The tags that say which settings produced the metrics on a training's run. A training reused by a later
    pipeline with other evaluation settings (`dflash.eval_temperature`, `eval.num_samples`, ...) gets that
    evaluation's metrics too: each evaluation records its settings under its own key, `dllm.eval.latest` names
    the one whose values the run shows last, and a run holding several says so (`dllm.eval.note`); each
    evaluation's files stay under `eval_artifact_path(key)` (docs/architecture.md, "The MLflow contract")."""
    short = key[:12]
    tags = tracker.client.get_run(tracker.run_id).data.tags
    earlier = sorted({k[len(EVAL_TAG) + 1 :] for k in tags if k.startswith(EVAL_TAG + ".")} - {"latest", "note", short})
    out = {f"{EVAL_TAG}.{short}": canonical_json(settings)[:5000], f"{EVAL_TAG}.latest": short}
    if earlier:
        out[f"{EVAL_TAG}.note"] = (
            f"this run holds {len(earlier) + 1} evaluations with different settings ({', '.join([*earlier, short])}); "
            f"the metrics' latest values are evaluation {short}'s (settings in tag {EVAL_TAG}.{short}, files under "
            f"{eval_artifact_path(key)}/); each earlier one's are under eval/<its key>/"
        )
    return out


def _log_to_training_run(spec: PipelineSpec, trained: StageRef, entry, workdir: str) -> None:
    """Metrics on the trained model's run, the quality-vs-NFE curve, artifacts under `eval/<key>/`."""
    metrics = json.loads((entry.path / "metrics.json").read_text())
    curve = json.loads((entry.path / "curve.json").read_text())
    tracker = tracking_for(spec, workdir).reopen(trained.mlflow_run_id)
    tracker.set_tags(evaluation_tags(tracker, entry.key, eval_slice(spec, entry.manifest["strategy"])))
    tracker.log_metrics(metrics, step=spec.train.steps)
    for point in curve:  # the quality-vs-NFE curve, one MLflow step per step budget
        tracker.log_metrics({f"eval_curve/{k}": v for k, v in point.items() if k != "steps"}, step=point["steps"])
    for name in sorted(entry.manifest["files"]):
        tracker.log_artifact(entry.path / name, eval_artifact_path(entry.key))
    tracker.close()


def val_documents(data: StageRef, rows: int, device: str):
    """Per-token document ids of the first `rows` validation rows where they are packed, else None."""
    starts = open_doc_starts(data.path, "val")
    return None if starts is None else document_ids(starts[:rows]).to(device)


def evaluate(spec: PipelineSpec, strategy: str, trained: StageRef, data: StageRef, workdir: str) -> StageRef:
    """Evaluate the trained model (or reuse the published evaluation) and log it to the model's run."""
    spec = for_strategy(spec, strategy)
    stage, key = stage_of(spec, strategy, trained, data, workdir)

    def build(out: Path) -> dict:
        device = resolve_device(spec.train.device)
        ckpt = model_dir(trained)
        scorer = load_scorer(spec.eval.scorer, workdir) if spec.eval.scorer is not None else None
        val = tuple(t[: spec.eval.val_rows].to(device) for t in load_split(data.path, "val"))
        model = load_trained_model(ckpt, device)
        ev = Evaluation(
            spec=spec,
            strategy=strategy,
            model=model,
            tokenizer=checkpoint_tokenizer(ckpt, model),
            mask_id=read_meta(ckpt)["mask_token_id"],
            ckpt=ckpt,
            val=val,
            device=device,
            scorer=scorer,
            val_documents=val_documents(data, spec.eval.val_rows, device),
        )
        run = dflash_evaluation if strategy_class(strategy).evaluation == "speculative" else _dllm_evaluation
        result = run(ev)
        if spec.eval.lm_eval is not None:
            result = harness_evaluation(ev, result)
        _write_result(ev, result, data.key, out)
        info = {"metrics": result.metrics, "train_run_id": trained.mlflow_run_id}
        return {"strategy": strategy, "upstream": {"train": trained.key}, "info": info}

    entry, reused = store_for(workdir).reuse_or_build(stage, key, build)
    if trained.mlflow_run_id and (not reused or _missing_from_run(spec, trained, entry, workdir)):
        _log_to_training_run(spec, trained, entry, workdir)
    return _ref(entry, strategy, reused)


def _missing_from_run(spec: PipelineSpec, trained: StageRef, entry, workdir: str) -> bool:
    """A reused evaluation of a training whose MLflow run is not the one it was logged to (the training was
    rebuilt bit for bit after its entry was damaged, in a new run) and that run lacks its artifact folder.
    The folder, not the metric names, decides: another evaluation of the rebuilt run logs the same names."""
    if entry.manifest.get("info", {}).get("train_run_id") == trained.mlflow_run_id:
        return False
    folder = eval_artifact_path(entry.key)
    logged = tracking_for(spec, workdir).client.list_artifacts(trained.mlflow_run_id, folder)
    return not any(Path(a.path).name in entry.manifest["files"] for a in logged)


def _dllm_evaluation(ev: Evaluation) -> EvalResult:
    """Bound / exact NLL on validation rows, then samples over the step budgets."""
    spec, (ids, loss_mask, attn) = ev.spec, ev.val
    built = assemble_strategy(ev.strategy, ev.options, ev.model, ev.tokenizer, mask_token_id=ev.mask_id)
    strat, mask_id = built.strategy, built.mask_token_id
    metrics: dict = {}
    if "nelbo" in strat.likelihoods:  # strategies with a diffusion ELBO
        nelbo, se, n_tokens = fixed_noise_nelbo(strat, ev.model, (ids, loss_mask), mask_id, spec.eval)
        metrics.update(
            {
                "eval/nelbo": nelbo,
                "eval/nelbo_se": se,
                "eval/ppl_bound": math.exp(min(nelbo, 50.0)),
                "eval/tokens": n_tokens,
                "eval/nelbo_bpb": bits_per_byte(nelbo, n_tokens, supervised_bytes(ev.tokenizer, ids, loss_mask)),
            }
        )
    if "ar_nll" in strat.likelihoods:  # strategies with an exact causal path
        nll, se, n_tokens = exact_ar_nll(strat, ev.model, ids, loss_mask, attn, spec.eval.batch_size)
        scored = loss_mask.bool() & attn.bool()
        scored[:, 0] = False  # the first token has no left context to be predicted from
        metrics.update(ar_nll_metrics(nll, se, n_tokens))
        metrics["eval/ar_nll_bpb"] = bits_per_byte(nll, n_tokens, supervised_bytes(ev.tokenizer, ids, scored))
    metrics.update(strat.eval_metrics(ev.model.eval(), (ids, loss_mask, attn), spec.eval.batch_size))
    headline, curve, text = sample_quality(ev, strat, mask_id)
    metrics.update(headline)
    files = {}
    if spec.data.source == "task":
        accuracy, rows = task_accuracy(ev, strat, mask_id)
        metrics.update(accuracy)
        files["problems.jsonl"] = "".join(json.dumps(r) + "\n" for r in rows)
    return EvalResult(strat, metrics, curve, text, files)


def task_accuracy(ev: Evaluation, strategy, mask_token_id: int) -> tuple[dict, list[dict]]:
    """Accuracy on `eval.task_problems` held-out problems of the generated task, decoded greedily at the headline
    step budget (what d1 reports), with how those answers end."""
    spec, tokenizer = ev.spec, ev.tokenizer
    problems = held_out_problems(spec, spec.eval.task_problems)
    prompts = encode_prompts(tokenizer, [p.prompt for p in problems], chat=True)
    ids, stats = draw_samples(ev, strategy, mask_token_id, prompts, spec.eval.budgets()[0], greedy=True)
    metrics, rows = accuracy_metrics(problems, [tokenizer.decode(i) for i in ids], spec.eval.seed)
    metrics.update({k.replace("eval/", "eval/task_"): v for k, v in stats.items() if k in ANSWER_KEYS})
    return metrics, rows


ANSWER_KEYS = ("eval/eos_rate", "eval/ended", "eval/answer_len_mean", "eval/answer_len_p50", "eval/answer_len_p90")


def harness_evaluation(ev: Evaluation, result: EvalResult) -> EvalResult:
    """The `eval.lm_eval` tasks on the evaluated model and its assembled strategy (docs/evaluation.md §4.10):
    their numbers join the metrics as `lm_eval/<task>/<metric>`, the harness's results go to `lm_eval.json`."""
    if importlib.util.find_spec("lm_eval") is None:
        raise ImportError(LMEVAL_MISSING)
    # imported here, not at the top: lm-eval is an optional extra, needed only when eval.lm_eval is set
    from tasks.evaluation.lm_eval_model import Checkpoint, DLLMFlowLM, harness_metrics, results_json, run_tasks

    e = ev.spec.eval
    lm = DLLMFlowLM(
        loaded=Checkpoint(ev.model, ev.tokenizer, result.strategy, ev.mask_id, read_meta(ev.ckpt)),
        device=ev.device,
        mc_samples=e.lm_eval.mc_samples,
        batch_size=e.lm_eval.batch_size,
        seed=e.seed,
        block_size=e.sample_block_size,
        tokens_per_step=e.sample_length / e.sample_steps,
        threshold=e.threshold,
    )
    results = run_tasks(lm, e.lm_eval, e.seed, chat=ev.spec.data.shape == "dialogue")
    return dataclasses.replace(
        result,
        metrics={**result.metrics, **harness_metrics(results)},
        files={**result.files, "lm_eval.json": results_json(results)},
    )


def _ref(entry, strategy: str, reused: bool) -> StageRef:
    return StageRef.of(entry, reused, f"evaluate[{strategy}]", run_id_key="train_run_id")


# logged into the training's MLflow run: a training rebuilt in a new run gets its reused evaluations again
from dllm_common.harness_tasks import check_harness_tasks  # noqa: E402
from tasks.stages import Stage  # noqa: E402

evaluate_task = prefect_task(
    evaluate, name="evaluate", stage_of=stage_of, side_effects_for=lambda trained, **_: trained.mlflow_run_id or ""
)
DECLARATION = Stage(
    name=STAGE,
    task=evaluate_task,
    produces="evaluated",
    consumes={"trained": "trained", "data": "data"},
    per_strategy=True,
    leader_only=True,
    # refused before any training: lm-eval tasks that do not exist, samples longer than the model's context
    checks=(((), lambda spec: check_harness_tasks(spec.eval.lm_eval)), (("data",), check_samples_fit)),
)
