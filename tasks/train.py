"""Stage `train[strategy]`: one readable training loop over a strategy's hooks.

Resumable: every `train.checkpoint_every` steps the model, optimizer, scheduler, step and MLflow
run id go to `store/train/<key>.work/checkpoint` (atomically). Data order is a pure function of
(seed, step) and corruption noise of (seed, step, sample), so a resumed run continues exactly.
The finished model is published to `store/train/<key>/model`.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dllm_common.config import PipelineSpec, flatten
from dllm_common.store import stage_key
from tasks.common import StageRef, code_version, prefect_task, store_for

STAGE = "train"


DFLASH_EVAL_KEYS = {"eval_prompts", "eval_prompt_len", "eval_max_new_tokens"}


def dflash_options(spec: PipelineSpec) -> dict:
    """The `dflash:` keys that shape training (the evaluation-only ones excluded)."""
    return spec.dflash.model_dump(mode="json", exclude=DFLASH_EVAL_KEYS)


def train_slice(spec: PipelineSpec, strategy: str) -> dict:
    dllm = spec.dllm.for_strategy(strategy)
    out = {
        "strategy": strategy,
        "model": spec.model.model_dump(mode="json"),
        "train": spec.train.model_dump(mode="json"),
        "dllm": dllm.model_dump(mode="json"),
    }
    if strategy == "dflash":
        out["dflash"] = dflash_options(spec)
    return out


def stage_of(
    spec: PipelineSpec, strategy: str, data: StageRef, workdir: str, inputs: dict | None = None, **_
) -> tuple[str, str]:
    """`inputs`: the upstream stages besides the data (dflash: its `target` and, cached, its `features`)."""
    upstream = {"data": data.key, **{name: ref.key for name, ref in sorted((inputs or {}).items())}}
    key = stage_key(
        STAGE,
        train_slice(spec, strategy),
        upstream,
        code_version("strategies", "tasks.train", "dllm_common.checkpoint"),
    )
    return STAGE, key


def check_inputs(strategy: str, spec: PipelineSpec, inputs: dict | None) -> dict:
    """dflash trains against a target stage (and reads a feature cache when cached); others need nothing."""
    inputs = dict(inputs or {})
    if strategy == "dflash":
        if "target" not in inputs:
            raise ValueError(
                "train[dflash] needs its target stage: run it through the pipeline "
                "(pretrain_target / target → cache_target → train[dflash])"
            )
        if spec.dflash.target_features == "cached" and "features" not in inputs:
            raise ValueError("dflash.target_features is 'cached' but no cache_target stage was given")
    return inputs


def check_strategies(names) -> None:
    """Raise the registry's ValueError for any strategy that is not implemented."""
    from strategies import get_dllm_strategy

    for name in names:
        get_dllm_strategy(name)


# ------------------------------------------------------------------ pieces of the loop


class DataOrder:
    """Global batch of step s = rows [s·gbs, (s+1)·gbs) of an endless chain of seeded epoch permutations."""

    def __init__(self, n_rows: int, seed: int):
        self.n_rows, self.seed, self._perms = n_rows, seed, {}

    def _perm(self, epoch: int):
        import torch

        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n_rows, generator=gen)}
        return self._perms[epoch]

    def rows(self, step: int, global_batch: int):
        import torch

        pos = torch.arange(step * global_batch, (step + 1) * global_batch)
        return torch.stack([self._perm(int(p) // self.n_rows)[int(p) % self.n_rows] for p in pos])


def lr_lambda(step: int, cfg) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def stage_device(spec: PipelineSpec) -> str:
    """What every stage that runs a model starts with: `train.threads` applied, `train.device` resolved."""
    import torch

    if spec.train.threads:
        torch.set_num_threads(spec.train.threads)
    return resolve_device(spec.train.device)


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but no CUDA device is visible; use train.device: auto or cpu")
    return name


@dataclass
class Trainee:
    """Everything a run of the loop holds: model, tokenizer, strategy, loss and resolved mask id."""

    model: object
    tokenizer: object
    strategy: object
    loss_fn: object
    mask_token_id: int
    precision: str = "fp32"

    def autocast(self):
        """bf16 autocast of the forward (weights, grads and optimizer state stay fp32); a no-op for fp32."""
        import contextlib

        import torch

        if self.precision != "bf16":
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=torch.bfloat16)


def prepare_strategy(name: str, spec: PipelineSpec, model, tokenizer, mask_token_id: int | None = None):
    """Strategy + loss + resolved mask id for a model/tokenizer pair (training and evaluation alike)."""
    return prepare_strategy_with(name, spec.dllm.for_strategy(name), model, tokenizer, mask_token_id)


def prepare_strategy_with(
    name: str,
    dllm,
    model,
    tokenizer,
    mask_token_id: int | None = None,
    *,
    options: dict | None = None,
    extras: dict | None = None,
):
    """`prepare_strategy` from the strategy's own `DLLMConfig` (what a checkpoint records). `options`
    adds strategy-section keys the loss reads (dflash: the `dflash:` section); `extras` reaches
    `setup_extra` (dflash: the frozen target and the feature source)."""
    from strategies import SetupContext, get_dllm_strategy

    strategy = get_dllm_strategy(name)
    if strategy.normalization_mode not in ("supervised", "noise"):
        raise ValueError(
            f"Invalid normalization_mode {strategy.normalization_mode!r} for strategy {name!r}. "
            "Must be 'supervised' or 'noise'."
        )
    # an unset dllm.vocab_size means "the model's": strategies that need it (scdd) get it resolved here
    dllm = dllm.model_copy(update={"vocab_size": dllm.vocab_size or getattr(model.config, "vocab_size", None)})
    loss_fn = strategy.create_loss_fn({**dllm.model_dump(), **options} if options else dllm)
    if mask_token_id is None:
        mask_token_id = dllm.mask_token_id if dllm.mask_token_id is not None else tokenizer.mask_token_id
    resolved = strategy.setup_extra(
        SetupContext(model=model, tokenizer=tokenizer, mask_token_id=mask_token_id, extras=extras or {})
    )
    mask_token_id = resolved if resolved is not None else mask_token_id
    if mask_token_id is None:
        raise ValueError(
            "dllm.mask_token_id must be set in config, resolved by the tokenizer, or set by strategy.setup_extra()."
        )
    return strategy, loss_fn, int(mask_token_id)


def build_trainee(
    spec: PipelineSpec, strategy_name: str, data: StageRef, device: str, inputs: dict | None = None
) -> Trainee:
    if strategy_name == "dflash":
        return _dflash_trainee(spec, data, device, check_inputs("dflash", spec, inputs))
    from strategies import get_dllm_strategy
    from strategies.models import (
        NATIVE,
        add_lora,
        build_model,
        enable_activation_checkpointing,
        load_pretrained,
        tiny_model_config,
        wrap_for_architecture,
    )
    from tasks.prepare_data import load_tokenizer

    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    m = spec.model
    if m.kind == "tiny":
        config = tiny_model_config(
            m.family,
            len(tokenizer),
            spec.data.seq_len,
            m.hidden_size,
            m.num_layers,
            m.num_heads,
            m.num_kv_heads,
            m.intermediate_size,
            m.tie_embeddings,
            m.attn_implementation,
        )
        model = build_model(config, spec.train.seed)
    else:
        model = load_pretrained(
            m.path,
            dtype=m.dtype,
            trust_remote_code=m.trust_remote_code,
            gguf_file=m.gguf_file,
            attn_implementation=m.attn_implementation,
        )
    if spec.train.peft is not None:  # adapters on the backbone; strategy-owned modules stay trainable
        p = spec.train.peft
        add_lora(model, r=p.r, alpha=p.alpha, dropout=p.dropout, target_modules=p.target_modules)
    if spec.train.activation_checkpointing:
        if strategy_name == "block_diffusion":
            raise ValueError(
                "train.activation_checkpointing is not supported with block_diffusion: its canvas pass "
                "reads every encoder layer's K/V cache, which recomputed layers do not keep; set it to false"
            )
        enable_activation_checkpointing(model)
    architecture = get_dllm_strategy(strategy_name).model_architecture
    if getattr(model.config, "dllm_attention", None) != NATIVE:  # remote-code dLLMs bring their own shape
        model = wrap_for_architecture(model, architecture)
    strategy, loss_fn, mask_id = prepare_strategy(strategy_name, spec, model, tokenizer)
    return Trainee(model.to(device), tokenizer, strategy, loss_fn, int(mask_id), spec.train.precision)


def _dflash_trainee(spec: PipelineSpec, data: StageRef, device: str, inputs: dict) -> Trainee:
    """The trained module is the DFlash draft; the frozen target lends embeddings, head and features."""
    import torch

    from strategies.dflash import DFlashDraftConfig, DFlashDraftModel
    from strategies.dflash_strategy import CachedFeatures
    from strategies.models import resolve_model_path
    from tasks.cache_target import features_dir, layer_ids_for
    from tasks.prepare_data import load_tokenizer
    from tasks.target import load_spec_target

    d, m = spec.dflash, spec.model
    if d.attention_backend == "flex_attention" and not str(device).startswith("cuda"):
        raise ValueError(
            "dflash.attention_backend 'flex_attention' trains on CUDA only (flex attention has no CPU "
            "backward in torch 2.13); use 'sdpa' here"
        )
    if spec.train.peft is not None or spec.train.activation_checkpointing:
        raise ValueError("train.peft and train.activation_checkpointing do not apply to a DFlash draft; unset them")
    tokenizer = load_tokenizer(str(Path(data.path) / "tokenizer"))
    target_ref = inputs["target"]
    target = load_spec_target(spec, target_ref.info["model_path"], device)
    hidden = target.config.hidden_size
    mask_id = spec.dllm.mask_token_id if spec.dllm.mask_token_id is not None else tokenizer.mask_token_id
    if mask_id is None or mask_id >= target.get_input_embeddings().num_embeddings:
        raise ValueError(
            f"the DFlash mask token id {mask_id} is not a row of the target's embedding "
            f"({target.get_input_embeddings().num_embeddings}); set dllm.mask_token_id to an unused "
            "token the target knows"
        )
    if m.kind == "pretrained":
        draft = DFlashDraftModel.load(resolve_model_path(m.path))
    else:
        if m.hidden_size != hidden:
            raise ValueError(
                f"model.hidden_size ({m.hidden_size}) must equal the target's hidden size ({hidden}): "
                "the DFlash draft reads the target's embeddings and writes through its LM head"
            )
        if d.block_size < 2:
            raise ValueError("Cannot infer block_size from draft config. Set dflash.block_size in the YAML.")
        layer_ids = layer_ids_for(spec, target_ref)
        cfg = DFlashDraftConfig(
            hidden_size=hidden,
            num_layers=m.num_layers,
            num_heads=m.num_heads,
            num_target_features=len(layer_ids),
            target_hidden_size=hidden,
            block_size=d.block_size,
            target_layer_ids=layer_ids,
            mask_token_id=int(mask_id),
            intermediate_size=m.intermediate_size,
            rope_theta=float(getattr(target.config, "rope_theta", None) or 10000.0),
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.train.seed)
            draft = DFlashDraftModel(cfg)
    features = CachedFeatures(features_dir(inputs["features"])) if d.target_features == "cached" else None
    strategy, loss_fn, mask_id = prepare_strategy_with(
        "dflash",
        spec.dllm.for_strategy("dflash"),
        draft,
        tokenizer,
        int(mask_id),
        options=dflash_options(spec),
        extras={"target": target, "features": features},
    )
    return Trainee(draft.to(device), tokenizer, strategy, loss_fn, int(mask_id), spec.train.precision)


def step_context(trainee: Trainee, spec: PipelineSpec, step: int, base_seed: int, grad_acc: int, model=None, dist=None):
    """The step's context; under data parallelism `model` is the DDP wrapper and backward is scaled by N."""
    from strategies import StepContext

    d = spec.dllm.for_strategy(trainee.strategy.name)
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    return StepContext(
        model=model if model is not None else trainee.model,
        loss_fn=trainee.loss_fn,
        mask_token_id=trainee.mask_token_id,
        step=step,
        base_seed=base_seed,
        eps=d.eps,
        block_size=d.block_size,
        half_life_ratio=d.half_life_ratio,
        dp_rank=rank,
        dp_size=world,
        grad_acc_steps=grad_acc,
        loss_scale=float(world),
    )


def microbatches(ids, loss, attn, rows, micro: int, device: str, split: str = "train"):
    from strategies import Microbatch

    return [Microbatch(ids[c], loss[c], attn[c], c, split).to(device) for c in rows.split(micro)]


def run_step(trainee: Trainee, ctx, mbs, is_train: bool) -> tuple[float, int, dict]:
    """pre_step over all micro-batches, then forward/backward each with step-level *global* counts.

    Returns the step's loss summed over micro-batches and data-parallel ranks (= the global token
    mean, since every term is local sum ÷ global count), the global supervised count, and the DFlash
    draft accuracies when the loss reports per-offset counts (spec §7.3: `draft_acc`, `draft_acc_k{k}`)."""
    from strategies.base import global_sum

    corrupted, n_noise, n_sup = trainee.strategy.pre_step(ctx, mbs)
    n_noise, n_sup = global_sum(n_noise), global_sum(n_sup)
    n_diff, n_ar = trainee.strategy.loss_denominators(corrupted, n_noise, n_sup)
    total, correct, count = 0.0, None, None
    for batch in corrupted:
        with trainee.autocast():
            out = trainee.strategy.forward_backward(
                ctx, batch, num_diffusion_tokens=n_diff, num_ar_tokens=n_ar, is_train=is_train
            )
        total += float(out.total_loss.detach())
        if out.draft_correct_per_pos is not None:
            c, n = out.draft_correct_per_pos.detach().cpu(), out.draft_count_per_pos.detach().cpu()
            correct, count = (c, n) if correct is None else (correct + c, count + n)
    return global_sum(total), n_sup, _draft_accuracy(correct, count)


def _draft_accuracy(correct, count) -> dict:
    """Per-offset sums all-reduced over ranks → `draft_acc` = Σcorrect/Σcount and `draft_acc_k{k}`."""
    from strategies.base import global_sum

    if correct is None:
        return {}
    c = [global_sum(float(x)) for x in correct.tolist()]
    n = [global_sum(float(x)) for x in count.tolist()]
    out = {"draft_acc": sum(c) / sum(n) if sum(n) else float("nan")}
    out.update({f"draft_acc_k{k}": ck / max(nk, 1.0) for k, (ck, nk) in enumerate(zip(c, n), start=1)})
    return out


def validation_loss(trainee: Trainee, spec: PipelineSpec, val, device: str, dist=None) -> float:
    """Training loss on fixed validation rows with fixed noise (same realization at every evaluation).
    Under data parallelism each rank scores its strided share; the seeds match the one-process run."""
    import torch

    ids, loss, attn = (t[: spec.train.val_rows] for t in val)
    rows = torch.arange(len(ids))
    if dist is not None and dist.world > 1:
        rows = rows[dist.rank :: dist.world]
    ctx = step_context(trainee, spec, step=0, base_seed=spec.train.seed + 1_000_000_007, grad_acc=1, dist=dist)
    trainee.model.eval()
    with torch.no_grad():
        value, _, _ = run_step(
            trainee, ctx, microbatches(ids, loss, attn, rows, spec.train.micro_batch_size, device, "val"), False
        )
    trainee.model.train()
    return value


def train_step(trainee: Trainee, ctx, mbs, opt, sched, grad_clip: float) -> dict:
    """One optimizer step: corrupt + forward/backward every micro-batch, clip, step, schedule."""
    import torch

    loss, n_sup, draft = run_step(trainee, ctx, mbs, True)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(trainee.model.parameters(), grad_clip))  # grads all-reduced by DDP
    lr = sched.get_last_lr()[0]
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return {
        "train/loss": loss,
        "train/lr": lr,
        "train/grad_norm": grad_norm,
        "train/supervised_tokens": n_sup,
        **{f"train/{k}": v for k, v in draft.items()},
    }


def make_optimizer(model, cfg):
    import torch

    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: adapters (+ strategy modules) only
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, cfg))


# ------------------------------------------------------------------ the stage


def train(
    spec: PipelineSpec,
    strategy: str,
    data: StageRef,
    workdir: str,
    parent_run_id: str | None = None,
    inputs: dict | None = None,
) -> StageRef:
    """Train `strategy` on the prepared data (or reuse/resume it); publish the final checkpoint.

    With `train.nproc_per_node > 1` this launches torchrun and every rank runs `_train_loop`."""
    from tasks import distributed

    inputs = check_inputs(strategy, spec, inputs)
    store = store_for(workdir)
    stage, key = stage_of(spec, strategy, data, workdir, inputs)
    if (hit := store.lookup(stage, key)) is not None:
        return _ref(hit, strategy, reused=True)
    if spec.train.nproc_per_node > 1 and not distributed.under_torchrun():
        distributed.launch(spec, strategy, data, workdir, parent_run_id, store.work_dir(stage, key), inputs)
        if (entry := store.lookup(stage, key)) is None:
            raise RuntimeError(f"torchrun finished but train[{strategy}] published nothing under {store.root}")
        shutil.rmtree(store.work_dir(stage, key), ignore_errors=True)
        return _ref(entry, strategy, reused=False)
    info = distributed.init_distributed(resolve_device(spec.train.device))
    try:
        return _train_loop(spec, strategy, data, workdir, parent_run_id, key, info, inputs)
    finally:
        if info.world > 1:
            distributed.shutdown()


def _train_loop(
    spec: PipelineSpec,
    strategy: str,
    data: StageRef,
    workdir: str,
    parent_run_id: str | None,
    key: str,
    dist,
    inputs: dict | None = None,
) -> StageRef | None:
    from tqdm import tqdm

    from dllm_common.checkpoint import load_trainer_state, load_weights_into, read_meta, write_checkpoint
    from tasks.distributed import barrier, rank_device
    from tasks.prepare_data import load_split

    store = store_for(workdir)
    cfg = spec.train
    device = rank_device(stage_device(spec), dist)
    train_t, val_t = load_split(data.path, "train"), load_split(data.path, "val")
    trainee = build_trainee(spec, strategy, data, device, inputs)
    trainee.strategy.validate_data(train_t[1], train_t[2])
    model = trainee.model
    work = store.work_dir(STAGE, key)
    ckpt_dir = work / "checkpoint"
    resuming = ckpt_dir.exists()
    if resuming:  # resume a stage that died mid-way (every rank loads the same checkpoint, before sharding)
        load_weights_into(model, ckpt_dir)
    sharded = dist.world > 1 and cfg.parallel == "fsdp2"
    shadow = None  # FSDP2: rank 0 keeps an unsharded CPU copy to write full checkpoints from
    stepper = model
    if sharded:
        import copy

        from tasks.distributed import shard_fsdp2

        shadow = copy.deepcopy(model).cpu() if dist.is_main else None
        shard_fsdp2(model)
    elif dist.world > 1:
        from torch.nn.parallel import DistributedDataParallel

        stepper = DistributedDataParallel(model, device_ids=[dist.local_rank] if device.startswith("cuda") else None)
    opt, sched = make_optimizer(model, cfg)
    start, run_id = 0, None
    if resuming:
        state = load_trainer_state(ckpt_dir)
        if sharded:
            from tasks.distributed import load_full_optimizer_state

            load_full_optimizer_state(model, opt, state["optimizer_full"])
        else:
            opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        meta = read_meta(ckpt_dir)
        start, run_id = meta["step"], meta.get("mlflow_run_id")
        if dist.is_main:
            print(f"[dllm-flow] train[{strategy}]: resuming from the step-{start} checkpoint in {ckpt_dir}", flush=True)
    tracker = _open_tracker(spec, workdir, strategy, parent_run_id, run_id, key) if dist.is_main else None
    if tracker is not None:
        tracker.log_params(
            {
                **flatten(train_slice(spec, strategy)),
                "data.key": data.key,
                "stage.key": key,
                **{f"{name}.key": ref.key for name, ref in (inputs or {}).items()},
            }
        )
    order = DataOrder(len(train_t[0]), cfg.seed)
    local_batch = cfg.global_batch_size // dist.world
    grad_acc = local_batch // cfg.micro_batch_size
    tokens_per_step = cfg.global_batch_size * train_t[0].shape[1]
    buffer: list[tuple[int, dict]] = []
    logged_upto = tracker.last_step("train/loss") if (start and tracker) else -1  # steps a crashed attempt logged
    meta_base = {
        "strategy": strategy,
        "mask_token_id": trainee.mask_token_id,
        "stage_key": key,
        "seq_len": spec.data.seq_len,
        "mlflow_run_id": tracker.run_id if tracker else None,
        "dllm": spec.dllm.for_strategy(strategy).model_dump(mode="json"),  # rebuilds the strategy
        "chat": spec.data.shape == "dialogue",
    }
    if strategy == "dflash":  # what evaluation and `dllm-flow generate` need to find the frozen target
        meta_base["dflash"] = dflash_options(spec)
        meta_base["target"] = {
            "path": inputs["target"].info["model_path"],
            "stage": inputs["target"].stage,
            "key": inputs["target"].key,
            "weights_digest": inputs["target"].info["weights_digest"],
        }

    def flush():
        for s, metrics in buffer:
            if tracker is not None and s > logged_upto:
                tracker.log_metrics(metrics, step=s)
        buffer.clear()

    def save(step: int):
        flush()
        if sharded:  # gather full weights and optimizer state (collective), rank 0 writes them
            from tasks.distributed import gather_full_state

            weights, optim = gather_full_state(model, opt)
            if dist.is_main:
                shadow.load_state_dict(weights)
                write_checkpoint(
                    ckpt_dir,
                    shadow,
                    trainee.tokenizer,
                    {**meta_base, "step": step},
                    {"optimizer_full": optim, "scheduler": sched.state_dict()},
                )
        elif dist.is_main:
            write_checkpoint(
                ckpt_dir,
                model,
                trainee.tokenizer,
                {**meta_base, "step": step},
                {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
            )
        barrier()

    model.train()
    bar = tqdm(
        range(start, cfg.steps),
        initial=start,
        total=cfg.steps,
        desc=f"train[{strategy}]",
        unit="step",
        dynamic_ncols=True,
        disable=not dist.is_main,
    )
    val_loss = None
    for step in bar:
        t0 = time.perf_counter()
        ctx = step_context(trainee, spec, step, cfg.seed, grad_acc, model=stepper, dist=dist)
        rows = order.rows(step, cfg.global_batch_size)[dist.rank :: dist.world]
        metrics = train_step(
            trainee, ctx, microbatches(*train_t, rows, cfg.micro_batch_size, device), opt, sched, cfg.grad_clip
        )
        metrics["train/tokens_per_s"] = tps = tokens_per_step / (time.perf_counter() - t0)
        if (step + 1) % cfg.val_every == 0 or step + 1 == cfg.steps:
            val_loss = validation_loss(trainee, spec, val_t, device, dist)
            metrics["val/loss"] = val_loss
        buffer.append((step, metrics))
        bar.set_postfix(
            loss=f"{metrics['train/loss']:.3f}",
            val=f"{val_loss:.3f}" if val_loss is not None else "-",
            tok_s=f"{tps:,.0f}",
        )
        if (step + 1) % cfg.log_every == 0:
            flush()
        if (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
            save(step + 1)
    bar.close()
    flush()
    if sharded:
        from tasks.distributed import gather_full_state

        weights, _ = gather_full_state(model, None)
        if dist.is_main:
            shadow.load_state_dict(weights)
            trainee.model = shadow
    if not dist.is_main:
        barrier()
        return None
    ref = _publish(spec, strategy, data, workdir, trainee, tracker, key, meta_base, val_loss, work)
    barrier()
    return ref


def _open_tracker(spec: PipelineSpec, workdir: str, strategy: str, parent_run_id, resume_run_id, key):
    from dllm_common.tracking import Tracking

    tracking = Tracking(Path(workdir), spec.tracking.uri, spec.tracking.experiment or spec.pipeline.name)
    if tracking.run_exists(resume_run_id):
        return tracking.reopen(resume_run_id)
    tags = {"strategy": strategy, "dllm.stage": "train", "dllm.stage_key": key}
    return tracking.start_run(f"{strategy}", tags, parent_run_id=parent_run_id)


def _publish(spec, strategy, data, workdir, trainee, tracker, key, meta_base, val_loss, work: Path) -> StageRef:
    from dllm_common.checkpoint import write_checkpoint

    store = store_for(workdir)
    final_meta = {**meta_base, "step": spec.train.steps, "final_val_loss": val_loss, "data_key": data.key}
    peft = spec.train.peft
    if peft is not None:
        final_meta["peft"] = {**peft.model_dump(mode="json"), "merged": peft.merge}
    with store.publish(
        STAGE,
        key,
        {
            "strategy": strategy,
            "config": train_slice(spec, strategy),
            "upstream": {"data": data.key},
            "info": final_meta,
        },
    ) as tmp:
        if peft is not None:
            _write_adapter(tmp / "adapter", trainee.model, peft)
            if peft.merge:
                from strategies.models import merge_lora

                merge_lora(trainee.model)
        write_checkpoint(tmp / "model", trainee.model, trainee.tokenizer, final_meta)
    entry = store.lookup(STAGE, key)
    tracker.log_dataset(Path(data.path), name=f"{spec.pipeline.name}-{data.key[:8]}", digest=data.info["digest"])
    if spec.tracking.log_checkpoints:
        tracker.log_artifact(entry.path / "model", "model")
        if (entry.path / "adapter").is_dir():
            tracker.log_artifact(entry.path / "adapter", "adapter")
        if spec.tracking.register_model:
            name = f"{spec.pipeline.name}-{strategy}"
            version = tracker.register_model(name, "model")
            tracker.set_tags({"dllm.registered_model": f"{name}/{version}"})
    tracker.close()
    shutil.rmtree(work, ignore_errors=True)
    return _ref(entry, strategy, reused=False)


def _write_adapter(dest: Path, model, peft) -> None:
    """The LoRA adapter alone (safetensors + its config): small enough to ship without the base weights."""
    import json as _json

    from safetensors.torch import save_file

    from strategies.models import lora_state_dict

    dest.mkdir(parents=True)
    save_file(lora_state_dict(model), str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(
        _json.dumps({**peft.model_dump(mode="json"), "peft_type": "LORA"}, indent=2)
    )


def _ref(entry, strategy: str, reused: bool) -> StageRef:
    info = entry.manifest["info"]
    return StageRef(
        f"train[{strategy}]",
        entry.key,
        str(entry.path),
        reused=reused,
        mlflow_run_id=info.get("mlflow_run_id"),
        info=info,
    )


def model_dir(ref: StageRef) -> Path:
    return Path(ref.path) / "model"


def train_on_deployment(
    spec: PipelineSpec,
    strategy: str,
    data: StageRef,
    workdir: str,
    parent_run_id: str | None = None,
    inputs: dict | None = None,
) -> StageRef:
    """Submit the train stage to `pipeline.train_deployment` (a GPU work pool) and wait for it.

    Only small descriptors cross: the resolved config, the data stage's descriptor and paths. The
    worker runs `train` (same function, same store, same key), so results are those of a local run."""
    from dataclasses import asdict

    from prefect.deployments import run_deployment

    inputs = check_inputs(strategy, spec, inputs)
    store = store_for(workdir)
    stage, key = stage_of(spec, strategy, data, workdir, inputs)
    if (hit := store.lookup(stage, key)) is not None:
        return _ref(hit, strategy, reused=True)
    run = run_deployment(
        spec.pipeline.train_deployment,
        timeout=None,
        parameters={
            "spec": spec.model_dump(mode="json"),
            "strategy": strategy,
            "data": asdict(data),
            "workdir": str(Path(workdir).resolve()),
            "parent_run_id": parent_run_id,
            "inputs": {name: asdict(ref) for name, ref in inputs.items()},
        },
    )
    if not run.state or not run.state.is_completed():
        raise RuntimeError(
            f"train[{strategy}] on deployment {spec.pipeline.train_deployment!r} ended "
            f"{run.state.name if run.state else 'without a state'} (flow run {run.id}); "
            "`prefect flow-run logs` shows why, `prefect flow-run retry` reruns it"
        )
    if (entry := store.lookup(stage, key)) is None:
        raise RuntimeError(
            f"deployment run {run.id} completed but published nothing under {store.root}; "
            "is the workdir on storage the worker can see?"
        )
    return _ref(entry, strategy, reused=False)


train_task = prefect_task(train, name="train", stage_of=stage_of)
train_remote_task = prefect_task(train_on_deployment, name="train", stage_of=stage_of)
