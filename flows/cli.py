"""`dllm-flow` command line: run | resume | validate | plan | runs | generate | report | ui | export.

Environment is set before Prefect/MLflow are imported: telemetry off, hub offline unless the
user says otherwise, and (when no Prefect server is configured) Prefect's state kept inside the
workdir so a pipeline's whole history lives in one folder.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path

from dllm_common import credentials
from dllm_common.checkpoint import CorruptCheckpointError
from dllm_common.config import ConfigError, TrainingDiverged
from dllm_common.interrupt import Interrupted
from dllm_common.store import DiskFullError, is_disk_full, refuse_published
from dllm_common.tracking import quiet_environment
from flows.environment import DEBUG_ENV, prefect_env
from flows.ui import cmd_ui

DEFAULT_WORKDIR = "work"
EXPORT_FORMATS = ("zlab", "speculators", "dllm-flow")  # tasks/commands/export_draft.py FORMATS (torch-free here)


class _session:
    log_file: Path | None = None  # this command's log file (`run`, `resume`), named in error messages


VERIFY_HELP = "re-hash every reused stage's files (default: sizes only); a damaged stage is set aside and rebuilt"


def _verification(args) -> None:
    """`--verify`: every reused store entry is re-hashed, not only size-checked (workers inherit the setting)."""
    if getattr(args, "verify", False):
        from dllm_common.store import VERIFY_ENV

        os.environ[VERIFY_ENV] = "full"


def _check_device(spec) -> None:
    """train.device: cuda on a machine without one fails here, not inside the first stage (a remote
    train_deployment trains on its own worker's GPU)."""
    if spec.train.device == "cuda" and spec.pipeline.train_deployment is None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "train.device is 'cuda' but this machine has no CUDA device; use train.device: auto (cuda when "
                "present) or cpu, or train on a GPU work pool (pipeline.train_deployment)"
            )


GPU_MEMORY_ENV = "DLLM_FLOW_GPU_MEMORY"  # the training GPU's memory, e.g. 80GB (docs/planning.md)


def _warn_if_too_big(spec, declared: str | None, workdir: Path) -> None:
    """One warning line per strategy that the plan says will not fit the training GPU: the memory given by
    `--gpu-memory` or $DLLM_FLOW_GPU_MEMORY, else the visible CUDA device's; none for a CPU training."""
    declared = declared or os.environ.get(GPU_MEMORY_ENV) or None
    if declared is None and (spec.train.device == "cpu" or spec.pipeline.train_deployment is not None):
        return
    import torch  # already imported by the config's checks

    if declared is None and not torch.cuda.is_available():  # nothing to plan for: Prefect is not imported yet
        return
    prefect_env(workdir)  # tasks/ imports Prefect, which reads its (quiet) logging settings once, at import
    from tasks.commands.plan import fit_warnings

    for line in fit_warnings(spec, declared):
        print(f"dllm-flow: warning: {line}", file=sys.stderr, flush=True)


def cmd_plan(args) -> int:
    """Memory per GPU and time per step of each strategy of a config on a cluster, predicted without a GPU."""
    from strategies.options import load_config  # the strategy registry imports torch: not at import time
    from tasks.commands.plan import cluster_for, micro_batch_for, plan, render

    spec = load_config(args.config, args.set)
    cluster = cluster_for(spec, args.gpus, args.gpu_memory, args.gpu_flops, args.mfu)
    if args.gpus is not None:  # "what would N GPUs need": a micro-batch the config chose for another world size
        spec, chosen = micro_batch_for(spec, cluster.gpus)
        if chosen:
            print(f"dllm-flow plan: {chosen}", flush=True)
    print(render(spec, cluster, plan(spec, cluster), str(args.config)))
    return 0


def _check_tracking(uri: str | None, workdir: Path) -> None:
    """The tracking store a run will write to, checked before any service starts: the workdir's sqlite store is
    readable, or the tracking server `tracking.uri` names answers."""
    from dllm_common.tracking import check_local_store, check_tracking_server

    if uri is None:
        check_local_store(workdir / "mlflow.db", workdir)
    else:
        check_tracking_server(uri)


def cmd_run(args) -> int:
    from strategies.options import load_config  # the strategy registry imports torch: not at import time

    spec = load_config(args.config, args.set)
    _check_device(spec)  # fail fast, before any service starts
    _warn_if_too_big(spec, args.gpu_memory, Path(args.workdir))
    _check_tracking(spec.tracking.uri, Path(args.workdir))
    _verification(args)
    result = _run_pipeline(args, config_path=str(args.config), overrides=args.set)
    if isinstance(result, int):
        return result
    report = f"report: {result['report']}" if result["report"] else "its report is node 0's"
    print(f"[dllm-flow] pipeline run {result['run_id']} completed; {report}")
    print(f"[dllm-flow] browse it with: dllm-flow ui --workdir {Path(args.workdir).resolve()}")
    return 0


def _run_pipeline(args, **kwargs) -> dict | int:
    """The pipeline flow under a detached local Prefect API (flows/local_api.py), with SIGINT/SIGTERM ending
    it cleanly: the flow's result, or the exit status of an interrupted run (128 + the signal's number)."""
    from dllm_common import interrupt

    prefect_env(Path(args.workdir))
    from tasks.common import check_workdir

    workdir = check_workdir(args.workdir)
    interrupt.install()
    from flows.environment import open_log_file
    from flows.local_api import local_prefect_api

    _session.log_file = open_log_file(workdir)
    from flows.pipeline import cancel_flow_run, dllm_pipeline

    with local_prefect_api():
        try:
            return dllm_pipeline(workdir=str(workdir), **kwargs)
        except interrupt.Interrupted as exc:
            run_id = getattr(exc, "run_id", None)
            cancel_flow_run(getattr(exc, "flow_run_id", None), str(exc))
            where = f" during {exc.stage}" if getattr(exc, "stage", None) and not exc.where else ""
            how = (
                f"resume with: dllm-flow resume {run_id} --workdir {args.workdir}"
                if run_id
                else f"rerun: dllm-flow {args.command} ... --workdir {args.workdir}"
            )
            print(f"dllm-flow: {exc}{where}; {how}", file=sys.stderr, flush=True)
            return exc.exit_code


def cmd_resume(args) -> int:
    """Rerun a failed or crashed pipeline run with its recorded config; completed stages are reused."""
    from dllm_common.runs import find_record

    record = find_record(Path(args.workdir), args.run_id)
    if record.status == "COMPLETED":
        print(f"[dllm-flow] pipeline run {record.run_id} completed; nothing to resume")
        return 0
    if record.status == "RUNNING":
        raise ValueError(
            f"pipeline run {record.run_id} is still running (pid {record.pid} on {record.host}); "
            "wait for it or stop it before resuming"
        )
    _check_tracking((record.config.get("tracking") or {}).get("uri"), Path(args.workdir))
    done = [s.name for s in record.stages if s.status in ("COMPLETED", "REUSED")]
    todo = [s.name for s in record.stages if s.status not in ("COMPLETED", "REUSED")]
    _verification(args)
    config, overrides = record.config, list(record.overrides)
    if args.set:  # e.g. another layout, or train.skip_nonfinite_steps after a diverged step
        from dllm_common.config import apply_overrides

        config, overrides = apply_overrides(record.config, args.set), overrides + list(args.set)
    changed = f" and {' '.join('--set ' + s for s in args.set)}" if args.set else ""
    print(f"[dllm-flow] resuming pipeline run {record.run_id} ({record.status}) with its recorded config{changed}")
    print(f"[dllm-flow] completed before, will be reused: {', '.join(done) or 'none'}")
    print(f"[dllm-flow] to run again: {', '.join(todo) or 'none recorded'} (and every stage after them)")
    result = _run_pipeline(
        args,
        config_path=record.config_path,
        overrides=overrides,
        config=config,
        resumed_from=record.run_id,
    )
    if isinstance(result, int):
        return result
    print(
        f"[dllm-flow] pipeline run {result['run_id']} (resuming {record.run_id}) completed; report: {result['report']}"
    )
    return 0


def cmd_validate(args) -> int:
    """One JSON document: the resolved config, and each strategy's options exactly as training uses them
    (`null` there is resolved when the model is built: mask_token_id → the tokenizer's [MASK],
    vocab_size → the model's vocabulary; a DFlash block_size of 0 → the draft checkpoint's)."""
    from strategies.options import check_spec, load_config

    spec = load_config(args.config, args.set)
    options = {name: opts.model_dump(mode="json") for name, opts in check_spec(spec).items()}
    print(json.dumps({"config": spec.model_dump(mode="json"), "strategy_options": options}, indent=2))
    return 0


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
        resolve_checkpoint,
    )
    from tasks.evaluation.trained_model import load_for_generation
    from tasks.training.runtime import resolve_device

    if args.checkpoint.startswith(("models:/", "runs:/")) and args.tracking_uri is None:
        _check_registry_writable(Path(args.workdir))  # MLflow would retry a read-only store for ~2 minutes
    ckpt = resolve_checkpoint(args.checkpoint, Path(args.workdir), args.tracking_uri)
    device = resolve_device(args.device)
    loaded = load_for_generation(ckpt, device, args.adapter)
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
        **({"cache": args.cache} if args.cache else {}),
    )
    chat = (loaded.meta.get("chat", False) or args.chat) and not args.raw
    for prompt in args.prompt:  # refuse a prompt that does not fit before echoing any
        check_request(loaded, Request(prompt, sampler, config, args.seed, chat, args.infill))
    print(
        f"[dllm-flow] {ckpt} ({loaded.meta['strategy']}, sampler {sampler}, steps {args.steps}, "
        f"temperature {temperature}, top-p {config.top_p}, top-k {config.top_k}, cache {config.cache}, "
        f"seed {args.seed})",
        file=sys.stderr,
        flush=True,
    )
    for i, prompt in enumerate(args.prompt):
        print(f"[Prompt {i}] {prompt}", flush=True)
        _generate_one(loaded, Request(prompt, sampler, config, args.seed, chat, args.infill), device)
    return 0


def _check_registry_writable(workdir: Path) -> None:
    """A models:/ or runs:/ URI is looked up in the workdir's sqlite registry, which MLflow opens for writing
    (its schema check, its journal): a read-only workdir is refused at once, naming what to do, instead of
    MLflow's minutes of retries ending in "not found"."""
    from dllm_common.store import refuse_read_only

    workdir = workdir.resolve()
    if not workdir.is_dir():
        return  # no registry there: resolve_checkpoint says the model is not found
    refuse_read_only(
        workdir,
        f"--workdir {workdir} is read-only",
        "its MLflow registry (mlflow.db) cannot be opened there: pass the checkpoint folder instead "
        f"(dllm-flow generate {workdir}/store/train/<key>/model ...; `dllm-flow runs --workdir {workdir}` lists "
        "the runs), or copy the workdir somewhere writable (cp -a) and pass --workdir with the copy",
    )


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
    _refuse_file_as_folder(out, "--out" if args.out else "--workdir")  # --workdir: the default folder is under it
    quiet_environment()
    check_tracking_server(args.tracking_uri, "--tracking-uri")
    uri = args.tracking_uri or default_tracking_uri(Path(args.workdir))
    client = MlflowClient(uri)
    parent_ids = [_parent_run(client, run_id) for run_id in args.run_id]
    path = render_from_mlflow(client, parent_ids, out)
    print(path.read_text().split("\n## ")[0])
    print(f"[dllm-flow] report written to {path} (and PNGs beside it)")
    return 0


def _refuse_file_as_folder(out: Path, flag: str) -> None:
    """The report's folder (or a folder above it) must not be an existing file: said before MLflow is opened."""
    blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        where = "is a file" if blocker == out else f"is inside {blocker}, which is a file"
        what = f"--out {out}" if flag == "--out" else f"folder {out} (under --workdir)"
        raise FileExistsError(
            f"report {what} {where}, not a directory; nothing was written. Give {flag} a directory (new or "
            "existing) for report.md, report.json and the plots"
        )


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dllm-flow", description="Declarative training pipelines for diffusion LMs.")
    p.add_argument("--debug", action="store_true", help="print Prefect's console log and full tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    _pipeline_commands(sub)
    _add_generate(sub)
    _inspection_commands(sub)
    return p


def _pipeline_commands(sub) -> None:
    """run, resume, validate, runs."""
    run = sub.add_parser("run", help="run a pipeline config (stages already done are reused)")
    run.add_argument("config")
    run.add_argument("--set", action="append", default=[], metavar="dotted.key=value", help="override a config key")
    run.add_argument("--workdir", default=DEFAULT_WORKDIR)
    run.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    run.add_argument(
        "--gpu-memory",
        default=None,
        help=f"the training GPU's memory, e.g. 80GB (or ${GPU_MEMORY_ENV}): warn when a strategy will not fit it",
    )
    run.set_defaults(func=cmd_run)
    res = sub.add_parser("resume", help="rerun a failed/crashed pipeline run with its recorded config")
    res.add_argument("run_id")
    res.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="dotted.key=value",
        help="change a key of the recorded config (a key of a stage's identity reruns that stage from scratch)",
    )
    res.add_argument("--workdir", default=DEFAULT_WORKDIR)
    res.add_argument("--verify", action="store_true", help=VERIFY_HELP)
    res.set_defaults(func=cmd_resume)
    val = sub.add_parser("validate", help="print the resolved config, or what is wrong with it")
    val.add_argument("config")
    val.add_argument("--set", action="append", default=[], metavar="dotted.key=value")
    val.set_defaults(func=cmd_validate)
    pl = sub.add_parser("plan", help="predict each strategy's memory per GPU and time per step (no GPU needed)")
    pl.add_argument("config")
    pl.add_argument("--set", action="append", default=[], metavar="dotted.key=value")
    pl.add_argument("--gpus", type=int, default=None, help="data-parallel ranks (default: the config's world size)")
    pl.add_argument("--gpu-memory", default="80GB", help="memory per GPU, e.g. 80GB, 141GB (default 80GB)")
    pl.add_argument("--gpu-flops", default=None, help="peak FLOP/s per GPU, e.g. 989T (default: H100 at the precision)")
    pl.add_argument("--mfu", type=float, default=None, help="the share of that peak the step runs at (default 0.4)")
    pl.set_defaults(func=cmd_plan)
    runs = sub.add_parser("runs", help="past pipeline runs with the status of each stage")
    runs.add_argument("--workdir", default=DEFAULT_WORKDIR)
    runs.set_defaults(func=cmd_runs)


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="stream text from a checkpoint (path or models:/NAME@ALIAS)")
    gen.add_argument("--checkpoint", required=True, help="checkpoint dir, train store entry, or models:/NAME@ALIAS")
    gen.add_argument("--prompt", action="append", required=True, help="repeatable")
    gen.add_argument(
        "--sampler", default="auto", help="auto (the strategy's own) or one the checkpoint's strategy lists"
    )
    gen.add_argument("--steps", type=int, default=64)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="default: evaluation's open-ended setting (docs/strategies.md §11.7); the speculative sampler: 0",
    )
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling at temperature > 0 (default: eval's)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens only (0: all)")
    gen.add_argument("--threshold", type=float, default=None, help="confidence-threshold parallel decoding")
    gen.add_argument("--remasking", default="low_confidence", choices=["low_confidence", "random"])
    gen.add_argument(
        "--cache",
        default=None,
        choices=["none", "exact", "prefix", "dual"],
        help="K/V reuse across steps (docs/decoding.md); default: the sampler's (exact)",
    )
    gen.add_argument(
        "--lookup-ngram",
        type=int,
        default=0,
        help="speculative sampler: when the last N..4 tokens recur in the context, propose what followed them (0: off)",
    )
    gen.add_argument("--seed", type=int, default=42)
    gen.add_argument("--infill", action="store_true", help="fill each [MASK] in the prompt with 20 tokens")
    gen.add_argument("--adapter", default=None, help="merge a LoRA adapter dir into the checkpoint first")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--raw", action="store_true", help="never use the chat template")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--workdir", default=DEFAULT_WORKDIR, help="its MLflow registry resolves models:/ URIs")
    gen.add_argument("--tracking-uri", default=None)
    gen.set_defaults(func=cmd_generate)


def _inspection_commands(sub) -> None:
    """report, ui, export."""
    rep = sub.add_parser("report", help="re-render a pipeline run's comparison report from MLflow")
    rep.add_argument(
        "run_id",
        nargs="+",
        help="pipeline run id (dllm-flow runs) or the parent MLflow run id; several: one table of all their strategies",
    )
    rep.add_argument("--workdir", default=DEFAULT_WORKDIR)
    rep.add_argument("--tracking-uri", default=None)
    rep.add_argument("--out", default=None, help="default: <workdir>/reports/<run_id>")
    rep.set_defaults(func=cmd_report)
    ui = sub.add_parser("ui", help="MLflow UI (or, with --prefect, the Prefect UI) on 127.0.0.1 for a workdir")
    ui.add_argument("run_id", nargs="?", default=None, help="--prefect: the pipeline run (default: the latest)")
    ui.add_argument("--workdir", default=DEFAULT_WORKDIR)
    ui.add_argument("--experiment", default=None, help="default: the workdir's most recent experiment")
    ui.add_argument("--prefect", action="store_true", help="the Prefect UI on the pipeline run's flow run instead")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=None, help="default: 5000 (MLflow), 4200 (Prefect)")
    ui.set_defaults(func=cmd_ui)
    exp = sub.add_parser(
        "export", help="write a checkpoint (path or models:/NAME@ALIAS) as a Hugging Face model folder"
    )
    exp.add_argument("checkpoint", help="checkpoint dir, train store entry, or models:/NAME@ALIAS")
    exp.add_argument("out", help="the folder to write (missing or empty)")
    exp.add_argument("--workdir", default=DEFAULT_WORKDIR, help="its MLflow registry resolves models:/ URIs")
    exp.add_argument("--tracking-uri", default=None)
    exp.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default=None,
        help="a DFlash draft's layout: zlab (default; the z-lab / SpecForge draft SGLang, vLLM and TensorRT-LLM "
        "load), speculators (the speculators package's, vLLM reads it too), dllm-flow (as trained; a copy-hint draft)",
    )
    exp.set_defaults(func=cmd_export)


# what the user can change: a config, a path, a damaged file, a full disk
USER_ERRORS = (
    ConfigError,
    CorruptCheckpointError,
    DiskFullError,
    FileExistsError,
    FileNotFoundError,
    PermissionError,
    ValueError,
)


def main(argv: list[str] | None = None) -> int:
    """Exit 0, 2 with one `dllm-flow: error:` line for what the user can change (a stage's traceback is in the
    command's log file), 1 with one line for anything else, 128 + N after signal N. `--debug` prints tracebacks."""
    args = build_parser().parse_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"
    _session.log_file = None
    try:
        credentials.apply_to_client()  # a team server's login, from the environment (docs/operations.md)
        return args.func(args)
    except USER_ERRORS as exc:
        if args.debug:
            raise
        print(f"dllm-flow: error: {exc}{_log_hint(exc)}{_resume_hint(exc, args)}", file=sys.stderr)
        return 2
    except Exception as exc:
        if args.debug:
            raise
        causes = getattr(exc, "errors", {}).values()  # several strategies failed: their summary says which finished
        if not causes and is_disk_full(exc):  # a library's error over an ENOSPC (torch's "unexpected pos 704 vs 598")
            print(f"dllm-flow: error: {_disk_full_line(exc)}{_log_hint(exc)}", file=sys.stderr)
            return 2
        print(
            f"dllm-flow: error: {type(exc).__name__}: {exc}{_log_hint(exc)}{_resume_hint(exc, args)}", file=sys.stderr
        )
        # exit 2 when every failure is one the user changes: a config, a file, a full disk
        return 2 if causes and all(isinstance(e, USER_ERRORS) or is_disk_full(e) for e in causes) else 1
    except Interrupted as exc:  # a signal outside the pipeline (while its services start or stop)
        print(f"dllm-flow: {exc}", file=sys.stderr)
        return exc.exit_code


def _disk_full_line(exc: BaseException) -> str:
    """The disk-full line (docs/operations.md, "Faults") where the error that reached the command is a library's
    over an ENOSPC: what the nearest `DiskFullError` of its chain says, else the generic line."""
    todo = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, DiskFullError):
            return str(e)
        todo += [c for c in (e.__cause__, e.__context__) if c is not None and c is not e]
        todo += list(getattr(e, "errors", {}).values())
    return (
        f"no space left on the device ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
        "nothing half-written was published: free space (or point --workdir at a larger disk) and rerun"
    )


def _resumable(exc: BaseException) -> bool:
    """Whether resuming the run can fix `exc`: a stage that failed or was cut short mid-way (a crash, a lost
    server, a diverged step `--set train.skip_nonfinite_steps` skips), not what the user must change first (a
    config, a missing or damaged file, a read-only or full disk, a refused login)."""
    errors = getattr(exc, "errors", None)
    if isinstance(errors, dict) and errors:  # several strategies failed: any one a resume can fix
        return any(_resumable(e) for e in errors.values())
    if isinstance(exc, TrainingDiverged):
        return True
    read_only = isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
    if isinstance(exc, USER_ERRORS) or is_disk_full(exc) or read_only:
        return False
    text = str(exc)
    return not any(word in text for word in ("401", "403", "Unauthorized", "Forbidden", "credentials"))


def _resume_hint(exc: BaseException, args) -> str:
    """A pipeline run that failed where a resume can fix it: the command that resumes it (what completed is
    reused). None under errors the user must fix first: resuming would fail the same way."""
    run_id = getattr(exc, "run_id", None)
    if not run_id or f"dllm-flow resume {run_id}" in str(exc) or not _resumable(exc):
        return ""
    return f"\n  resume with: dllm-flow resume {run_id} --workdir {args.workdir}"


def _log_hint(exc: BaseException) -> str:
    """Where the full traceback is: the command's log file (written there now), or `--debug`."""
    import traceback

    if _session.log_file is None:
        return "" if isinstance(exc, USER_ERRORS) else " (rerun with --debug for the traceback)"
    try:
        with open(_session.log_file, "a", encoding="utf-8") as log:
            log.write("dllm-flow: error:\n" + "".join(traceback.format_exception(exc)))
    except OSError:  # the disk that is full holds the log too
        return " (rerun with --debug for the traceback)"
    return f" (details: {_session.log_file})"


if __name__ == "__main__":
    sys.exit(main())
