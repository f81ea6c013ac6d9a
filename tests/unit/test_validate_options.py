"""What `dllm-flow validate` prints for each strategy's options (`strategies.options.printed_options`): the resolved
values training uses, without a `mask_token_id` for a strategy that never reads one."""

import pytest
from conftest import ROOT

from strategies import strategy_class
from strategies.options import check_spec, load_config, printed_options


@pytest.mark.parametrize("config", ["compare.yaml", "dflash.yaml"])
def test_validate_prints_a_mask_id_only_for_strategies_that_read_one(config):
    spec = load_config(ROOT / "configs" / config, ["dllm.mask_token_id=7"] if config == "compare.yaml" else [])
    printed, resolved = printed_options(spec), check_spec(spec)
    assert list(printed) == list(spec.pipeline.strategies)
    for name, values in printed.items():
        full = resolved[name].model_dump(mode="json")
        if strategy_class(name).uses_mask_token:
            assert values == full
        else:  # block_diffusion: uniform noise, the id is never read
            assert "mask_token_id" not in values and values == {k: v for k, v in full.items() if k != "mask_token_id"}
    if config == "compare.yaml":
        assert printed["mdlm"]["mask_token_id"] == 7 and "mask_token_id" not in printed["block_diffusion"]


def test_dllm_flow_validate_prints_them(capsys):
    import json

    from flows.cli import main

    assert main(["validate", str(ROOT / "configs/compare.yaml"), "--set", "dllm.mask_token_id=7"]) == 0
    printed = json.loads(capsys.readouterr().out)["strategy_options"]
    assert printed == printed_options(load_config(ROOT / "configs/compare.yaml", ["dllm.mask_token_id=7"]))
    assert "mask_token_id" not in printed["block_diffusion"] and printed["mdlm"]["mask_token_id"] == 7
