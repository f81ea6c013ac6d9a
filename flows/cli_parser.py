"""`dllm-flow`'s argument parser: each subcommand's arguments, bound to the function that runs it.

The functions come from the caller (flows/cli.py), looked up each time the parser is built."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

from dllm_common.config.dflash import MAX_TREE_BRANCHES

DEFAULT_WORKDIR = "work"
EXPORT_FORMATS = ("zlab", "speculators", "dllm-flow")  # tasks/speculative/export.py FORMATS (torch-free here)
GPU_MEMORY_ENV = "DLLM_FLOW_GPU_MEMORY"  # the training GPU's memory, e.g. 80GB (docs/planning.md)
VERIFY_HELP = "re-hash every reused stage's files (default: sizes only); a damaged stage is set aside and rebuilt"

Commands = Mapping[str, Callable[[argparse.Namespace], int]]  # subcommand → the function that runs it


def tree_branches(text: str) -> int:
    """`--tree-branches K`: 0 … MAX_TREE_BRANCHES, the bound of `dflash.eval_tree_branches` (the draft's block bounds
    it too: `tasks.commands.generate.check_tree_branches`, once the checkpoint is loaded)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of branches") from None
    if not 0 <= value <= MAX_TREE_BRANCHES:
        raise argparse.ArgumentTypeError(
            f"{value} is outside 0..{MAX_TREE_BRANCHES} (0: one path; at most {MAX_TREE_BRANCHES} branches beside each "
            "block, as dflash.eval_tree_branches)"
        )
    return value


def build_parser(commands: Commands) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dllm-flow", description="Declarative training pipelines for diffusion LMs.")
    p.add_argument("--debug", action="store_true", help="print Prefect's console log and full tracebacks")
    sub = p.add_subparsers(dest="command", required=True)
    _pipeline_commands(sub, commands)
    _add_generate(sub, commands)
    _inspection_commands(sub, commands)
    return p


def _pipeline_commands(sub, commands: Commands) -> None:
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
    run.set_defaults(func=commands["run"])
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
    res.set_defaults(func=commands["resume"])
    val = sub.add_parser("validate", help="print the resolved config, or what is wrong with it")
    val.add_argument("config")
    val.add_argument("--set", action="append", default=[], metavar="dotted.key=value")
    val.set_defaults(func=commands["validate"])
    pl = sub.add_parser("plan", help="predict each strategy's memory per GPU and time per step (no GPU needed)")
    pl.add_argument("config")
    pl.add_argument("--set", action="append", default=[], metavar="dotted.key=value")
    pl.add_argument("--gpus", type=int, default=None, help="data-parallel ranks (default: the config's world size)")
    pl.add_argument("--gpu-memory", default="80GB", help="memory per GPU, e.g. 80GB, 141GB (default 80GB)")
    pl.add_argument("--gpu-flops", default=None, help="peak FLOP/s per GPU, e.g. 989T (default: H100 at the precision)")
    pl.add_argument("--mfu", type=float, default=None, help="the share of that peak the step runs at (default 0.4)")
    pl.add_argument(
        "--step-cost",
        default=None,
        metavar="FILE",
        help="each strategy's measured step cost ÷ its FLOPs, written by benchmarks/step_cost.py --json FILE on the "
        "GPU you plan for: multiplies its time (default: each step costs its counted FLOPs)",
    )
    pl.set_defaults(func=commands["plan"])
    runs = sub.add_parser("runs", help="past pipeline runs with the status of each stage")
    runs.add_argument("--workdir", default=DEFAULT_WORKDIR)
    runs.set_defaults(func=commands["runs"])


def _add_generate(sub, commands: Commands) -> None:
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
    _add_speculative_options(gen)
    gen.add_argument("--seed", type=int, default=42)
    gen.add_argument("--infill", action="store_true", help="fill each [MASK] in the prompt with 20 tokens")
    gen.add_argument("--adapter", default=None, help="merge a LoRA adapter dir into the checkpoint first")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--raw", action="store_true", help="never use the chat template")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--workdir", default=DEFAULT_WORKDIR, help="its MLflow registry resolves models:/ URIs")
    gen.add_argument("--tracking-uri", default=None)
    gen.set_defaults(func=commands["generate"])


def _add_speculative_options(gen) -> None:
    """`generate`'s options that only the speculative sampler (a DFlash draft) reads."""
    gen.add_argument(
        "--lookup-ngram",
        type=int,
        default=0,
        help="speculative sampler: when the last N..4 tokens recur in the context, propose what followed them (0: off)",
    )
    gen.add_argument(
        "--sampled-proposals",
        default=None,
        choices=["walk", "backbone"],
        help="speculative sampler at T > 0: a DFlash 2 / Domino draft samples its serial walk (as the engines do) or "
        "proposes from its backbone (default: DFlash 2 its backbone, Domino its walk)",
    )
    gen.add_argument(
        "--tree-branches",
        type=tree_branches,
        default=0,
        metavar="K",
        help=f"speculative sampler, greedy: verify K alternative branches beside each block, K ≤ {MAX_TREE_BRANCHES} "
        "and < the draft's block size (docs/strategies.md §10.16)",
    )
    gen.add_argument(
        "--confidence-threshold",
        type=float,
        default=0.0,
        metavar="THETA",
        help="speculative sampler, a DSpark draft: verify a block only up to where the running product of its "
        "confidence head's predicted acceptances falls below THETA (0: whole blocks; docs/strategies.md §10.17)",
    )
    gen.add_argument(
        "--confidence-rule",
        default="product",
        choices=["product", "position"],
        help="with --confidence-threshold: cut where the running product of predicted acceptances falls below THETA "
        "(product, the default) or where one position's own does (position, DeepSpec's rule; may verify none)",
    )
    gen.add_argument(
        "--redraft",
        default=None,
        help="with --tree-branches: a second draft (path or models:/NAME@ALIAS, trained with dflash.loss_type: "
        "variable_prefix) that re-drafts each branch behind its shown prefix",
    )


def _inspection_commands(sub, commands: Commands) -> None:
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
    rep.set_defaults(func=commands["report"])
    ui = sub.add_parser("ui", help="MLflow UI (or, with --prefect, the Prefect UI) on 127.0.0.1 for a workdir")
    ui.add_argument("run_id", nargs="?", default=None, help="--prefect: the pipeline run (default: the latest)")
    ui.add_argument("--workdir", default=DEFAULT_WORKDIR)
    ui.add_argument("--experiment", default=None, help="default: the workdir's most recent experiment")
    ui.add_argument("--prefect", action="store_true", help="the Prefect UI on the pipeline run's flow run instead")
    ui.add_argument("--host", default="127.0.0.1")
    ui.add_argument("--port", type=int, default=None, help="default: 5000 (MLflow), 4200 (Prefect)")
    ui.set_defaults(func=commands["ui"])
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
    exp.set_defaults(func=commands["export"])
