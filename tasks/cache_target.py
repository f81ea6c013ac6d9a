"""Stage `cache_target`: the frozen DFlash target run once over the prepared dataset.

The selected layers' hidden states (`[L, n·H]` per row, bf16/fp16/fp32) go to safetensors shards
in `store/cache_target/<key>/features/`, key = (target weights digest, data key, layer ids, dtype,
code). Draft trainings with `dflash.target_features: cached` read them memory-mapped
(`strategies.dflash_strategy.CachedFeatures`) instead of running the target every step; any run
or worker with the same key reuses the entry, and the store's cross-process lock keeps two workers
from computing it twice. The manifest records rows, bytes and build seconds.
"""

from __future__ import annotations

from pathlib import Path

from dllm_common.config import PipelineSpec
from dllm_common.store import stage_key
from tasks.common import StageRef, code_version, prefect_task, store_for

STAGE = "cache_target"


def layer_ids_for(spec: PipelineSpec, target: StageRef) -> list[int]:
    """`dflash.target_layer_ids`, a draft checkpoint's own, or `_build_target_layer_ids(target, draft)`."""
    from strategies.dflash import _build_target_layer_ids

    if spec.dflash.target_layer_ids:
        ids = list(spec.dflash.target_layer_ids)
    elif spec.model.kind == "pretrained":
        from strategies.dflash import DFlashDraftConfig
        from strategies.models import resolve_model_path

        ids = list(DFlashDraftConfig.from_dir(resolve_model_path(spec.model.path)).target_layer_ids)
    else:
        ids = _build_target_layer_ids(
            int(target.info["num_layers"]), spec.model.num_layers
        )  # a draft built from `model:`
    bad = [i for i in ids if not 0 <= i < int(target.info["num_layers"])]
    if bad:
        raise ValueError(f"dflash.target_layer_ids {bad} are outside the target's {target.info['num_layers']} layers")
    return ids


def stage_of(spec: PipelineSpec, target: StageRef, data: StageRef, workdir: str, **_) -> tuple[str, str]:
    config = {"layer_ids": layer_ids_for(spec, target), "dtype": spec.dflash.cache_dtype}
    upstream = {"target_weights": target.info["weights_digest"], "data": data.key}
    return STAGE, stage_key(STAGE, config, upstream, code_version("strategies.feature_cache", "tasks.cache_target"))


def cache_target(spec: PipelineSpec, target: StageRef, data: StageRef, workdir: str) -> StageRef:
    """Publish (or reuse) the feature cache of `target` over both prepared splits."""
    from strategies.feature_cache import write_feature_cache
    from tasks.prepare_data import load_split
    from tasks.target import load_spec_target
    from tasks.train import stage_device

    store = store_for(workdir)
    stage, key = stage_of(spec, target, data, workdir)
    if (hit := store.lookup(stage, key)) is not None:
        return _ref(hit, reused=True)
    with store.lock(stage, key):
        if (hit := store.lookup(stage, key)) is not None:  # a concurrent worker built it while we waited
            return _ref(hit, reused=True)
        model = load_spec_target(spec, target.info["model_path"], stage_device(spec))
        splits = {name: load_split(data.path, name)[0] for name in ("train", "val")}
        layer_ids = layer_ids_for(spec, target)
        info: dict = {
            "target": target.key,
            "target_weights": target.info["weights_digest"],
            "data": data.key,
            "layer_ids": layer_ids,
            "dtype": spec.dflash.cache_dtype,
            "rows": {name: len(ids) for name, ids in splits.items()},
        }
        with store.publish(stage, key, {"upstream": {"target": target.key, "data": data.key}, "info": info}) as tmp:
            index = write_feature_cache(
                model, splits, layer_ids, tmp / "features", dtype=spec.dflash.cache_dtype, progress=True
            )
            info.update(bytes=index["bytes"], build_seconds=index["seconds"])
    ref = _ref(store.lookup(stage, key), reused=False)
    print(
        f"[dllm-flow] cache_target: {sum(info['rows'].values())} rows × layers {layer_ids} ({info['dtype']}) = "
        f"{info['bytes'] / 2**20:.1f} MiB in {info['build_seconds']:.1f}s",
        flush=True,
    )
    return ref


def features_dir(ref: StageRef) -> Path:
    return Path(ref.path) / "features"


def _ref(entry, reused: bool) -> StageRef:
    return StageRef(STAGE, entry.key, str(entry.path), reused=reused, info=entry.manifest["info"])


cache_target_task = prefect_task(cache_target, name="cache_target", stage_of=stage_of)
