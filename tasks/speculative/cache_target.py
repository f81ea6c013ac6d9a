"""Stage `cache_target`: the frozen DFlash target run once over the prepared dataset.

The selected layers' hidden states (`[L, n·H]` per row, bf16/fp16/fp32), and with `dflash.distill_top_k`
the target's top-k next-token distribution at every position, go to safetensors shards
in `store/cache_target/<key>/features/`, key = (target weights digest, data key, layer ids, dtype,
top k, code). Draft trainings with `dflash.target_features: cached` read them memory-mapped
(`strategies.dflash.features.CachedFeatures`) instead of running the target every step; any run
or worker with the same key reuses the entry, and the store's one protocol (`Store.reuse_or_build`)
keeps two workers from computing it twice. The manifest records rows, bytes and build seconds.
"""

from __future__ import annotations

from pathlib import Path

from dllm_common.config import ConfigError, PipelineSpec
from dllm_common.store import stage_key
from strategies import strategy_class
from strategies.dflash.features import write_feature_cache
from strategies.dflash.window_config import vocabulary_problem
from strategies.options import option_source
from tasks.common import StageRef, prefect_task, stage_code_version, store_for
from tasks.devices import stage_device
from tasks.rows import load_split
from tasks.speculative.setup import DraftSetup, features_dir, load_spec_target
from tasks.stages import Stage

STAGE = "cache_target"
__all__ = ["cache_target", "cache_target_task", "features_dir", "stage_of"]


def _top_k(spec: PipelineSpec) -> int:
    """How many of the target's most probable next tokens to store per position (`dflash.distill_top_k`)."""
    return DraftSetup.of(spec).options.distill_top_k


def stage_of(spec: PipelineSpec, target: StageRef, data: StageRef, workdir: str, **_) -> tuple[str, str]:
    setup = DraftSetup.of(spec)
    config = {"layer_ids": setup.layer_ids(spec, target), "dtype": spec.dflash.cache_dtype}
    if _top_k(spec):  # keyed only when set: a features-only cache keeps its key
        config["top_k"] = _top_k(spec)
    upstream = {"target_weights": target.info["weights_digest"], "data": data.key}
    # the draft strategy's class decides which strategy's options (layers, top-k) the cache serves: its modules
    # are in the key, as in any stage of one strategy (docs/architecture.md, "Stage keys")
    return STAGE, stage_key(STAGE, config, upstream, stage_code_version(__name__, setup.strategy))


def _build(spec: PipelineSpec, target: StageRef, data: StageRef, out: Path) -> dict:
    model = load_spec_target(spec, target.info["model_path"], stage_device(spec))
    splits = {name: load_split(data.path, name)[0] for name in ("train", "val")}
    layer_ids = DraftSetup.of(spec).layer_ids(spec, target)
    index = write_feature_cache(
        model, splits, layer_ids, out / "features", dtype=spec.dflash.cache_dtype, top_k=_top_k(spec), progress=True
    )
    info = {
        "target": target.key,
        "target_weights": target.info["weights_digest"],
        "data": data.key,
        "layer_ids": layer_ids,
        "dtype": spec.dflash.cache_dtype,
        "top_k": index["top_k"],
        "rows": {name: len(ids) for name, ids in splits.items()},
        "bytes": index["bytes"],
        "build_seconds": index["seconds"],
    }
    return {"upstream": {"target": target.key, "data": data.key}, "info": info}


def cache_target(spec: PipelineSpec, target: StageRef, data: StageRef, workdir: str) -> StageRef:
    """Publish (or reuse) the feature cache of `target` over both prepared splits."""
    # a top-k past the target's vocabulary, which config validation could not see (a hub or GGUF target, a
    # pretrained tokenizer): one line naming the key, not torch's `selected index k out of range` mid-cache
    source = f"{target.info.get('source') or 'the target trained by this pipeline'}: its config's vocab_size"
    setup = DraftSetup.of(spec)
    problem = vocabulary_problem(setup.options, target.info.get("vocab_size"), source)
    if problem:
        raise ConfigError(f"{option_source(spec, setup.strategy, problem[0])} {problem[1]}")
    stage, key = stage_of(spec, target, data, workdir)
    entry, reused = store_for(workdir).reuse_or_build(stage, key, lambda out: _build(spec, target, data, out))
    ref = StageRef.of(entry, reused)
    if not reused:
        info = ref.info
        print(
            f"[dllm-flow] cache_target: {sum(info['rows'].values())} rows × layers {info['layer_ids']} "
            f"({info['dtype']}) = {info['bytes'] / 2**20:.1f} MiB in {info['build_seconds']:.1f}s",
            flush=True,
        )
    return ref


cache_target_task = prefect_task(cache_target, name="cache_target", stage_of=stage_of)


def _consumes(spec: PipelineSpec, _strategy) -> dict:
    """The target's features over the rows its users train on: the regenerated ones where a strategy does."""
    regenerated = any(strategy_class(s).training_data(spec) == "regenerated" for s in spec.pipeline.strategies)
    return {"target": "target", "data": "regenerated" if regenerated else "data"}


DECLARATION = Stage(name=STAGE, task=cache_target_task, produces="features", consumes=_consumes, on_demand=True)
