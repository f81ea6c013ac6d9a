"""Stage `pretrain_target` / `target`: the frozen causal LM a DFlash draft learns to draft for.

- `dflash.target_model_id` unset (the embedded default): `pretrain_target` trains a small causal LM
  on the prepared data in its own MLflow child run and publishes it to `store/pretrain_target/<key>/model`
  (key: its config, the data key, this module's code).
- set: `target` resolves it — a local dir, `package:NAME`, or a hub id already in the Hugging Face
  cache — and keys it by the sha256 of its weight files. A GGUF file is de-quantized once into
  `store/target/<key>/model`; a plain checkpoint is used where it lies.

Both return a `StageRef` whose info holds `model_path`, `weights_digest` (what `cache_target`
keys on), `num_layers`, `hidden_size` and `vocab_size`. Both run under the store's cross-process
lock, so two workers never train or convert the same target.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from dllm_common.config import PipelineSpec, TrainConfig
from dllm_common.store import sha256_file, stage_key
from tasks.common import StageRef, code_version, prefect_task, store_for

PRETRAIN, EXTERNAL = "pretrain_target", "target"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _local_dir(target_id: str) -> Path:
    from strategies.models import resolve_model_path

    path = Path(resolve_model_path(target_id))
    if path.is_dir():
        return path
    try:  # a hub id: only what the local Hugging Face cache holds unless the user has hub access
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(target_id)))
    except Exception as exc:  # noqa: BLE001 - offline miss, unknown repo, bad id: one message
        raise FileNotFoundError(
            f"dflash.target_model_id {target_id!r} is not a local directory and not in the "
            f"Hugging Face cache ({type(exc).__name__}); give a local path, `package:NAME`, or "
            "download it once with hub access"
        ) from None


def _file_digest(f: Path, memo_dir: Path | None) -> str:
    """sha256 of a weight file, remembered per (path, size, mtime) under the store so a 16 GB target is
    not re-read on every run; any change to the file changes the memo key."""
    if memo_dir is None:
        return sha256_file(f)
    import json

    from dllm_common.store import atomic_write_text

    st = f.stat()
    memo = memo_dir / "weights-digests.json"
    entry = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    known = json.loads(memo.read_text()) if memo.is_file() else {}
    if entry not in known:
        known[entry] = sha256_file(f)
        atomic_write_text(memo, json.dumps(known, indent=1))
    return known[entry]


def weights_digest(path: Path, gguf_file: str | None = None, memo_dir: Path | None = None) -> str:
    """sha256 over the names and digests of a checkpoint's weight files (or of its one GGUF file)."""
    if gguf_file:
        files = [path / gguf_file]
        if not files[0].is_file():
            raise FileNotFoundError(
                f"dflash.target_gguf_file: no file {files[0]}; name a .gguf inside dflash.target_model_id"
            )
    else:
        files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
        if not files:
            raise FileNotFoundError(f"dflash.target_model_id: no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {path}")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(_file_digest(f, memo_dir).encode())
    return h.hexdigest()


def stage_name(spec: PipelineSpec) -> str:
    return PRETRAIN if spec.dflash.target_model_id is None else EXTERNAL


def stage_of(spec: PipelineSpec, data: StageRef, workdir: str, **_) -> tuple[str, str]:
    d = spec.dflash
    if d.target_model_id is None:
        config = {
            "pretrain": d.pretrain.model_dump(mode="json"),
            "hidden_size": spec.model.hidden_size,
            "seq_len": spec.data.seq_len,
            "device": spec.train.device,
        }
        return PRETRAIN, stage_key(PRETRAIN, config, {"data": data.key}, code_version("tasks.target"))
    local = _local_dir(d.target_model_id)
    config = {"id": d.target_model_id, "gguf_file": d.target_gguf_file, "trust_remote_code": d.target_trust_remote_code}
    digest = weights_digest(local, d.target_gguf_file, store_for(workdir).root / EXTERNAL)
    return EXTERNAL, stage_key(EXTERNAL, config, {"weights": digest}, code_version("tasks.target"))


def load_target(model_path: str | Path, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
    """The frozen target (eval mode, no grad): a dllm-flow checkpoint is digest-verified before loading."""
    import torch

    from dllm_common.checkpoint import DIGESTS, load_weights_into
    from strategies.models import model_from_config_dir

    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"DFlash target {path} has no config.json; rerun the target stage "
            "(or set dflash.target_model_id to a causal LM checkpoint)"
        )
    if (path / DIGESTS).is_file():
        model = model_from_config_dir(path)
        load_weights_into(model, path)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code)
    return model.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)


def load_spec_target(spec: PipelineSpec, model_path: str | Path, device: str):
    """`load_target` with the config's `dflash.target_torch_dtype` and `target_trust_remote_code`."""
    d = spec.dflash
    return load_target(model_path, d.target_torch_dtype, device, d.target_trust_remote_code)


# ------------------------------------------------------------------ the stage


def target(spec: PipelineSpec, data: StageRef, workdir: str, parent_run_id: str | None = None) -> StageRef:
    """Train (embedded default) or resolve the DFlash target; reuse it when its key is published."""
    store = store_for(workdir)
    stage, key = stage_of(spec, data, workdir)
    if (hit := store.lookup(stage, key)) is not None:
        return _ref(hit, reused=True)
    with store.lock(stage, key):
        if (hit := store.lookup(stage, key)) is not None:  # another worker finished it while we waited
            return _ref(hit, reused=True)
        if stage == PRETRAIN:
            _pretrain(spec, data, workdir, parent_run_id, key)
        else:
            _external(spec, key, workdir)
    return _ref(store.lookup(stage, key), reused=False)


def _pretrain(spec: PipelineSpec, data: StageRef, workdir: str, parent_run_id: str | None, key: str) -> None:
    import torch
    from tqdm import tqdm

    from dllm_common.checkpoint import write_checkpoint
    from dllm_common.tracking import Tracking
    from strategies.models import build_model, tiny_model_config
    from tasks.prepare_data import load_split, load_tokenizer
    from tasks.train import DataOrder, make_optimizer, stage_device

    p, store = spec.dflash.pretrain, store_for(workdir)
    if spec.model.hidden_size % p.num_heads:
        raise ValueError(
            f"model.hidden_size ({spec.model.hidden_size}) must be divisible by "
            f"dflash.pretrain.num_heads ({p.num_heads})"
        )
    device = stage_device(spec)
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    config = tiny_model_config(
        p.family,
        len(tokenizer),
        spec.data.seq_len,
        spec.model.hidden_size,
        p.num_layers,
        p.num_heads,
        None,
        p.intermediate_size,
        True,
    )
    model = build_model(config, p.seed, dllm_attention="causal").to(device)
    cfg = TrainConfig(
        steps=p.steps,
        global_batch_size=p.batch_size,
        micro_batch_size=p.batch_size,
        lr=p.lr,
        warmup_steps=p.warmup_steps,
        seed=p.seed,
    )
    opt, sched = make_optimizer(model, cfg)
    (ids, lm, attn), val = (
        load_split(data.path, "train"),
        [t[: p.val_rows].to(device) for t in load_split(data.path, "val")],
    )
    order = DataOrder(len(ids), p.seed)
    tracking = Tracking(Path(workdir), spec.tracking.uri, spec.tracking.experiment or spec.pipeline.name)
    tracker = tracking.start_run(
        "pretrain_target",
        {"dllm.stage": PRETRAIN, "dllm.stage_key": key, "strategy": "dflash-target"},
        parent_run_id=parent_run_id,
    )
    tracker.log_params(
        {
            **{f"pretrain.{k}": v for k, v in p.model_dump(mode="json").items()},
            "model.hidden_size": spec.model.hidden_size,
            "data.key": data.key,
            "stage.key": key,
        }
    )
    t0, val_loss = time.perf_counter(), None
    model.train()
    for step in tqdm(range(p.steps), desc="pretrain_target", unit="step", dynamic_ncols=True):
        rows = order.rows(step, p.batch_size)
        loss = causal_loss(model, ids[rows].to(device), lm[rows].to(device), attn[rows].to(device))
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        metrics = {"train/loss": float(loss.detach()), "train/lr": sched.get_last_lr()[0], "train/grad_norm": grad_norm}
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if (step + 1) % p.val_every == 0 or step + 1 == p.steps:
            model.eval()
            with torch.no_grad():
                val_loss = metrics["val/loss"] = float(causal_loss(model, *val))
            model.train()
        if (step + 1) % p.log_every == 0 or "val/loss" in metrics:
            tracker.log_metrics(metrics, step=step)
    model.eval()
    info = {
        "kind": "pretrained_here",
        "final_val_loss": val_loss,
        "train_seconds": round(time.perf_counter() - t0, 2),
        "mlflow_run_id": tracker.run_id,
        "num_layers": p.num_layers,
        "hidden_size": spec.model.hidden_size,
        "vocab_size": len(tokenizer),
        "data_key": data.key,
    }
    with store.publish(
        PRETRAIN, key, {"config": p.model_dump(mode="json"), "upstream": {"data": data.key}, "info": info}
    ) as tmp:
        write_checkpoint(tmp / "model", model, tokenizer, {"strategy": "dflash-target", "stage_key": key, **info})
    entry = store.lookup(PRETRAIN, key)
    if spec.tracking.log_checkpoints:
        tracker.log_artifact(entry.path / "model", "model")
    tracker.close()


def causal_loss(model, ids, loss_mask, attention_mask):
    """Mean next-token NLL over supervised, non-padding positions."""
    from strategies.losses import causal_nll_rows

    logits = model(input_ids=ids, attention_mask=attention_mask).logits
    total, count = causal_nll_rows(logits, ids, loss_mask, attention_mask)
    return total.sum() / count.sum().clamp_min(1)


def _external(spec: PipelineSpec, key: str, workdir: str) -> None:
    """Record a user's target by weights digest; de-quantize a GGUF file once into the entry."""
    from transformers import AutoConfig

    d, store = spec.dflash, store_for(workdir)
    local = _local_dir(d.target_model_id)
    info = {
        "kind": "external",
        "source": d.target_model_id,
        "gguf_file": d.target_gguf_file,
        "weights_digest": weights_digest(local, d.target_gguf_file, store.root / EXTERNAL),
    }
    with store.publish(EXTERNAL, key, {"info": info}) as tmp:
        if d.target_gguf_file:
            from tasks.scoring import load_causal_lm, save_dequantized

            model, tokenizer = load_causal_lm(str(local), d.target_gguf_file, d.target_trust_remote_code)
            save_dequantized(model, tokenizer, tmp / "model")
            model_path = "<entry>/model"
            config = model.config
        else:
            model_path = str(local.resolve())
            config = AutoConfig.from_pretrained(local, trust_remote_code=d.target_trust_remote_code)
        info.update(
            model_path=model_path,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
        )


def _ref(entry, reused: bool) -> StageRef:
    info = dict(entry.manifest["info"])
    if info.get("model_path", "<entry>/model") == "<entry>/model":  # lives inside the (relocatable) entry
        info["model_path"] = str(entry.path / "model")
    if "weights_digest" not in info:
        info["weights_digest"] = entry.manifest["files"]["model/model.safetensors"]["sha256"]
    return StageRef(
        entry.stage, entry.key, str(entry.path), reused=reused, mlflow_run_id=info.get("mlflow_run_id"), info=info
    )


target_task = prefect_task(target, name="target", stage_of=stage_of)
