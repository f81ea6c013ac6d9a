"""Stage `pretrain_target` / `target`: the frozen causal LM a DFlash draft learns to draft for.

- `dflash.target_model_id` unset (the embedded default): `pretrain_target` trains a small causal LM
  on the prepared data in its own MLflow child run and publishes it to `store/pretrain_target/<key>/model`
  (key: its config, the data key, this module's code).
- set: `target` resolves it — a local dir, `package:NAME`, or a hub id already in the Hugging Face
  cache — and keys it by the sha256 of its weight files. A GGUF file is de-quantized once into
  `store/target/<key>/model`; a plain checkpoint is used where it lies.

Both return a `StageRef` whose info holds `model_path`, `weights_digest` (what `cache_target`
keys on), `num_layers`, `hidden_size` and `vocab_size`. Both go through the store's one protocol
(`Store.reuse_or_build`), so two workers never train or convert the same target.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from huggingface_hub import snapshot_download
from transformers import AutoConfig

from dllm_common.checkpoint import checkpoint_digest, write_checkpoint
from dllm_common.config import PipelineSpec
from dllm_common.store import atomic_write_text, sha256_file, stage_key
from strategies.causal import CausalLMObjective
from strategies.model_files import resolve_model_path
from strategies.models import build_model, set_token_ids, tiny_model_config
from tasks.common import StageRef, prefect_task, stage_code_version, store_for, tracking_for
from tasks.data.tokenizer import load_tokenizer
from tasks.devices import stage_device
from tasks.evaluation.scoring import load_causal_lm, save_dequantized
from tasks.stages import Stage
from tasks.training.loop import LoopRun, LoopSettings, train_loop
from tasks.training.runtime import OptimSettings, Split, Trainee, make_optimizer

PRETRAIN, EXTERNAL = "pretrain_target", "target"
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _local_dir(target_id: str) -> Path:
    path = Path(resolve_model_path(target_id))
    if path.is_dir():
        return path
    try:  # a hub id: only what the local Hugging Face cache holds unless the user has hub access
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
        return PRETRAIN, stage_key(PRETRAIN, config, {"data": data.key}, stage_code_version(__name__))
    local = _local_dir(d.target_model_id)
    config = {"id": d.target_model_id, "gguf_file": d.target_gguf_file, "trust_remote_code": d.target_trust_remote_code}
    digest = weights_digest(local, d.target_gguf_file, store_for(workdir).root / EXTERNAL)
    return EXTERNAL, stage_key(EXTERNAL, config, {"weights": digest}, stage_code_version(__name__))


# ------------------------------------------------------------------ the stage


def target(spec: PipelineSpec, data: StageRef, workdir: str, parent_run_id: str | None = None) -> StageRef:
    """Train (embedded default) or resolve the DFlash target; reuse it when its key is published."""
    stage, key = stage_of(spec, data, workdir)
    if stage == PRETRAIN:
        build = lambda out: _pretrain(spec, data, workdir, parent_run_id, key, out)  # noqa: E731
    else:
        build = lambda out: _external(spec, workdir, out)  # noqa: E731
    entry, reused = store_for(workdir).reuse_or_build(stage, key, build)
    return _ref(entry, reused)


def _pretrain_settings(spec: PipelineSpec) -> tuple[LoopSettings, OptimSettings]:
    """`dflash.pretrain:` as the training loop's settings (no checkpoints) and its optimizer's."""
    p = spec.dflash.pretrain
    loop = LoopSettings(
        steps=p.steps,
        global_batch_size=p.batch_size,
        micro_batch_size=p.batch_size,
        seed=p.seed,
        grad_clip=1.0,
        log_every=p.log_every,
        val_every=p.val_every,
        val_rows=p.val_rows,
        checkpoint_every=None,
        name="pretrain_target",
    )
    return loop, OptimSettings(steps=p.steps, lr=p.lr, warmup_steps=p.warmup_steps)


def new_target(spec: PipelineSpec, vocab_size: int):
    """The causal LM `dflash.pretrain:` describes, at the draft's width (`model.hidden_size`)."""
    p = spec.dflash.pretrain
    config = tiny_model_config(
        p.family,
        vocab_size,
        spec.data.seq_len,
        spec.model.hidden_size,
        p.num_layers,
        p.num_heads,
        None,
        p.intermediate_size,
        True,
    )
    return build_model(config, p.seed, dllm_attention="causal")


def _pretrain_tracker(spec: PipelineSpec, workdir: str, data: StageRef, parent_run_id: str | None, key: str):
    """The target's own MLflow child run, with its config as params."""
    tags = {"dllm.stage": PRETRAIN, "dllm.stage_key": key, "strategy": "dflash-target"}
    tracker = tracking_for(spec, workdir).start_run("pretrain_target", tags, parent_run_id=parent_run_id)
    params = {f"pretrain.{k}": v for k, v in spec.dflash.pretrain.model_dump(mode="json").items()}
    tracker.log_params({**params, "model.hidden_size": spec.model.hidden_size, "data.key": data.key, "stage.key": key})
    return tracker


def _pretrain(spec: PipelineSpec, data: StageRef, workdir: str, parent_run_id: str | None, key: str, out: Path) -> dict:
    """A small causal LM trained by the one training loop with a next-token objective."""
    p = spec.dflash.pretrain
    if spec.model.hidden_size % p.num_heads:
        raise ValueError(
            f"model.hidden_size ({spec.model.hidden_size}) must be divisible by "
            f"dflash.pretrain.num_heads ({p.num_heads})"
        )
    device = stage_device(spec)
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    model = new_target(spec, len(tokenizer)).to(device)
    set_token_ids(model.config, tokenizer)  # the draft's config takes its BOS/EOS from here (`target_facts`)
    settings, optim = _pretrain_settings(spec)
    opt, sched = make_optimizer(model, optim)
    tracker = _pretrain_tracker(spec, workdir, data, parent_run_id, key)
    objective = CausalLMObjective()
    trainee = Trainee(
        model=model, tokenizer=tokenizer, strategy=objective, loss_fn=objective.create_loss_fn(), mask_token_id=0
    )
    run = LoopRun(
        trainee=trainee,
        stepper=model,
        opt=opt,
        sched=sched,
        train=Split.open(data.path, "train"),
        val=Split.open(data.path, "val"),
        device=device,
        tracker=tracker,
    )
    t0 = time.perf_counter()
    val_loss = train_loop(run, settings)
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
    write_checkpoint(out / "model", model, tokenizer, {"strategy": "dflash-target", "stage_key": key, **info})
    if spec.tracking.log_checkpoints:
        tracker.log_artifact(out / "model", "model")
    tracker.close()
    return {"config": p.model_dump(mode="json"), "upstream": {"data": data.key}, "info": info}


def _external(spec: PipelineSpec, workdir: str, out: Path) -> dict:
    """Record a user's target by weights digest; de-quantize a GGUF file once into the entry."""
    d, store = spec.dflash, store_for(workdir)
    local = _local_dir(d.target_model_id)
    info = {
        "kind": "external",
        "source": d.target_model_id,
        "gguf_file": d.target_gguf_file,
        "weights_digest": weights_digest(local, d.target_gguf_file, store.root / EXTERNAL),
    }
    if d.target_gguf_file:
        model, tokenizer = load_causal_lm(str(local), d.target_gguf_file, d.target_trust_remote_code)
        save_dequantized(model, tokenizer, out / "model")
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
    return {"info": info}


def _ref(entry, reused: bool) -> StageRef:
    info = dict(entry.manifest["info"])
    if info.get("model_path", "<entry>/model") == "<entry>/model":  # lives inside the (relocatable) entry
        info["model_path"] = str(entry.path / "model")
    if "weights_digest" not in info:
        single = entry.manifest["files"].get("model/model.safetensors")  # else shards: the digest table's hash
        info["weights_digest"] = single["sha256"] if single else checkpoint_digest(entry.path / "model")
    return StageRef(
        entry.stage, entry.key, str(entry.path), reused=reused, mlflow_run_id=info.get("mlflow_run_id"), info=info
    )


target_task = prefect_task(target, name="target", stage_of=stage_of)
# run when a stage reads the target (a strategy's `upstream_stages`, the regenerated data); named by what it does
DECLARATION = Stage(
    name="target", task=target_task, produces="target", consumes={"data": "data"}, on_demand=True, title=stage_name
)
