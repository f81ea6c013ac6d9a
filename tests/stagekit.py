"""One strategy through the pipeline's stages with the plain stage functions (train → evaluate → report, and
`dllm-flow generate` with each of its samplers), checked against what the strategy declares: its likelihoods,
its evaluation kind, its samplers and the settings they read. Nothing here names a strategy: the stage test runs
every registered one through it, the recipe test a strategy it registers itself (docs/architecture.md, "How a
strategy plugs in")."""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from dllm_common.tracking import default_tracking_uri

LIKELIHOOD_METRICS = {"nelbo": "eval/nelbo", "ar_nll": "eval/ar_nll"}  # `DLLMStrategy.likelihoods` → metric
SETTING_WORDS = {  # how the report names a sampler setting in the samples heading
    "temperature": "temperature",
    "top_p": "top-p",
    "top_k": "top-k",
    "threshold": "threshold",
    "remasking": "remasking",
}


@dataclass
class Staged:
    trained: object
    evaluated: object
    reported: object
    metrics: dict
    report: str


def history(workdir, run_id, key) -> list[float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(default_tracking_uri(workdir))
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def through_the_stages(spec, strategy, data, workdir, inputs=None, *, val_drop=0.3) -> Staged:
    """Train `strategy` on `data` (with `inputs`, the upstream stages it declares), evaluate and report it, and
    generate with every sampler it declares; assert what its declarations promise. `val_drop`: how far (nats)
    the fixed-noise val/loss must fall over the run."""
    from strategies import strategy_class
    from strategies.registry import SAMPLERS, registration
    from tasks.evaluate import evaluate
    from tasks.report import report
    from tasks.train import train

    cls, reg = strategy_class(strategy), registration(strategy)
    workdir = str(workdir)
    trained = train(spec, strategy, data, workdir, inputs=inputs)
    val = history(workdir, trained.mlflow_run_id, "val/loss")
    assert val[-1] < val[0] - val_drop, val

    evaluated = evaluate(spec, strategy, trained, data, workdir)
    metrics = evaluated.info["metrics"]
    for likelihood, key in LIKELIHOOD_METRICS.items():  # exactly the likelihoods it declares
        if likelihood in cls.likelihoods:  # a diffusion evaluation puts bits per byte beside each
            assert metrics[key] > 0 and (cls.evaluation != "diffusion" or metrics[key + "_bpb"] > 0), key
        else:
            assert key not in metrics and key + "_bpb" not in metrics, key
    card = json.loads((Path(evaluated.path) / "repro_card.json").read_text())
    assert card["strategy"] == strategy and card["sampler_name"] == cls.sampler_name
    own = SAMPLERS[cls.samplers[0]]  # what its evaluation samples with
    assert card["sampler_settings"] == list(own.settings)
    if cls.evaluation == "diffusion":  # likelihoods + samples at the eval settings
        assert reg.samples and card["sampler"]["steps"] == spec.eval.sample_steps
        assert metrics["eval/nfe"] >= 1 and metrics["eval/tokens_per_s"] > 0 and metrics["eval/entropy"] >= 0
    else:  # speculative decoding against the target: acceptance, and the target's own text
        assert cls.evaluation == "speculative" and not reg.samples
        assert metrics["dflash/exact_match"] == 1.0 and metrics["dflash/tau"] >= 1.0

    # the same seed gives the same metrics (wall-clock rates aside), from a fresh store
    again = evaluate(spec, strategy, dataclasses.replace(trained, mlflow_run_id=None), data, workdir + "-again")
    timeless = lambda m: {k: v for k, v in m.items() if "per_s" not in k and "speedup" not in k}  # noqa: E731
    assert timeless(again.info["metrics"]) == timeless(metrics)

    reported = report(spec.pipeline.name, [trained], [evaluated], workdir, experiment=spec.tracking.experiment)
    text = (Path(reported.path) / "report.md").read_text()
    assert f"| {strategy} |" in text
    plots = {p.name for p in Path(reported.path).glob("*.png")}
    has_likelihood = bool(cls.likelihoods)
    assert ("nelbo.png" in plots) == has_likelihood and ("eval/nelbo ± se" in text) == ("nelbo" in cls.likelihoods)
    assert ("eval/ar_nll ± se" in text) == ("ar_nll" in cls.likelihoods)
    if "## Samples against real text (" in text:  # the heading names the settings its sampler reads, and only those
        heading = text.split("## Samples against real text (", 1)[1].split(")\n", 1)[0]
        for setting, word in SETTING_WORDS.items():
            if setting not in own.settings:
                assert word not in heading, (setting, heading)
        assert ("temperature" in heading) == ("temperature" in own.settings)
        assert ("remasking" in heading) == ("remasking" in own.settings)
    else:
        assert cls.evaluation != "diffusion" or not metrics.get("eval/data_rows"), "samples table missing"

    _generate_with_every_sampler(strategy, trained, cls)
    return Staged(trained, evaluated, reported, metrics, text)


def _generate_with_every_sampler(strategy, trained, cls) -> None:
    """The checkpoint alone rebuilds its strategy for `dllm-flow generate`; every sampler its registration
    declares decodes from it, streamed (the first is what `--sampler auto` picks)."""
    from strategies.sampling import SamplerConfig
    from tasks.commands.generate import Request, check_sampler, default_temperature, generate
    from tasks.evaluation.trained_model import load_for_generation
    from tasks.train import model_dir

    loaded = load_for_generation(model_dir(trained), "cpu")
    assert loaded.meta["strategy"] == strategy
    assert check_sampler(strategy, "auto", False) == cls.samplers[0]
    for sampler in cls.samplers:
        pieces = []
        config = SamplerConfig(
            steps=8, max_new_tokens=8, block_size=4, temperature=default_temperature(sampler), sampler=sampler
        )
        out = generate(loaded, Request("O", check_sampler(strategy, sampler, False), config), "cpu", pieces.append)
        assert out.nfe >= 1 and "".join(pieces) == out.text, sampler


def dflash_spec(tiny_spec, **dflash):
    """The tests' tiny pipeline as a DFlash one: a 1-layer draft over a small pretrained target."""
    from strategies.options import validate_config

    raw = tiny_spec.model_dump(mode="json")
    raw["pipeline"]["strategies"] = ["dflash"]
    raw["model"].update(hidden_size=32, num_layers=1, num_heads=2)
    raw["train"].update(steps=16, val_every=4)
    raw["dflash"] = {
        "pretrain": {"num_layers": 4, "num_heads": 2, "steps": 30, "batch_size": 8, "val_every": 10, "val_rows": 8},
        "block_size": 4,
        "num_blocks_per_sample": 2,
        "eval_prompts": 2,
        "eval_prompt_len": 8,
        "eval_max_new_tokens": 8,
        **dflash,
    }
    return validate_config(raw)


def tiny_dflash_target():
    """The DFlash unit tests' frozen target: a 5-layer llama of width 32 over 64 tokens, the same in every process."""
    from strategies.models import build_model, tiny_model_config

    model = build_model(tiny_model_config("llama", 64, 128, 32, 5, 4, None, None, False), seed=0)
    return model.eval().requires_grad_(False)


def tiny_draft_config(**changes):
    """The draft config those tests pair with `tiny_dflash_target`: 2 layers, grouped-query attention, block 4,
    reading 2 of the target's 5 layers, [MASK] = 63; `changes` replace fields."""
    from dataclasses import replace

    from strategies.dflash.blocks import build_target_layer_ids
    from strategies.dflash.draft import DFlashDraftConfig

    base = DFlashDraftConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        block_size=4,
        target_layer_ids=build_target_layer_ids(5, 2),
        mask_token_id=63,
        num_target_layers=5,
        vocab_size=64,
    )
    return replace(base, **changes)


def expected_statuses(config: str, rebuilt: set[str] = frozenset(), overrides=()) -> dict[str, str]:
    """The run record's stage statuses a rerun of `config` should show when the stages in `rebuilt` must run again:
    they and every stage downstream of them COMPLETED, the rest REUSED (`rebuilt` empty: a first run, all
    COMPLETED). The stages come from their declarations (`tasks.stages.derive`), so a new stage needs no edit here."""
    from strategies import strategy_class
    from strategies.options import load_config
    from tasks.stages import derive

    nodes = derive(load_config(config, list(overrides), note=False), strategy_class).nodes()
    if not rebuilt:
        return {n.name: "COMPLETED" for n in nodes}
    ran = set(rebuilt)
    for n in nodes:  # topological order: upstream first
        if any(u.name in ran for u in n.upstream()):
            ran.add(n.name)
    return {n.name: "COMPLETED" if n.name in ran else "REUSED" for n in nodes}


def dflash_pair():
    """A frozen 5-layer target and a 2-layer draft (block 4, grouped-query attention), built the same in every
    process (the DFlash unit tests' `pair`, and each gloo rank's)."""
    import torch

    from strategies.dflash.draft import DFlashDraftModel

    torch.manual_seed(1)
    return tiny_dflash_target(), DFlashDraftModel(tiny_draft_config()).eval()
