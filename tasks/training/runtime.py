"""What every stage that runs a model shares: device and threads, the optimizer and its schedule,
the data order, micro-batches, the model/strategy bundle (`Trainee`) and MLflow run opening."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from strategies import Microbatch
from strategies.head import deferred_logits
from strategies.models import backbone_lm
from tasks.rows import document_ids, open_doc_starts, open_split


def compile_layers(model) -> int:
    """`torch.compile` every decoder layer in place (one compiled graph reused by identical layers; the
    state dict keeps its names). Returns how many layers were compiled."""
    lm = backbone_lm(model)
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if layers is None:  # a DFlash draft: its decoder layers sit on the model itself
        layers = getattr(lm, "layers", None)
    if layers is None:
        raise ValueError("train.compile: this model has no `model.layers` to compile; set train.compile: false")
    for layer in layers:
        layer.compile()
    return len(layers)


# ------------------------------------------------------------------ optimization


@dataclass(frozen=True, kw_only=True)
class OptimSettings:
    """AdamW and its warmup + decay schedule; `train:` and `dflash.pretrain:` both reduce to this."""

    steps: int
    lr: float
    warmup_steps: int
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    @classmethod
    def of(cls, train) -> OptimSettings:
        """From a `TrainConfig`."""
        return cls(
            steps=train.steps,
            lr=train.lr,
            warmup_steps=train.warmup_steps,
            schedule=train.schedule,
            min_lr_ratio=train.min_lr_ratio,
            betas=tuple(train.betas),
            weight_decay=train.weight_decay,
            grad_clip=train.grad_clip,
        )


def lr_lambda(step: int, cfg: OptimSettings) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if cfg.schedule == "cosine" else 1 - frac
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def make_optimizer(model, cfg: OptimSettings):
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: adapters (+ strategy modules) only
    # The fused kernel updates every parameter in one pass (CPU and CUDA): on one CPU thread a 1-layer width-512
    # draft's AdamW step took 13 of its 120 ms with the per-tensor loop, ~2 ms fused (docs/benchmarks.md).
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused or None)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, cfg))


# ------------------------------------------------------------------ data


class DataOrder:
    """Global batch of step s = rows [s·gbs, (s+1)·gbs) of an endless chain of seeded epoch permutations."""

    def __init__(self, n_rows: int, seed: int):
        self.n_rows, self.seed, self._perms = n_rows, seed, {}

    def _perm(self, epoch: int):
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n_rows, generator=gen)}
        return self._perms[epoch]

    def rows(self, step: int, global_batch: int):
        pos = torch.arange(step * global_batch, (step + 1) * global_batch)
        return torch.stack([self._perm(int(p) // self.n_rows)[int(p) % self.n_rows] for p in pos])


@dataclass(frozen=True)
class Split:
    """One prepared split: ids, supervision and padding masks `[N, L]`, and its name."""

    ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    name: str = "train"
    doc_starts: torch.Tensor | None = None  # packed rows: 1 where a document begins (tasks/rows.py)

    @classmethod
    def open(cls, folder, name: str) -> Split:
        """A prepared split, memory-mapped (tasks/rows.py), with its document starts where the rows are packed."""
        return cls(*open_split(folder, name), name, open_doc_starts(folder, name))

    def head(self, n: int) -> Split:
        starts = None if self.doc_starts is None else self.doc_starts[:n]
        return Split(self.ids[:n], self.loss_mask[:n], self.attention_mask[:n], self.name, starts)

    def microbatches(self, rows, micro: int, device: str) -> list[Microbatch]:
        """The rows, `micro` at a time, on `device`; each keeps its row ids (cached per-row features). The split
        may be memory-mapped (int32 ids, uint8 masks, tasks/rows.py): only these rows are read and converted."""
        return [
            Microbatch(
                self.ids[c].long(),
                self.loss_mask[c].float(),
                self.attention_mask[c].long(),
                c,
                self.name,
                None if self.doc_starts is None else document_ids(self.doc_starts[c]),
            ).to(device)
            for c in rows.split(micro)
        ]


# ------------------------------------------------------------------ the trained bundle


@dataclass(kw_only=True)
class Trainee:
    """Everything a run of the loop holds: model, tokenizer, strategy, loss and resolved mask id."""

    model: object
    tokenizer: object
    strategy: object
    loss_fn: object
    mask_token_id: int | None  # None: a strategy that uses no [MASK] token, given none
    precision: str = "fp32"
    fused_head: bool = False  # the model's LM head defers its logits to the loss (docs/strategies.md §5.9)

    @classmethod
    def assembled(cls, model, tokenizer, built, precision: str = "fp32", fused_head: bool = False) -> Trainee:
        """The trainee of a strategy as `strategies.assemble_strategy` (or the DFlash draft's setup) built it:
        its strategy, loss and resolved mask id."""
        return cls(
            model=model,
            tokenizer=tokenizer,
            strategy=built.strategy,
            loss_fn=built.loss_fn,
            mask_token_id=built.mask_token_id,
            precision=precision,
            fused_head=fused_head,
        )

    @contextlib.contextmanager
    def forward_context(self):
        """What every training and validation forward runs under: bf16 autocast (`precision`) and, with
        `fused_head`, logits computed by the loss only where it scores them."""
        with self.autocast(), deferred_logits(self.model, self.fused_head):
            yield

    def autocast(self):
        """bf16 autocast of the forward (weights, grads and optimizer state stay fp32); a no-op for fp32."""
        if self.precision != "bf16":
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device_type=device, dtype=torch.bfloat16)
