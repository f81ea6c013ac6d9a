"""Every shipped config through every command that takes a config (issue 41, item 3): `validate` and `plan` on each
`configs/*.yaml`, `run` on each at smoke scale. The configs are globbed, so a new one is covered without a change
here.

- validate: as shipped.
- plan: as shipped (in this process), but configs/plan-8b.yaml, whose full plan traces a 4-micro-batch step of
  Llama 3 8B at full depth (1.5 min on 2 cores), is planned at one micro-batch of 8 rows of 512 tokens
  (`PLAN_SET`): the same model, precision, FSDP2 layout and memory switches.
- run: each config whose models are all built from the config itself (a tiny `model:`, a DFlash target that
  `pretrain_target` trains) runs through every stage with `SMOKE`: 2 steps of a 2-layer model of width 64 on a few
  documents, every evaluation at its smallest, and no `eval.scorer` (loading SmolLM2 to score samples would take
  most of the budget; the scorer has its own tests). Not run, by `PRETRAINED` (validated and planned only):
    - plan-8b.yaml ships Llama 3 8B's config.json alone, no weights: there is nothing to train, which is the point
      of a planning config.
    - idlm-smollm2.yaml and dflash-smollm2.yaml exist to fine-tune SmolLM2-135M with LoRA and to train a draft
      against it: with a tiny model in its place neither would be that config any more, and the 135M model's
      regeneration, feature cache and training do not fit this file's few minutes on 2 cores.
  `test_only_the_configs_said_above_are_not_run` fails when a new config would join them, so each one is said here.
"""

import subprocess
import sys

import pytest
from conftest import ROOT
from runkit import environ

from dllm_common.config import ConfigError
from flows import cli
from strategies.options import load_config
from tasks.commands import plan
from tasks.commands.plan import estimate as plan_estimate
from tasks.commands.plan import trace as plan_trace

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PLAN_SET = {"plan-8b": ["train.micro_batch_size=8", "data.seq_len=512"]}
PRETRAINED = {"plan-8b", "idlm-smollm2", "dflash-smollm2"}  # validated and planned, not run: the docstring says why

SMOKE = [
    "data.max_documents=6",
    "data.max_train_rows=64",
    "data.max_val_rows=16",
    "tokenizer.vocab_size=512",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_heads=4",
    "train.steps=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.warmup_steps=1",
    "train.val_every=2",
    "train.val_rows=4",
    "train.log_every=1",
    "train.checkpoint_every=2",
    "eval.val_rows=4",
    "eval.t_samples=1",
    "eval.num_samples=1",
    "eval.data_rows=1",
    "eval.sample_length=8",
    "eval.sample_steps=4",
    "eval.sample_block_size=4",
    "eval.scorer=null",
]
DFLASH_SMOKE = [  # the target `pretrain_target` trains, its regenerated rows and the draft's evaluation
    "model.num_layers=1",  # the draft, as shipped: one layer reads one target layer among 1 … T − 3
    "dflash.pretrain.num_layers=4",
    "dflash.pretrain.steps=2",
    "dflash.pretrain.batch_size=4",
    "dflash.pretrain.warmup_steps=1",
    "dflash.pretrain.val_every=2",
    "dflash.pretrain.val_rows=4",
    "dflash.regenerate.max_rows=16",
    "dflash.eval_prompts=1",
    "dflash.eval_max_new_tokens=8",
]
GRPO_SMOKE = ["grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.sample_steps=4"]


def _ids(paths) -> list[str]:
    return [p.stem for p in paths]


def _sets(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def _runnable(path) -> bool:
    spec = load_config(path)
    return spec.model.kind == "tiny" and spec.tokenizer.kind == "train_bpe" and spec.dflash.target_model_id is None


def _cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main([*args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("path", CONFIGS, ids=_ids(CONFIGS))
def test_validate_accepts_every_shipped_config(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # a config's relative model.path (plan-8b) is relative to the checkout
    code, out, err = _cli(capsys, "validate", str(path))
    assert code == 0, err
    assert out.strip(), "validate prints the resolved config"


@pytest.mark.parametrize("path", CONFIGS, ids=_ids(CONFIGS))
def test_plan_plans_every_shipped_config(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = _cli(capsys, "plan", str(path), *_sets(PLAN_SET.get(path.stem, [])))
    assert code == 0, err
    spec = load_config(path)
    for name in spec.pipeline.strategies:  # memory, activations, compute; and the GRPO stage's where it runs
        rows = 3 + (spec.grpo is not None)
        assert len([line for line in out.splitlines() if line.startswith(f"| {name} |")]) == rows, out


def test_only_the_configs_said_above_are_not_run():
    assert {p.stem for p in CONFIGS if not _runnable(p)} == PRETRAINED


RUNNABLE = [p for p in CONFIGS if p.stem not in PRETRAINED]


@pytest.mark.parametrize("path", RUNNABLE, ids=_ids(RUNNABLE))
def test_run_runs_every_shipped_config_at_smoke_scale(path, tmp_path, prefect_api):
    spec = load_config(path)
    items = SMOKE + (DFLASH_SMOKE if "dflash" in spec.pipeline.strategies else [])
    items += GRPO_SMOKE if spec.grpo is not None else []
    cmd = [sys.executable, "-m", "flows.cli", "run", str(path), *_sets(items), "--workdir", str(tmp_path / "w")]
    out = subprocess.run(cmd, cwd=ROOT, env=environ(prefect_api), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "completed; report:" in out.stdout
    for name in spec.pipeline.strategies:
        assert f"evaluate[{name}]: ran" in out.stdout + out.stderr
        if spec.grpo is not None:
            assert f"evaluate_grpo[{name}]: ran" in out.stdout + out.stderr


def _first_strategy_only(monkeypatch):
    """`plan.plan` of the first strategy alone, without the other memory settings: the layout is the point."""
    planned = []

    def first(spec, cluster, variants=True):
        planned.append(spec)
        return [plan.plan_strategy(spec, spec.pipeline.strategies[0], cluster, variants=False)]

    monkeypatch.setattr(plan, "plan", first)
    return planned


def test_plan_on_more_gpus_takes_the_largest_micro_batch_that_divides(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    planned = _first_strategy_only(monkeypatch)
    code, out, err = _cli(capsys, "plan", "configs/compare.yaml", "--gpus", "8")  # 32 rows, micro-batch 32
    assert code == 0, err
    chosen = [line for line in out.splitlines() if "train.micro_batch_size" in line]
    assert chosen == [
        "dllm-flow plan: on 8 GPUs each rank gets 4 of the global batch of 32 rows, which train.micro_batch_size "
        "(32) does not divide: planned with micro-batches of 4 (the largest that does; --set "
        "train.micro_batch_size=N plans another)"
    ]
    assert "global batch 32 = 8 ranks × 1 micro-batch × 4 rows" in out
    assert planned[-1].train.micro_batch_size == 4

    # a micro-batch that divides is planned as given, with no such line; one that cannot is still refused
    code, out, err = _cli(capsys, "plan", "configs/compare.yaml", "--gpus", "8", "--set", "train.micro_batch_size=2")
    assert code == 0, err
    assert "does not divide" not in out and "8 ranks × 2 micro-batches × 2 rows" in out
    code, out, err = _cli(capsys, "plan", "configs/compare.yaml", "--gpus", "3")
    assert code == 2 and "must be a multiple of 3 GPUs" in err


def test_plan_refuses_a_sequence_too_long_to_trace_in_one_line_naming_data_seq_len(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for length in (10_000_000, 1_000_000):  # beyond any training row; within one, beyond what a trace holds
        code, out, err = _cli(capsys, "plan", "configs/quickstart.yaml", "--set", f"data.seq_len={length}")
        assert code == 2 and "Traceback" not in err and "Exception" not in err, err
        assert err.startswith("dllm-flow: error:") and "data.seq_len" in err, err
    assert err.strip().count("\n") == 0 and f"data.seq_len {length} is too long to plan at 32 rows" in err
    assert "16384 tokens a row" in err  # what would trace at this micro-batch


def test_a_trace_that_meets_a_data_dependent_size_names_data_seq_len(monkeypatch):
    """Past the up-front bound, a selection by a mask too large to have stayed real is the same refusal."""
    spec = load_config(ROOT / "configs" / "smoke.yaml", ["data.seq_len=4096"])
    monkeypatch.setattr(plan_trace, "REAL_LIMIT", 1024)  # every per-token tensor of the step stays fake
    monkeypatch.setattr(plan_estimate, "traceable_rows", lambda spec: 1 << 20)  # and the up-front check lets it through
    with pytest.raises(ConfigError, match=r"data\.seq_len 4096 is too long to plan at 8 rows .*aten\.nonzero"):
        plan.plan_strategy(spec, "mdlm", plan.Cluster(1, None), variants=False, sizing=False)
