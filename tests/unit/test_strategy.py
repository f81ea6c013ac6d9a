"""The seed strategy API: the registry and what is derived from it, MDLM hooks, step-level normalization across
micro-batches."""

import re

import pytest
import torch

from strategies import (
    DLLM_STRATEGIES,
    MDLMCrossEntropyLoss,
    MDLMStrategy,
    Microbatch,
    SCDDStrategy,
    StepContext,
    get_dllm_strategy,
    strategy_class,
)
from strategies.base_evaluation import DLLMEvaluator
from strategies.models import build_model, tiny_model_config
from strategies.options import MDLMOptions
from strategies.registration import (
    ABSORBING,
    ABSORBING_SAMPLER,
    Registration,
    SamplerInfo,
    StrategyOptions,
    load_object,
)
from strategies.registry import REGISTRY, SAMPLERS, model_shapes, on_demand_modules, register, registered


def test_an_unknown_strategy_is_refused_naming_pipeline_strategies_and_the_registered_ones():
    names = re.escape(str(sorted(REGISTRY)))
    with pytest.raises(ValueError, match=rf"unknown strategy 'nope': pipeline.strategies takes .*{names}"):
        get_dllm_strategy("nope")
    with pytest.raises(TypeError, match=r"a strategy name is a string .*got list \['mdlm'\]"):
        get_dllm_strategy(["mdlm"])  # not a hashing error deep inside the registry


@pytest.mark.parametrize("mode", sorted(REGISTRY))
def test_every_registered_strategy_is_well_formed(mode):
    """The class answers what its registration declares: its options, its samplers (in order, each in the
    derived table with the same description), its evaluation kind, its likelihoods (a diffusion evaluation
    estimates each with the strategy's method), its model shape."""
    reg, cls = REGISTRY[mode], DLLM_STRATEGIES[mode]
    s = get_dllm_strategy(mode)
    assert isinstance(s, cls) and s.normalization_mode in ("supervised", "noise")
    assert cls.Options is reg.options and tuple(cls.samplers) == tuple(reg.samplers)
    assert all(SAMPLERS[name] == info for name, info in reg.samplers.items())
    assert cls.evaluation in ("diffusion", "speculative") and reg.samples == (cls.evaluation == "diffusion")
    assert set(cls.likelihoods) <= {"nelbo", "ar_nll"}
    evaluator = type(s.evaluator)  # the evaluation hooks: the registration's evaluator, else the base one
    assert issubclass(evaluator, DLLMEvaluator) and s.evaluator.strategy is s
    assert evaluator is (DLLMEvaluator if reg.evaluator is None else load_object(reg.evaluator))
    if cls.evaluation == "diffusion":  # the evaluate stage estimates each with the strategy's own method
        assert all(callable(getattr(cls, f"{kind}_rows", None)) for kind in cls.likelihoods)
        assert "ar_nll" not in cls.likelihoods or evaluator.ar_nll_rows is not DLLMEvaluator.ar_nll_rows
    assert cls.model_architecture is None or cls.model_architecture in reg.models
    assert not hasattr(s, "loss_log_key")  # docs/reference-differences.md G12: no unread loss key
    values = {"vocab_size": 64, "mask_token_id": 63, "block_size": 4}
    assert s.create_loss_fn({k: v for k, v in values.items() if k in s.Options.model_fields}) is not None
    with pytest.raises(Exception, match="extra"):
        s.create_loss_fn({"not_an_option": 1})


def test_the_sampler_table_and_the_model_shapes_are_derived_from_the_registry():
    declared = {name for reg in REGISTRY.values() for name in reg.samplers}
    assert set(SAMPLERS) == declared and SAMPLERS[ABSORBING] == ABSORBING_SAMPLER
    shapes = {name for reg in REGISTRY.values() for name in reg.models}
    assert set(model_shapes()) == shapes and all(isinstance(c, type) for c in model_shapes().values())
    with pytest.raises(KeyError, match="unknown sampler 'nope'"):
        SAMPLERS["nope"]


class OtherOptions(StrategyOptions):
    pass


class _Other(MDLMStrategy):
    Options = OtherOptions
    samplers = ("other", ABSORBING)


OTHER_SAMPLERS = {"other": SamplerInfo("a test's"), ABSORBING: ABSORBING_SAMPLER}


def test_a_strategy_registered_at_run_time_appears_everywhere_and_leaves_again():
    reg = Registration(OtherOptions, _Other, OTHER_SAMPLERS)
    with registered("other", reg):
        assert DLLM_STRATEGIES["other"] is _Other and strategy_class("other") is _Other
        assert "other" in SAMPLERS and isinstance(get_dllm_strategy("other"), _Other)
        with pytest.raises(ValueError, match="'other' is already registered"):
            register("other", reg)
    assert "other" not in REGISTRY and "other" not in DLLM_STRATEGIES and "other" not in SAMPLERS
    with pytest.raises(ValueError, match="unknown strategy 'other'"):
        strategy_class("other")


class _OtherEvaluator(DLLMEvaluator):
    pass


def test_a_run_time_registration_without_an_evaluator_falls_back_to_the_base_one():
    """Its evaluation hooks are the base evaluator's (keyed by evaluation stages only); one given as a class is
    used as it is, and an unregistered subclass evaluates as the registered class it derives from."""
    with registered("other", Registration(OtherOptions, _Other, OTHER_SAMPLERS)):
        assert type(get_dllm_strategy("other").evaluator) is DLLMEvaluator
        assert "strategies.base_evaluation" in on_demand_modules("other", evaluation=True)
        assert "strategies.base_evaluation" not in on_demand_modules("other")
    with registered("other", Registration(OtherOptions, _Other, OTHER_SAMPLERS, evaluator=_OtherEvaluator)):
        assert type(get_dllm_strategy("other").evaluator) is _OtherEvaluator
        assert __name__ in on_demand_modules("other", evaluation=True)

    class Unregistered(SCDDStrategy):
        pass

    from strategies.scdd.evaluation import SCDDEvaluator

    assert type(Unregistered({"vocab_size": 8}).evaluator) is SCDDEvaluator


def test_a_registration_that_disagrees_with_its_class_or_another_strategy_is_refused():
    clash = {"other": SamplerInfo("a test's"), ABSORBING: SamplerInfo("not the absorbing sampler")}
    with pytest.raises(ValueError, match="sampler 'llada' is declared by 'mdlm' and, differently, by 'other'"):
        register("other", Registration(OtherOptions, _Other, clash))
    assert "other" not in REGISTRY
    shape = {"hybrid": "strategies.mdlm.strategy:MDLMStrategy"}
    with pytest.raises(ValueError, match="model shape 'hybrid' is declared by 'hybrid' and, differently"):
        register("other", Registration(OtherOptions, _Other, {"other": SamplerInfo("x")}, models=shape))
    with registered("other", Registration(OtherOptions, _Other, {"other": SamplerInfo("only one")})):
        with pytest.raises(TypeError, match=r"samplers is \('other', 'llada'\), its registration declares"):
            strategy_class("other")
    with registered("other", Registration(MDLMOptions, _Other, OTHER_SAMPLERS)):
        with pytest.raises(TypeError, match="Options is OtherOptions, its registration says MDLMOptions"):
            strategy_class("other")
    with pytest.raises(ValueError, match="unknown setting"):
        SamplerInfo("x", settings=("temperature", "steps"))


def test_mdlm_create_loss_fn_accepts_mapping_and_typed():
    assert isinstance(MDLMStrategy().create_loss_fn({}), MDLMCrossEntropyLoss)
    assert MDLMStrategy().create_loss_fn(MDLMOptions(loss_weighting="flat")).weighting == "flat"
    assert MDLMStrategy({"loss_weighting": "flat"}).create_loss_fn().weighting == "flat"


def test_create_loss_fn_is_pure():
    """Building a loss leaves the strategy as it was: two builds from other options do not interfere."""
    s = get_dllm_strategy("idlm", {"block_length": 2})
    s.create_loss_fn({"block_length": 5, "clean_loss_weight": 0.7})
    assert s.block_length == 2 and s.options.clean_loss_weight == 0.2


def test_prepare_batch_feeds_noisy_ids_without_attention_mask():
    s = MDLMStrategy()
    clean, noisy = torch.tensor([[1, 2, 3]]), torch.tensor([[1, 9, 3]])
    out = s.prepare_batch(
        {"attention_mask": torch.ones(1, 3), "input_lengths": torch.tensor([3])}, noisy, noisy == 9, clean
    )
    assert torch.equal(out["input_ids"], noisy) and "attention_mask" not in out and "input_lengths" in out


def _model(vocab=40):
    return build_model(tiny_model_config("llama", vocab, 16, 16, 1, 2, None, None, True), seed=0)


def _ctx(model, step=0, grad_acc=1, seed=42):
    return StepContext(
        model=model,
        loss_fn=MDLMCrossEntropyLoss(),
        mask_token_id=39,
        step=step,
        base_seed=seed,
        grad_acc_steps=grad_acc,
    )


def _rows(n=4, length=16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 39, (n, length), generator=g)
    loss = torch.ones(n, length)
    loss[:, :3] = 0
    return ids, loss, torch.ones(n, length, dtype=torch.long)


def test_pre_step_counts_and_corruption_is_row_seeded():
    ids, loss, attn = _rows()
    s = MDLMStrategy()
    corrupted, n_noise, n_sup = s.pre_step(_ctx(_model()), [Microbatch(ids, loss, attn)])
    assert n_sup == int(loss.sum()) and n_noise == int(corrupted[0].noise_mask.sum())
    # the same rows split into two micro-batches of 2 get identical noise (topology independence)
    split, _, _ = s.pre_step(
        _ctx(_model(), grad_acc=2), [Microbatch(ids[:2], loss[:2], attn[:2]), Microbatch(ids[2:], loss[2:], attn[2:])]
    )
    # rows are seeded by global index: row j of the step always gets seed(step, j)
    one_by_one, _, _ = s.pre_step(
        _ctx(_model(), grad_acc=4), [Microbatch(ids[i : i + 1], loss[i : i + 1], attn[i : i + 1]) for i in range(4)]
    )
    two_by_two = split
    assert torch.equal(torch.cat([c.noisy_ids for c in one_by_one]), torch.cat([c.noisy_ids for c in two_by_two]))
    assert torch.equal(torch.cat([c.noisy_ids for c in one_by_one]), corrupted[0].noisy_ids)


def _grads_after_step(microbatch_split):
    ids, loss, attn = _rows()
    model = _model()
    s = MDLMStrategy()
    ctx = _ctx(model, grad_acc=len(microbatch_split))
    mbs = [Microbatch(ids[a:b], loss[a:b], attn[a:b]) for a, b in microbatch_split]
    corrupted, n_noise, n_sup = s.pre_step(ctx, mbs)
    n_diff, n_ar = s.loss_denominators(corrupted, n_noise, n_sup)
    total = sum(
        float(s.forward_backward(ctx, c, num_diffusion_tokens=n_diff, num_ar_tokens=n_ar, is_train=True).dllm_loss)
        for c in corrupted
    )
    return total, [p.grad.clone() for p in model.parameters()]


def test_gradient_accumulation_equals_full_batch():
    full_loss, full_grads = _grads_after_step([(0, 4)])
    acc_loss, acc_grads = _grads_after_step([(0, 2), (2, 4)])
    assert acc_loss == pytest.approx(full_loss, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(full_grads, acc_grads))


def test_noise_changes_with_step_and_seed():
    ids, loss, attn = _rows()
    s = MDLMStrategy()
    base = s.pre_step(_ctx(_model(), step=0), [Microbatch(ids, loss, attn)])[0][0].noise_mask
    later = s.pre_step(_ctx(_model(), step=1), [Microbatch(ids, loss, attn)])[0][0].noise_mask
    other_seed = s.pre_step(_ctx(_model(), seed=7), [Microbatch(ids, loss, attn)])[0][0].noise_mask
    assert not torch.equal(base, later) and not torch.equal(base, other_seed)


def test_a_stand_in_class_takes_a_registered_name_until_it_is_removed():
    DLLM_STRATEGIES["mdlm"] = _Other
    try:
        assert strategy_class("mdlm") is _Other and list(DLLM_STRATEGIES).count("mdlm") == 1
    finally:
        del DLLM_STRATEGIES["mdlm"]
    assert strategy_class("mdlm") is MDLMStrategy
    DLLM_STRATEGIES["mdlm"] = MDLMStrategy  # what monkeypatch.setitem's undo does: no stand-in is left behind
    with pytest.raises(KeyError):
        del DLLM_STRATEGIES["mdlm"]


MASK_ID_HOOKS = ("apply_corruption", "sample", "nelbo_rows")


def _admits_none(annotated) -> bool:
    """`annotated`'s `mask_token_id` may be None (or is not annotated)."""
    import typing

    hint = typing.get_type_hints(annotated).get("mask_token_id")
    return hint is None or type(None) in typing.get_args(hint)


@pytest.mark.parametrize("mode", sorted(REGISTRY))
def test_the_mask_id_a_hook_gets_is_typed_none_where_it_can_be(mode):
    """`mask_token_id` is None in the step and setup contexts and in the hooks of a strategy that uses no [MASK]
    token (`uses_mask_token` False): the base hooks and the contexts say `int | None` and when it is None, and
    such a strategy's own overrides do too (block_diffusion's `sample` and `nelbo_rows` said `int`)."""
    from strategies.base import DLLMStrategy, SetupContext
    from strategies.base_evaluation import SampleRequest

    hooks = [getattr(DLLMStrategy, hook) for hook in MASK_ID_HOOKS]
    hooks += [getattr(DLLMEvaluator, hook) for hook in MASK_ID_HOOKS if hasattr(DLLMEvaluator, hook)]
    for carrier in (StepContext, SetupContext, SampleRequest, *hooks):
        assert _admits_none(carrier), carrier.__qualname__
        assert "None" in (carrier.__doc__ or ""), f"{carrier.__qualname__} does not say when the mask id is None"
    cls = DLLM_STRATEGIES[mode]
    if not cls.uses_mask_token:
        evaluator = type(cls().evaluator)
        owners = [cls, *([evaluator] * (evaluator is not DLLMEvaluator))]
        for owner, hook in ((o, h) for o in owners for h in MASK_ID_HOOKS if hasattr(o, h)):
            assert _admits_none(getattr(owner, hook)), f"{owner.__name__}.{hook} types mask_token_id as never None"
