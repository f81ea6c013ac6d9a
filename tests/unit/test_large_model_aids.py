"""LoRA (peft), activation checkpointing and bf16 autocast through the training stage."""

from pathlib import Path

import pytest
import torch
from runkit import metric_history
from safetensors.torch import load_file

from dllm_common.checkpoint import load_weights_into
from dllm_common.config import PeftConfig
from strategies import MDLMStrategy, Microbatch, StepContext
from strategies.models import (
    add_lora,
    build_model,
    enable_activation_checkpointing,
    lora_state_dict,
    merge_lora,
    model_from_config_dir,
    tiny_model_config,
)
from tasks.evaluate import evaluate
from tasks.evaluation.trained_model import load_for_generation
from tasks.train import model_dir, train
from tasks.training.trainee import build_trainee

V, M = 64, 63


def _tiny(seed=0):
    return build_model(tiny_model_config("llama", V, 32, 32, 2, 4, None, None, True), seed)


def _spec(tiny_spec, **train):
    return tiny_spec.model_copy(
        update={"train": tiny_spec.train.model_copy(update={"steps": 30, "val_every": 5, **train})}
    )


def test_merge_folds_adapters_without_changing_the_function():
    model = _tiny()
    add_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if "lora_" in n
    }
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # LoRA starts at B = 0: make the adapter do something
    ids = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        merge_lora(model)
        after = model(input_ids=ids).logits
    assert not lora_state_dict(model) and not hasattr(model.config, "dllm_lora")
    assert torch.allclose(before, after, atol=1e-5)
    assert isinstance(model.model.layers[0].self_attn.q_proj, torch.nn.Linear)


def _mdlm_step_grads(model) -> list[torch.Tensor]:
    """The parameter gradients of one fixed MDLM step on `model`."""
    model.train()
    s = MDLMStrategy()
    ctx = StepContext(model=model, loss_fn=s.create_loss_fn({}), mask_token_id=M, step=1, base_seed=0)
    ids = torch.randint(0, M, (4, 16), generator=torch.Generator().manual_seed(0))
    corrupted, _, n_sup = s.pre_step(ctx, [Microbatch(ids, torch.ones(4, 16), torch.ones(4, 16))])
    s.forward_backward(ctx, corrupted[0], num_diffusion_tokens=n_sup, num_ar_tokens=n_sup, is_train=True)
    return [p.grad.clone() for p in model.parameters()]


def test_activation_checkpointing_gives_the_same_gradients():
    checkpointed = _tiny()
    enable_activation_checkpointing(checkpointed)
    pairs = zip(_mdlm_step_grads(_tiny()), _mdlm_step_grads(checkpointed))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in pairs)


@pytest.fixture(scope="module")
def base_model(prepared, tiny_spec, tmp_path_factory):
    """A briefly trained model to adapt (LoRA on a random network has little to work with)."""
    data, _ = prepared
    return train(_spec(tiny_spec), "mdlm", data, str(tmp_path_factory.mktemp("base")))


@pytest.mark.parametrize("merge", [False, True])
def test_lora_training_trains_adapters_only_and_publishes_them(prepared, tiny_spec, tmp_path, merge, base_model):
    data, _ = prepared
    base = base_model
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    spec = _spec(tiny_spec, lr=1e-2, peft=PeftConfig(r=8, alpha=16, target_modules=targets, merge=merge))
    spec = spec.model_copy(
        update={"model": spec.model.model_copy(update={"kind": "pretrained", "path": str(model_dir(base))})}
    )
    trained = train(spec, "mdlm", data, str(tmp_path))
    val = [v for _, v in metric_history(tmp_path, trained.mlflow_run_id, "val/loss")]
    assert val[-1] < val[0]
    adapter = load_file(str(__import__("pathlib").Path(trained.path) / "adapter" / "adapter_model.safetensors"))
    assert (
        adapter
        and all("lora_" in k for k in adapter)
        and any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)
    )
    weights = load_file(str(model_dir(trained) / "model.safetensors"))
    before = load_file(str(model_dir(base) / "model.safetensors"))
    assert torch.equal(weights["model.norm.weight"], before["model.norm.weight"])  # frozen
    q = "model.layers.0.self_attn.q_proj.weight" if merge else "model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(weights[q], before["model.layers.0.self_attn.q_proj.weight"]) != merge  # merged ⇒ folded in
    assert any("lora_" in k for k in weights) != merge  # merged checkpoints are plain models
    rebuilt = model_from_config_dir(model_dir(trained))
    load_weights_into(rebuilt, model_dir(trained))
    assert trained.info["peft"]["merged"] == merge
    metrics = evaluate(spec, "mdlm", trained, data, str(tmp_path)).info["metrics"]
    assert metrics["eval/nelbo"] > 0
    if not merge:  # the published adapter alone, merged into the base checkpoint by `generate --adapter`
        adapted, *_ = load_for_generation(model_dir(base), "cpu", adapter=str(Path(trained.path) / "adapter"))
        ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.allclose(adapted(input_ids=ids).logits, rebuilt.eval()(input_ids=ids).logits, atol=1e-4)
        with pytest.raises(FileNotFoundError, match="adapter_config.json"):
            load_for_generation(model_dir(base), "cpu", adapter=str(tmp_path))


def test_bf16_autocast_trains(prepared, tiny_spec, tmp_path):
    data, _ = prepared
    fp32 = train(_spec(tiny_spec), "mdlm", data, str(tmp_path / "fp32"))
    bf16 = train(_spec(tiny_spec, precision="bf16"), "mdlm", data, str(tmp_path / "bf16"))
    a = metric_history(tmp_path / "fp32", fp32.mlflow_run_id, "train/loss")
    b = metric_history(tmp_path / "bf16", bf16.mlflow_run_id, "train/loss")
    assert a[0][1] != b[0][1] and abs(a[0][1] - b[0][1]) < 0.05 * a[0][1]  # bf16 really ran, and is close
    val = [v for _, v in metric_history(tmp_path / "bf16", bf16.mlflow_run_id, "val/loss")]
    assert val[-1] < val[0] - 0.3


def test_activation_checkpointing_with_block_diffusion_is_refused(prepared, tiny_spec):
    data, _ = prepared
    with pytest.raises(
        ValueError, match="train.activation_checkpointing is not supported with block_diffusion; set it to false"
    ):
        build_trainee(_spec(tiny_spec, activation_checkpointing=True), "block_diffusion", data, "cpu")


def test_fused_head_trains_the_same_curve_as_full_logits(prepared, tiny_spec, tmp_path):
    """`train.fused_head` (the default) changes where logits are computed, not what is learned."""
    data, _ = prepared
    curves = {}
    for fused in (True, False):
        run = train(_spec(tiny_spec, fused_head=fused), "hybrid", data, str(tmp_path / str(fused)))
        curves[fused] = [v for _, v in metric_history(tmp_path / str(fused), run.mlflow_run_id, "train/loss")]
    assert len(curves[True]) == len(curves[False]) > 2
    assert max(abs(a - b) for a, b in zip(curves[True], curves[False])) < 1e-4


def test_compiled_layers_give_the_eager_gradients():
    from tasks.training.trainee import compile_layers

    compiled = _tiny()
    assert compile_layers(compiled) == len(compiled.model.layers)
    pairs = zip(_mdlm_step_grads(_tiny()), _mdlm_step_grads(compiled))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in pairs)
    assert list(_tiny().state_dict()) == list(compiled.state_dict())  # compiled in place: checkpoint names unchanged
