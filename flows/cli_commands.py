"""`dllm-flow` validate | plan | runs | generate | report | export: the commands that run no pipeline.

Torch-free at import: each command imports the strategies and tasks it needs when it runs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from dllm_common.store import refuse_published
from dllm_common.tracking import quiet_environment
from flows.cli_checks import check_registry_writable, refuse_file_as_folder


def cmd_plan(args) -> int:
    """Memory per GPU and time per step of each strategy of a config on a cluster, predicted without a GPU."""
    from strategies.options import load_config  # the strategy registry imports torch: not at import time
    from tasks.commands.plan import cluster_for, micro_batch_for, plan, render

    spec = load_config(args.config, args.set)
    cluster = cluster_for(spec, args.gpus, args.gpu_memory, args.gpu_flops, args.mfu, args.step_cost)
    if args.gpus is not None:  # "what would N GPUs need": a micro-batch the config chose for another world size
        spec, chosen = micro_batch_for(spec, cluster.gpus)
        if chosen:
            print(f"dllm-flow plan: {chosen}", flush=True)
    print(render(spec, cluster, plan(spec, cluster), str(args.config)))
    return 0


def cmd_validate(args) -> int:
    """One JSON document: the resolved config, and each strategy's options exactly as training uses them
    (`null` there is resolved when the model is built: mask_token_id → the tokenizer's [MASK],
    vocab_size → the model's vocabulary; a DFlash block_size of 0 → the draft checkpoint's)."""
    from strategies.options import load_config, printed_options

    spec = load_config(args.config, args.set)
    options = printed_options(spec)  # no mask_token_id for a strategy that never reads one
    stages = [{"stage": name, "reads": reads, "produces": role} for name, reads, role in stage_table(spec)]
    print(json.dumps({"config": spec.model_dump(mode="json"), "strategy_options": options, "stages": stages}, indent=2))
    return 0


def stage_table(spec) -> list[tuple[str, str, str]]:
    """The stages `dllm-flow run` would run for `spec`, in order, as the declarations derive them (tasks/stages.py)."""
    from strategies import strategy_class
    from tasks.stages import derive

    return derive(spec, strategy_class).table()


def cmd_runs(args) -> int:
    from dllm_common.runs import read_records

    records, unreadable = read_records(Path(args.workdir))
    for message in unreadable:
        print(f"[dllm-flow] skipped: {message}", file=sys.stderr)
    if not records:
        print(f"no pipeline runs in {args.workdir}")
        return 0
    for r in records:
        resumed = f"  resumes={r.resumed_from}" if r.resumed_from else ""
        print(
            f"{r.run_id}  {r.status:<9}  {r.pipeline}  config={r.config_path}  mlflow_parent={r.parent_mlflow_run_id}"
            f"{resumed}"
        )
        for s in r.stages:
            extra = f"  mlflow_run={s.mlflow_run_id}" if s.mlflow_run_id else ""
            err = f"  error={s.error.splitlines()[0][:120]}" if s.error else ""
            print(f"    {s.name:<28} {s.status:<9} {s.seconds or 0:>8.1f}s{extra}{err}")
    return 0


def cmd_generate(args) -> int:
    """Stream text from a checkpoint and report NFE and tokens/s per prompt."""
    quiet_environment()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from strategies.sampling import SamplerConfig
    from tasks.commands.generate import (
        Request,
        check_request,
        check_sampler,
        default_temperature,
        default_top_p,
        load_redraft,
        resolve_checkpoint,
        settings_line,
    )
    from tasks.devices import resolve_device
    from tasks.evaluation.trained_model import load_for_generation

    def check_registry(ref: str) -> None:  # a models:/ or runs:/ reference reads the workdir's registry
        if ref.startswith(("models:/", "runs:/")) and args.tracking_uri is None:
            check_registry_writable(Path(args.workdir))  # MLflow would retry a read-only store for ~2 minutes

    check_registry(args.checkpoint)
    ckpt = resolve_checkpoint(args.checkpoint, Path(args.workdir), args.tracking_uri)
    device = resolve_device(args.device)
    loaded = load_for_generation(ckpt, device, args.adapter, where="--checkpoint")
    sampler = check_sampler(loaded.meta["strategy"], args.sampler, args.infill)
    temperature = args.temperature if args.temperature is not None else default_temperature(sampler)
    config = SamplerConfig(
        steps=args.steps,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        temperature=temperature,
        top_p=args.top_p if args.top_p is not None else default_top_p(temperature),
        top_k=args.top_k,
        remasking=args.remasking,
        threshold=args.threshold,
        sampler=sampler,
        lookup_ngram=args.lookup_ngram,
        sampled_proposals=args.sampled_proposals,
        tree_branches=args.tree_branches,
        confidence_threshold=args.confidence_threshold,
        confidence_rule=args.confidence_rule,
        **({"cache": args.cache} if args.cache else {}),
    )
    redraft = None
    if args.redraft:  # a second draft for the tree's branches (docs/strategies.md §10.16)
        check_registry(args.redraft)
        redraft = load_redraft(args.redraft, loaded, sampler, config, Path(args.workdir), args.tracking_uri, device)
    chat = (loaded.meta.get("chat", False) or args.chat) and not args.raw
    for prompt in args.prompt:  # refuse a prompt that does not fit before echoing any
        check_request(loaded, Request(prompt, sampler, config, args.seed, chat, args.infill, redraft))
    # only the settings the sampler reads (no cache for a cacheless sampler)
    shown = settings_line(sampler, config, args.seed)
    print(f"[dllm-flow] {ckpt} ({loaded.meta['strategy']}, {shown})", file=sys.stderr, flush=True)
    for i, prompt in enumerate(args.prompt):
        print(f"[Prompt {i}] {prompt}", flush=True)
        _generate_one(loaded, Request(prompt, sampler, config, args.seed, chat, args.infill, redraft), device)
    return 0


def _generate_one(loaded, request, device: str) -> None:
    from tasks.commands.generate import generate

    out = generate(loaded, request, device, stream=lambda text: print(text, end="", flush=True))
    print(flush=True)
    print(
        f"[dllm-flow] NFE {out.nfe:g}, {out.tokens} tokens in {out.seconds:.2f} s "
        f"({out.tokens / max(out.seconds, 1e-9):.1f} tokens/s, "
        f"{out.tokens / max(out.nfe, 1e-9):.2f} tokens/forward)",
        file=sys.stderr,
        flush=True,
    )


def cmd_report(args) -> int:
    """Re-render a pipeline run's comparison report from MLflow alone."""
    from mlflow.tracking import MlflowClient

    from dllm_common.tracking import check_tracking_server, default_tracking_uri
    from tasks.report import render_from_mlflow

    out = Path(args.out) if args.out else Path(args.workdir) / "reports" / "+".join(args.run_id)
    refuse_published(out, Path(args.workdir))
    refuse_file_as_folder(out, "--out" if args.out else "--workdir")  # --workdir: the default folder is under it
    quiet_environment()
    check_tracking_server(args.tracking_uri, "--tracking-uri")
    uri = args.tracking_uri or default_tracking_uri(Path(args.workdir))
    client = MlflowClient(uri)
    parent_ids = [_parent_run(client, run_id) for run_id in args.run_id]
    path = render_from_mlflow(client, parent_ids, out)
    print(path.read_text().split("\n## ")[0])
    print(f"[dllm-flow] report written to {path} (and PNGs beside it)")
    return 0


def _parent_run(client, run_id: str) -> str:
    """An MLflow parent run id, given either it or a dllm-flow pipeline run id."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    hits = client.search_runs(experiments, f"tags.`dllm.pipeline_run_id` = '{run_id}'") if experiments else []
    if hits:
        return hits[0].info.run_id
    try:
        return client.get_run(run_id).info.run_id
    except Exception:
        raise FileNotFoundError(
            f"no pipeline run {run_id!r} in this tracking store; list them with dllm-flow runs"
        ) from None


def cmd_export(args) -> int:
    quiet_environment()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tasks.commands.export import export_checkpoint  # imports torch: only when the command runs

    out = export_checkpoint(args.checkpoint, Path(args.out), Path(args.workdir), args.tracking_uri, fmt=args.format)
    print(f"[dllm-flow] exported {args.checkpoint} to {out}")
    return 0
