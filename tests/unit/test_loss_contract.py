"""The loss call contract (`strategies.base.DiffusionLoss`): what `forward_backward` passes to a strategy's loss
module (the logits, a `CorruptedBatch`, the `TokenCounts`, the causal logits where there are some), written down in
one place, held to every registered strategy and to docs/architecture.md ("How a strategy plugs in"), so neither the
code nor the doc can drift from it."""

import dataclasses
import inspect
import re
import typing

import pytest
import torch
from conftest import ROOT
from torch import nn

from strategies import Microbatch, StepContext, assemble_strategy, strategy_class
from strategies.base import (
    LOSS_ARGUMENTS,
    LOSS_BATCH_FIELDS,
    LOSS_KEYWORDS,
    CorruptedBatch,
    DiffusionLoss,
    TokenCounts,
)
from strategies.models import build_model, tiny_model_config, wrap_for_architecture
from strategies.registry import REGISTRY

V, L, MASK = 64, 16, 63


class Recording(nn.Module):
    """A loss module that records how it is called (its `forward`, or another `forward…` method such as DFlash's
    fused one: the name, the positional count, the keyword names), then runs the real loss."""

    def __init__(self, loss: nn.Module):
        super().__init__()
        self.loss = loss
        self.calls: list[tuple[str, tuple, dict]] = []

    def forward(self, *args, **kwargs):
        self.calls.append(("forward", args, kwargs))
        return self.loss(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            attr = getattr(self._modules["loss"], name)
        if not (name.startswith("forward") and callable(attr)):
            return attr

        def recorded(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return attr(*args, **kwargs)

        return recorded


def _rows(vocab: int = V) -> Microbatch:
    ids = torch.randint(0, vocab - 4, (2, L), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones(2, L)
    loss_mask[:, :4] = 0  # a prompt, then one supervised run (block diffusion trains single-turn rows)
    return Microbatch(ids, loss_mask, torch.ones(2, L), torch.arange(2))


def _denoiser_step(name: str):
    """A registered strategy assembled for a tiny Llama in its model shape, with its loss recorded."""
    cls = strategy_class(name)
    values = {"vocab_size": V, "block_size": 4, "architecture": "stack"}
    options = cls.coerce_options({k: v for k, v in values.items() if k in cls.Options.model_fields})
    shape = getattr(cls, "model_architecture_for", lambda _: cls.model_architecture)(options)
    lm = build_model(tiny_model_config("llama", V, 2 * L, 32, 2, 4, None, None, False), seed=0)
    model = wrap_for_architecture(lm, shape, MASK)
    built = assemble_strategy(name, options, model, None, mask_token_id=MASK if cls.uses_mask_token else None)
    return built, model, _rows()


def _draft_step(name: str):
    """DFlash: a tiny draft against a tiny frozen target, online features, plain (unfused) and fused losses."""
    from strategies.dflash.blocks import build_target_layer_ids
    from strategies.dflash.draft import DFlashDraftConfig, DFlashDraftModel
    from strategies.dflash.features import OnlineFeatures

    target = build_model(tiny_model_config("llama", V, 4 * L, 32, 3, 4, None, None, False), seed=0).eval()
    target.requires_grad_(False)
    config = DFlashDraftConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        block_size=4,
        target_layer_ids=build_target_layer_ids(3, 1),
        mask_token_id=MASK,
        num_target_layers=3,
        vocab_size=V,
    )
    draft = DFlashDraftModel(config)
    features = OnlineFeatures(target, list(config.target_layer_ids))
    built = assemble_strategy(
        name,
        {"block_size": 4, "num_blocks_per_sample": 2},
        draft,
        None,
        mask_token_id=MASK,
        resources={"target": target, "features": features},
    )
    return built, draft, _rows()


def _recorded_step(name: str):
    """One training step of strategy `name` through its own `pre_step` and `forward_backward`, the loss recorded."""
    cls = strategy_class(name)
    built, model, mb = (_draft_step if cls.trains == "draft" else _denoiser_step)(name)
    loss = Recording(built.loss_fn)
    s = built.strategy
    ctx = StepContext(model, loss, built.mask_token_id, step=0, base_seed=0, **s.corruption_values())
    corrupted, n_noise, n_sup = s.pre_step(ctx, [mb])
    n_diff, n_ar = s.loss_denominators(corrupted, n_noise, n_sup)
    out = s.forward_backward(ctx, corrupted[0], num_diffusion_tokens=n_diff, num_ar_tokens=n_ar, is_train=True)
    assert torch.isfinite(out.total_loss)
    return built.loss_fn, loss.calls


OWN_CALL = {"idlm", "dflash"}  # two-half and block losses: their own documented call (docs/strategies.md §5.6, §5.7)


def _follows_the_contract(args: tuple, kwargs: dict) -> bool:
    """The call `DiffusionLoss` writes: the logits, a `CorruptedBatch`, a `TokenCounts`, documented keywords only."""
    return (
        len(args) == len(LOSS_ARGUMENTS)
        and isinstance(args[1], CorruptedBatch)
        and isinstance(args[2], TokenCounts)
        and set(kwargs) <= set(LOSS_KEYWORDS)
    )


def _parameters(fn) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter but `self`."""
    return [(n, p.kind, p.default) for n, p in inspect.signature(fn).parameters.items() if n != "self"]


def test_the_contract_is_the_protocols_signature():
    params = inspect.signature(DiffusionLoss.__call__).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD and n != "self"]
    keywords = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    assert tuple(positional) == LOSS_ARGUMENTS and tuple(keywords) == LOSS_KEYWORDS
    assert all(params[k].default is None for k in keywords)  # every keyword is optional
    hints = typing.get_type_hints(DiffusionLoss.__call__)
    assert hints["batch"] is CorruptedBatch and hints["counts"] is TokenCounts
    # the batch fields a loss reads are the batch's, and the counts are the two denominators, each optional
    assert set(LOSS_BATCH_FIELDS) <= {f.name for f in dataclasses.fields(CorruptedBatch)}
    assert [(f.name, f.default) for f in dataclasses.fields(TokenCounts)] == [("diffusion", None), ("ar", None)]
    doc = inspect.getdoc(DiffusionLoss)
    assert all(f"`{name}`" in doc for name in (*LOSS_ARGUMENTS, *LOSS_KEYWORDS, *LOSS_BATCH_FIELDS))
    assert all(f"`{name}`" in inspect.getdoc(TokenCounts) for name in ("diffusion", "ar"))


def _contract_losses() -> list[nn.Module]:
    """Every loss module a contract strategy can build (each option that picks another class)."""
    from strategies.block_diffusion.loss import OwnTokenCanvasLoss
    from strategies.hybrid.loss import HybridDiffusionLLMLoss
    from strategies.losses import FlatCrossEntropyLoss
    from strategies.mdlm.loss import MDLMCrossEntropyLoss
    from strategies.scdd.loss import SCDDLoss

    return [
        MDLMCrossEntropyLoss(),
        HybridDiffusionLLMLoss(),
        FlatCrossEntropyLoss(),
        OwnTokenCanvasLoss(),
        SCDDLoss(MASK),
    ]


@pytest.mark.parametrize("loss", _contract_losses(), ids=lambda loss: type(loss).__name__)
def test_every_contract_loss_declares_the_protocols_signature_and_nothing_else(loss):
    """The signature is written once: a loss's `forward` has exactly the Protocol's parameters (no tensor list)."""
    assert _parameters(loss.forward) == _parameters(DiffusionLoss.__call__)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registered_strategys_loss_accepts_what_its_forward_backward_passes(name):
    """A strategy's `forward_backward` calls its loss as the contract says (the logits, a `CorruptedBatch`, a
    `TokenCounts`, documented keywords only) and the loss declares the Protocol's signature; a strategy that calls
    its loss another way (I-DLM, DFlash) passes only parameters its loss names."""
    real, calls = _recorded_step(name)
    assert calls, f"{name}: forward_backward never called ctx.loss_fn"
    for method, args, kwargs in calls:
        signature = inspect.signature(getattr(real, method))
        signature.bind(*args, **kwargs)  # what forward_backward passed
        if name not in OWN_CALL:
            assert method == "forward" and _follows_the_contract(args, kwargs), f"{name}: called its loss off-contract"
            assert _parameters(real.forward) == _parameters(DiffusionLoss.__call__)
        else:
            named = {n for n, p in signature.parameters.items() if p.kind is not p.VAR_KEYWORD}
            assert set(kwargs) <= named, f"{name}: {method} swallows {sorted(set(kwargs) - named)} unnamed"


def test_the_base_forward_backward_passes_the_contract_and_nothing_else():
    """The default step (mdlm's) passes the logits, the micro-batch `pre_step` corrupted and
    `TokenCounts(diffusion=…)`, and no keyword."""
    _, calls = _recorded_step("mdlm")
    ((method, args, kwargs),) = calls
    assert method == "forward" and _follows_the_contract(args, kwargs) and kwargs == {}
    assert args[2].diffusion is not None and args[2].ar is None


def test_the_hybrid_passes_its_ar_count_and_causal_logits():
    """The hybrid's step adds the AR denominator and the causal branch's logits (its AR term supervises the batch's
    loss mask)."""
    _, calls = _recorded_step("hybrid")
    ((method, args, kwargs),) = calls
    assert method == "forward" and _follows_the_contract(args, kwargs)
    assert args[2].diffusion is not None and args[2].ar is not None and kwargs["causal_logits"] is not None


def test_block_diffusion_scores_its_canvas_window():
    """Block diffusion's batch is its canvas window: the clean ids are the window's targets, the ids the model saw
    its canvas."""
    _, calls = _recorded_step("block_diffusion")
    ((_, args, _),) = calls
    batch = args[1]
    assert batch.clean_ids.shape == batch.noisy_ids.shape == batch.loss_mask.shape == args[0].shape[:2]
    assert batch.extras is None


def test_architecture_md_writes_the_contract_as_the_code_has_it():
    """docs/architecture.md ("How a strategy plugs in") shows the loss call: the same names in the same order."""
    text = (ROOT / "docs/architecture.md").read_text()
    section = text.split("## How a strategy plugs in", 1)[1].split("\n## ", 1)[0]
    call = re.search(r"ctx\.loss_fn\(([^)]*)\)", section)
    assert call, "docs/architecture.md, 'How a strategy plugs in', no longer shows the ctx.loss_fn(...) call"
    names = [part.split("=")[0].strip() for part in call.group(1).replace("\n", " ").split(",")]
    assert [n for n in names if n != "*"] == [*LOSS_ARGUMENTS, *LOSS_KEYWORDS]
    assert "DiffusionLoss" in section and "CorruptedBatch" in section and "TokenCounts" in section
