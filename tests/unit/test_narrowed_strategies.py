"""A config's own strategy list narrowed on the command line (`--set 'pipeline.strategies=[...]'`, to rerun one row
of a comparison): what only the dropped strategies read is set aside with one note, typos are still refused, and
the kept strategies train under the same stage keys as in the full config (so a narrowed rerun reuses them)."""

import json

import pytest
from conftest import ROOT

from dllm_common.config import ConfigError
from strategies.options import load_config, narrow_strategies

COMPARE = ROOT / "configs" / "compare.yaml"
STRATEGIES = ["mdlm", "scdd", "hybrid", "idlm", "block_diffusion"]


def test_compare_lists_the_strategies_this_test_narrows_to():
    assert list(load_config(COMPARE).pipeline.strategies) == STRATEGIES


@pytest.mark.parametrize("name", STRATEGIES)
def test_compare_narrowed_to_each_strategy_validates(name, capsys):
    from flows.cli import main
    from strategies.options import resolve_options

    assert main(["validate", str(COMPARE), "--set", f"pipeline.strategies=[{name}]"]) == 0
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert printed["config"]["pipeline"]["strategies"] == [name] and list(printed["strategy_options"]) == [name]
    full = resolve_options(load_config(COMPARE), name).model_dump(mode="json")  # what the full config gives it
    assert printed["strategy_options"][name] == {
        k: v for k, v in full.items() if k in printed["strategy_options"][name]
    }
    note = [ln for ln in err.splitlines() if ln.startswith("dllm-flow: note:")]
    assert len(note) == 1 and f"pipeline.strategies narrowed to ['{name}']: ignoring " in note[0], err


def test_compare_narrowed_to_each_strategy_plans():
    """`dllm-flow plan`'s estimate for each narrowed config, at a micro-batch of 4 rows and its configured memory
    setting only (tracing the config's 32 rows in every setting costs minutes on 2 cores; the narrowing is what is
    checked here, the plan's numbers in tests/pipeline/test_plan.py)."""
    from tasks.commands.plan import cluster_for, plan, render

    for name in STRATEGIES:
        small = ["train.global_batch_size=4", "train.micro_batch_size=4"]
        spec = load_config(COMPARE, [f"pipeline.strategies=[{name}]", *small])
        cluster = cluster_for(spec, None, None, None, None, None)
        [planned] = plan(spec, cluster, variants=False)
        assert planned.strategy == name and planned.flops_per_token > 0 and planned.peak > 0
        assert f"| {name} |" in render(spec, cluster, [planned], str(COMPARE))


def test_what_is_set_aside_is_what_only_the_dropped_strategies_read():
    file_raw = {
        "pipeline": {"strategies": ["mdlm", "scdd", "block_diffusion"]},
        "eval": {"overrides": {"scdd": {"temperature": 1.3}}},
        "dllm": {
            "loss_weighting": "flat",  # mdlm and scdd
            "uniform_ratio": 0.1,  # scdd alone
            "overrides": {"block_diffusion": {"block_size": 16}, "mdlm": {"eps": 0.01}},
        },
    }
    raw = json.loads(json.dumps(file_raw))
    raw["pipeline"]["strategies"] = ["mdlm"]
    narrowed, ignored = narrow_strategies(file_raw, raw)
    assert ignored == ["dllm.uniform_ratio", "dllm.overrides.block_diffusion", "eval.overrides.scdd"]
    assert narrowed["dllm"] == {"loss_weighting": "flat", "overrides": {"mdlm": {"eps": 0.01}}}
    assert narrowed["eval"] == {"overrides": {}}
    assert raw["dllm"]["uniform_ratio"] == 0.1  # the input is not changed
    assert narrow_strategies(file_raw, file_raw) == (file_raw, [])  # the file's own list: nothing set aside


def test_a_typo_is_still_refused_when_narrowed():
    narrowed = "pipeline.strategies=[mdlm]"
    with pytest.raises(ConfigError, match=r"dllm: unknown key dllm\.loss_wieghting"):
        load_config(COMPARE, [narrowed, "dllm.loss_wieghting=flat"])
    with pytest.raises(ConfigError, match=r"eval\.overrides\.hybird: 'hybird' is not in pipeline\.strategies"):
        load_config(COMPARE, [narrowed, "eval.overrides.hybird.temperature=1.0"])
    # a key the command line sets is the user's, not the file's: checked as ever
    with pytest.raises(ConfigError, match=r"dllm: \['block_length'\] set but no strategy of this pipeline"):
        load_config(COMPARE, ["pipeline.strategies=[mdlm, scdd, hybrid, block_diffusion]", "dllm.block_length=4"])


def test_the_file_itself_is_still_held_to_its_own_list(tmp_path):
    """Only a command-line narrowing sets keys aside: the same keys in a file that lists one strategy are refused."""
    text = COMPARE.read_text().replace("strategies: [mdlm, scdd, hybrid, idlm, block_diffusion]", "strategies: [mdlm]")
    (tmp_path / "one.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"overrides\.\w+: '\w+' is not in pipeline\.strategies \['mdlm'\]"):
        load_config(tmp_path / "one.yaml")


def test_a_narrowed_rerun_trains_under_the_full_configs_keys():
    from types import SimpleNamespace

    from tasks.train import stage_of

    data = SimpleNamespace(key="d" * 16)
    full = load_config(COMPARE)
    for name in STRATEGIES:
        narrowed = load_config(COMPARE, [f"pipeline.strategies=[{name}]"])
        assert stage_of(narrowed, name, data, "w") == stage_of(full, name, data, "w"), name
