"""block_diffusion on transformers' DiffusionGemmaForBlockDiffusion (docs/strategies.md §9.5): the tiny config sized
from `model:`, the options it refuses, the canvas call against transformers' own forward, the fused head's soft
cap, the sampler against transformers' own generation, checkpoints that transformers loads, a DiffusionGemma
checkpoint as `model.path`."""

import pytest
import torch
from losskit import corrupted
from transformers import DiffusionGemmaForBlockDiffusion, LlamaForCausalLM

from dllm_common.checkpoint import load_weights_into, write_checkpoint
from dllm_common.config import ConfigError
from strategies import Microbatch, StepContext, assemble_strategy
from strategies.base import TokenCounts
from strategies.block_diffusion.gemma import DiffusionGemmaCanvas
from strategies.block_diffusion.loss import OwnTokenCanvasLoss
from strategies.block_diffusion.model import BlockDiffusionLM
from strategies.block_diffusion.sampling import block_canvas_sample
from strategies.block_diffusion.strategy import build_response_window
from strategies.head import HeadProjection, deferred_logits, make_head_deferrable
from strategies.losses import nll_at
from strategies.models import model_from_config_dir, tiny_diffusion_gemma_config
from strategies.options import validate_config
from strategies.sampling import SamplerConfig
from tasks.training.trainee import build_trainee

V, BS = 48, 4
IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}


def _gemma(seed=0, experts=2, vocab=V) -> DiffusionGemmaCanvas:
    config = tiny_diffusion_gemma_config(
        vocab, 64, 32, 2, 2, 1, None, num_experts=experts, top_k_experts=1, moe_intermediate_size=8,
        canvas_length=BS, token_ids=IDS,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DiffusionGemmaCanvas(config)


def _exact(model):
    """float64 with the experts looped in Python (`torch._grouped_mm` has no float64 kernel)."""
    model = model.double().eval()
    model.set_experts_implementation("eager")
    return model


def _native(model, **kwargs):
    """transformers' own forward of the same module (`DiffusionGemmaForBlockDiffusion.forward`)."""
    return DiffusionGemmaForBlockDiffusion.forward(model, **kwargs).logits


# ------------------------------------------------------------------ the model `model:` describes


def _spec(tiny_spec, **dllm):
    raw = tiny_spec.model_dump(mode="json")
    raw["pipeline"]["strategies"] = ["block_diffusion"]
    return validate_config({**raw, "dllm": {"block_size": 8, **dllm}})


def test_the_tiny_model_is_transformers_diffusion_gemma_sized_from_the_model_section(prepared, tiny_spec):
    data, _ = prepared
    spec = _spec(tiny_spec, num_experts=2)
    trainee = build_trainee(spec, "block_diffusion", data, "cpu")
    model, text = trainee.model, trainee.model.config.text_config
    assert isinstance(model, DiffusionGemmaForBlockDiffusion) and model.config.architectures == [
        "DiffusionGemmaForBlockDiffusion"
    ]
    m = spec.model
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (
        m.hidden_size,
        m.num_layers,
        m.num_heads,
    )
    assert text.vocab_size == len(trainee.tokenizer) and text.intermediate_size == 3 * m.hidden_size
    assert (text.num_experts, text.top_k_experts, text.moe_intermediate_size) == (2, 1, 3 * m.hidden_size // 3)
    assert text.layer_types == ["sliding_attention", "full_attention"] and model.config.canvas_length == 8
    enc, dec = model.model.encoder.language_model, model.model.decoder
    for a, b in zip(enc.layers, dec.layers):  # one stack: the encoder's layers are the decoder's parameters
        assert all(x is y for x, y in zip(a.parameters(), b.parameters()))
    assert model.lm_head.weight is dec.embed_tokens.weight is enc.embed_tokens.weight
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(".vision_tower." in n or ".embed_vision." in n for n in frozen)
    assert trainee.fused_head and model.lm_head.softcap == 30.0  # the fused head carries DiffusionGemma's cap
    assert trainee.strategy.vocab_size == text.vocab_size  # the options' vocabulary is the text config's

    stack = build_trainee(_spec(tiny_spec, architecture="stack"), "block_diffusion", data, "cpu").model
    assert isinstance(stack, BlockDiffusionLM) and isinstance(stack.lm, LlamaForCausalLM)


@pytest.mark.parametrize(
    "dllm,model,train,message",
    [
        ({"num_experts": 2, "top_k_experts": 3}, {}, {}, "top_k_experts (3) is larger than num_experts (2)"),
        ({"architecture": "stack", "num_experts": 4}, {}, {}, "num_experts size a DiffusionGemma's experts"),
        ({}, {"tie_embeddings": False}, {}, "model.tie_embeddings is false, but dllm.architecture diffusion_gemma"),
        ({}, {}, {"peft": {"r": 4}}, "train.peft with dllm.architecture diffusion_gemma"),
        ({"moe_intermediate_size": 8}, {"kind": "pretrained", "path": "x"}, {}, "the checkpoint at model.path"),
    ],
    ids=["top_k", "stack-experts", "untied", "peft", "pretrained-resized"],
)
def test_what_a_diffusion_gemma_cannot_be_is_refused_at_config_load(tiny_spec, dllm, model, train, message):
    raw = tiny_spec.model_dump(mode="json")
    raw["pipeline"]["strategies"] = ["block_diffusion"]
    raw["model"].update(model)
    raw["train"].update(train)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config({**raw, "dllm": dllm})
    ok = {**raw, "dllm": {**dllm, "architecture": "stack"}}  # the stack takes what DiffusionGemma refuses
    if "num_experts" not in dllm and "moe_intermediate_size" not in dllm:
        validate_config(ok)


def test_a_diffusion_gemma_checkpoint_as_model_path_trains_as_itself(prepared, tiny_spec, tmp_path):
    data, _ = prepared
    spec = _spec(tiny_spec)
    tokenizer = build_trainee(spec, "block_diffusion", data, "cpu").tokenizer
    published = DiffusionGemmaForBlockDiffusion(_gemma(seed=3, vocab=len(tokenizer)).config)
    published.save_pretrained(tmp_path / "dg")  # transformers' own writer: a DiffusionGemma from anywhere
    raw = spec.model_dump(mode="json")
    raw["model"] = {"kind": "pretrained", "path": str(tmp_path / "dg")}
    model = build_trainee(validate_config(raw), "block_diffusion", data, "cpu").model
    assert isinstance(model, DiffusionGemmaCanvas)
    mine, theirs = model.state_dict(), published.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    LlamaForCausalLM(_llama_config()).save_pretrained(tmp_path / "llama")
    raw["model"]["path"] = str(tmp_path / "llama")
    with pytest.raises(
        ValueError, match="is a 'llama' checkpoint, not a DiffusionGemma one: .* dllm.architecture: stack"
    ):
        build_trainee(validate_config(raw), "block_diffusion", data, "cpu")


def _llama_config():
    from strategies.models import tiny_model_config

    return tiny_model_config("llama", V, 32, 32, 1, 2, None, None, True)


# ------------------------------------------------------------------ the canvas call against transformers' forward


def _row_batch():
    """Two rows of 14 tokens: a 2-token prompt then the response; row 1's last 3 tokens are padding."""
    g = torch.Generator().manual_seed(4)
    clean = torch.randint(3, V, (2, 14), generator=g)
    noisy = torch.randint(3, V, (2, 14), generator=g)
    loss = torch.ones(2, 14, dtype=torch.bool)
    loss[:, :2] = False
    attention = torch.ones(2, 14, dtype=torch.long)
    attention[1, 11:] = 0
    return clean, noisy, loss, attention


def _canvas_inputs(clean, w) -> dict:
    """The canvas call's arguments for the clean rows and their response window."""
    return dict(
        input_ids=clean,
        canvas_ids=w.canvas_ids,
        decoder_attention_mask=w.decoder_attention_mask,
        encoder_position_ids=w.encoder_position_ids,
        encoder_padding_mask=w.encoder_padding_mask,
        decoder_position_ids=w.decoder_position_ids,
    )


def test_the_canvas_call_is_transformers_forward_block_by_block():
    """Every block of the training canvas (the encoder over the padded row, the block-causal masks) equals
    transformers' own call on that block with the clean tokens before it: float64, to rounding."""
    model = _exact(_gemma())
    clean, noisy, loss, attention = _row_batch()
    w = build_response_window(
        clean, noisy, loss, loss, torch.ones(2, 14), attention, BS, None, model.canvas_sliding_window
    )
    sc = torch.randn(2, w.canvas_ids.shape[1], V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    inputs = _canvas_inputs(clean, w)
    with torch.no_grad():
        plain, conditioned = model(**inputs).logits, model(**inputs, self_conditioning_logits=sc).logits
        worst = 0.0
        for row in range(2):
            length = int(attention[row].sum())
            for start in range(2, length, BS):
                end = min(start + BS, length)
                cols = slice(start - 2, end - 2)
                for ours, prev in ((plain, None), (conditioned, sc[row : row + 1, cols])):
                    theirs = _native(
                        model,
                        input_ids=clean[row : row + 1, :start],
                        decoder_input_ids=w.canvas_ids[row : row + 1, cols],
                        self_conditioning_logits=prev,
                    )
                    worst = max(worst, float((ours[row, cols] - theirs[0]).abs().max()))
    print(f"[measured] canvas call vs transformers' forward, float64: max |Δ logits| = {worst:.1e}")
    assert worst < 1e-9


def test_training_conditions_each_row_on_its_own_first_pass_when_its_coin_says_so():
    model = _exact(_gemma())
    clean, noisy, loss, attention = _row_batch()
    w = build_response_window(clean, noisy, loss, loss, torch.ones(2, 14), attention, BS, None, None)
    inputs = _canvas_inputs(clean, w)
    with torch.no_grad():
        first = model(**inputs).logits
        with_sc = model(**inputs, self_conditioning_logits=first).logits
    model.train()
    out = model(**inputs, do_self_conditioning=torch.tensor([True, False]))
    assert torch.allclose(out.logits[0], with_sc[0], atol=1e-12) and torch.allclose(out.logits[1], first[1], atol=1e-12)
    assert out.encoder_logits.shape == (2, 14, V)
    out.logits.sum().backward()
    gate = model.model.decoder.self_conditioning.gate_proj.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0  # DiffusionGemma's own block is trained
    with pytest.raises(ValueError, match="do_self_conditioning must be given in training"):
        model(**inputs)
    with pytest.raises(ValueError, match="needs decoder_attention_mask as"):
        model(
            **{**inputs, "decoder_attention_mask": w.decoder_attention_mask["full_attention"]},
            do_self_conditioning=None,
        )


# ------------------------------------------------------------------ the fused head's soft cap (docs/strategies.md §5.9)


def test_a_soft_capped_projection_equals_the_capped_logits_values_and_gradients():
    g = torch.Generator().manual_seed(6)
    h = (torch.randn(2, 9, 8, generator=g) * 3).requires_grad_(True)
    w = torch.randn(V, 8, generator=g).requires_grad_(True)
    m = torch.randn(V, 5, generator=g).requires_grad_(True)
    x = torch.randint(0, V, (2, 9), generator=g)
    z = torch.randint(0, V, (2, 9), generator=g)
    sel = torch.rand(2, 9, generator=g) < 0.7
    level = torch.full((2, 9), 0.4)

    def run(fused: bool):
        for t in (h, w, m):
            t.grad = None
        logits = HeadProjection(h, w, None, chunk_rows=4, softcap=2.0) if fused else torch.tanh(h @ w.T / 2.0) * 2.0
        total = nll_at(logits, sel, x).sum()
        total = total + OwnTokenCanvasLoss()(logits, corrupted(x, None, level, sel, noisy=z), TokenCounts()).total_loss
        soft = logits.softmax_matmul(m) if fused else torch.softmax(logits.detach(), -1) @ m
        (total + (soft * torch.arange(5.0)).sum()).backward()
        return total.detach(), soft.detach(), [t.grad.clone() for t in (h, w, m)]

    (a, sa, ga), (b, sb, gb) = run(True), run(False)
    assert torch.allclose(a, b, rtol=1e-6) and torch.allclose(sa, sb, atol=1e-6)
    for got, want in zip(ga, gb):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("evidence", ["analytic", "learned"])
def test_the_fused_head_trains_diffusion_gemma_as_the_plain_one(evidence):
    """One training step's loss and gradients with the deferred, capped head equal the plain head's, under either
    canvas loss (docs/strategies.md §5.4); a module that caps its own head's output (a stock Gemma) is left with a
    plain head."""
    from strategies.block_diffusion.strategy import BlockDiffusionStrategy

    plain, fused = _gemma().train(), _gemma().train()
    assert make_head_deferrable(fused) and fused.lm_head.softcap == fused.final_logit_softcapping == 30.0
    stock = DiffusionGemmaForBlockDiffusion(_gemma().config)  # transformers' class caps in its own forward
    assert not make_head_deferrable(stock) and type(stock.lm_head) is torch.nn.Linear

    ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(7))
    mb = Microbatch(ids, torch.ones(2, 12), torch.ones(2, 12))
    results = []
    for model, defer in ((plain, False), (fused, True)):
        options = {"block_size": BS, "self_conditioning_p": 0.5, "own_token_evidence": evidence}
        built = assemble_strategy("block_diffusion", options, model, None)
        s = built.strategy
        assert isinstance(s, BlockDiffusionStrategy) and s.vocab_size == V
        ctx = StepContext(model=model, loss_fn=built.loss_fn, mask_token_id=None, step=1, base_seed=0)
        with deferred_logits(model, defer):
            corrupted, n_noise, n_sup = s.pre_step(ctx, [mb])
            n_diff, n_ar = s.loss_denominators(corrupted, n_noise, n_sup)
            out = s.forward_backward(ctx, corrupted[0], num_diffusion_tokens=n_diff, num_ar_tokens=n_ar, is_train=True)
        results.append((float(out.total_loss), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (la, ga), (lb, gb) = results
    assert abs(la - lb) < 1e-5 and ga.keys() == gb.keys()
    assert max(float((ga[k] - gb[k]).abs().max()) for k in ga) < 1e-4


# ------------------------------------------------------------------ sampling against transformers' generation


def _sharp(seed=0):
    model = _gemma(seed).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # tied: also the embedding; well-separated argmaxes on a random model
    return model


@pytest.mark.parametrize("cache", ["exact", "none"])
def test_one_step_per_block_gives_transformers_generation_tokens(cache):
    """Greedy, one denoising step per block: the canvas sampler (with DiffusionGemma's own encoder cache, or the
    whole model every step) writes the tokens of transformers' generation started from the same canvases."""
    model, prompt, blocks = _sharp(), [2, 10, 11, 12, 13], 3
    config = SamplerConfig(steps=blocks, max_new_tokens=blocks * BS, block_size=BS, temperature=0.0, cache=cache)
    ours = block_canvas_sample(
        model, [prompt], vocab_size=V, block_size=BS, pad_token_id=0, config=config,
        generator=torch.Generator().manual_seed(9),
    ).generated(0)  # fmt: skip
    g, cached, uncached, theirs = torch.Generator().manual_seed(9), None, torch.tensor([prompt]), []
    for _ in range(blocks):
        canvas = torch.randint(0, V, (1, BS), generator=g)
        out = model.generate(uncached, cache=cached, decoder_input_ids=canvas, max_new_tokens=BS, max_denoising_steps=1)
        cached, uncached = out.cache, out.sequences[:, -BS:]
        theirs.append(uncached[0])
    assert ours.tolist() == torch.cat(theirs).tolist()


def test_more_steps_per_block_give_transformers_logits_at_every_step():
    """K > 1 steps per block: DiffusionGemma's generation samples and accepts its own way (no setting of it
    reproduces the canvas sampler), so each step of the canvas sampler is replayed through transformers' forward
    (the context, the step's canvas, the previous step's logits as self-conditioning): equal in float64."""
    model = _exact(_sharp())
    calls = []
    decode = model.decode_cached

    def recording(cache, canvas, positions, previous):
        logits = decode(cache, canvas, positions, previous)
        calls.append((int(positions[0, 0]), canvas, previous, logits))
        return logits

    model.decode_cached = recording
    prompt = [2, 10, 11, 12, 13]
    config = SamplerConfig(steps=8, max_new_tokens=2 * BS, block_size=BS, temperature=0.0)
    tokens = block_canvas_sample(
        model, [prompt], vocab_size=V, block_size=BS, pad_token_id=0, config=config,
        generator=torch.Generator().manual_seed(2),
    ).tokens[0]  # fmt: skip
    assert len(calls) == 8
    with torch.no_grad():
        worst = max(
            float(
                (_native(model, input_ids=tokens[None, :p], decoder_input_ids=c, self_conditioning_logits=s) - lo)
                .abs()
                .max()
            )
            for p, c, s, lo in calls
        )
    print(f"[measured] 4 steps per block vs transformers' forward, float64: max |Δ logits| = {worst:.1e}")
    assert worst <= 1e-5


# ------------------------------------------------------------------ checkpoints


def test_a_checkpoint_is_a_transformers_diffusion_gemma_and_rebuilds_in_dllm_flow(tmp_path):
    model = _gemma().eval()
    write_checkpoint(tmp_path / "ckpt", model, None, {"strategy": "block_diffusion"})
    again = model_from_config_dir(tmp_path / "ckpt")
    load_weights_into(again, tmp_path / "ckpt")
    theirs = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "ckpt")
    assert type(again) is DiffusionGemmaCanvas and type(theirs) is DiffusionGemmaForBlockDiffusion
    state = model.state_dict()
    for other in (again, theirs):
        loaded = other.state_dict()
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
        assert other.lm_head.weight is other.model.encoder.language_model.embed_tokens.weight


# ------------------------------------------------------------------ the published and exported folders


@pytest.fixture(scope="module")
def exported(prepared, tiny_spec, tmp_path_factory):
    """block_diffusion (DiffusionGemma, 8-token canvases) trained 6 steps, then exported."""
    from tasks.commands.export import export_checkpoint
    from tasks.train import train

    data, _ = prepared
    spec = _spec(tiny_spec)
    spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": 6, "val_every": 6})})
    work = tmp_path_factory.mktemp("dg-export")
    ref = train(spec, "block_diffusion", data, str(work))
    return ref, export_checkpoint(ref.path, work / "out" / "dg-export", work)


class Killed(RuntimeError):
    pass


def test_a_killed_training_resumes_to_the_uninterrupted_weights(exported, prepared, tiny_spec, tmp_path, monkeypatch):
    """Killed after the step-4 checkpoint, then resumed: the published DiffusionGemma equals the uninterrupted
    run's (the export fixture's) bit for bit, and so do the logged losses."""
    import json

    from runkit import metric_history
    from safetensors.torch import load_file

    import tasks.training.loop as loop_mod
    from tasks.train import model_dir, train

    full, out = exported
    data, _ = prepared
    spec = _spec(tiny_spec)
    spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": 6, "val_every": 6})})
    real_step, seen = loop_mod.run_step, {"train": 0}

    def killed_at_step_5(*args, **kwargs):
        if args[3]:  # is_train
            seen["train"] += 1
            if seen["train"] == 5:
                raise Killed
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop_mod, "run_step", killed_at_step_5)
    with pytest.raises(Killed):
        train(spec, "block_diffusion", data, str(tmp_path))
    work = next((tmp_path / "store" / "train").glob("*.work"))
    assert json.loads((work / "checkpoint" / "dllm.json").read_text())["step"] == 4
    monkeypatch.setattr(loop_mod, "run_step", real_step)
    resumed = train(spec, "block_diffusion", data, str(tmp_path))
    assert not resumed.reused and not work.exists()
    wa, wb = (
        load_file(str(model_dir(full) / "model.safetensors")),
        load_file(str(model_dir(resumed) / "model.safetensors")),
    )
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    losses = [
        metric_history(w, r.mlflow_run_id, "train/loss") for w, r in ((out.parent.parent, full), (tmp_path, resumed))
    ]
    assert losses[0] == losses[1] and [s for s, _ in losses[1]] == list(range(6))


def test_published_and_exported_folders_load_with_transformers_own_class(exported):
    import json

    from transformers import AutoModelForImageTextToText
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    from dllm_common.checkpoint import read_weights
    from tasks.train import model_dir

    ref, out = exported
    stored = read_weights(model_dir(ref))
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == sorted(
        ["README.md", "config.json", "dllm.json", "digests.json", "generation_config.json", "model.safetensors"]
        + [p.name for p in model_dir(ref).iterdir() if p.name.startswith(("tokenizer", "chat_template"))]
    )
    for folder in (model_dir(ref), out):  # the train stage's published model, and the export
        for cls in (DiffusionGemmaForBlockDiffusion, AutoModelForImageTextToText):
            model, info = cls.from_pretrained(folder, output_loading_info=True)
            assert type(model) is DiffusionGemmaForBlockDiffusion, cls
            assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
            state = model.state_dict()
            assert all(torch.equal(state[k], v) for k, v in stored.items())
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DiffusionGemmaForBlockDiffusion"] and config["canvas_length"] == 8
    generation = DiffusionGemmaGenerationConfig.from_pretrained(out)  # refuses any key it does not know
    sampler = json.loads((out / "dllm.json").read_text())["export"]["sampler_settings"]  # no evaluation: defaults
    defaults = SamplerConfig()
    assert sampler["dllm_sampler"] == "canvas" and sampler["dllm_steps"] == defaults.steps
    blocks = -(-defaults.max_new_tokens // min(8, defaults.block_size))  # the model's 8-token canvases
    assert generation.max_new_tokens == defaults.max_new_tokens
    assert generation.max_denoising_steps == defaults.steps // blocks  # the sampler's steps per block


# what the README's snippet runs in: a Python in which dllm-flow's packages cannot be imported
BLOCKED = """
import importlib.abc, runpy, sys

class NoDllmFlow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"strategies", "tasks", "dllm_common", "flows"}:
            raise ImportError(f"{name} is dllm-flow's")

sys.meta_path.insert(0, NoDllmFlow())
try:
    import strategies  # noqa: F401
except ImportError:
    runpy.run_path(sys.argv[1], run_name="__main__")
else:
    raise SystemExit("dllm-flow is importable")
"""


def test_the_model_cards_snippet_samples_dllm_flows_tokens_with_transformers_alone(exported, tmp_path):
    """The README's transformers-only snippet, run as written in a Python that cannot import dllm-flow, prints the
    tokens `dllm-flow generate` writes at temperature 0 with one step per block (docs/strategies.md §9.5)."""
    import os
    import re
    import subprocess
    import sys

    from tasks.commands.generate import Request, generate
    from tasks.evaluation.trained_model import load_for_generation

    _, out = exported
    card = (out / "README.md").read_text()
    snippet = re.search(r"With transformers alone .*?```python\n(.*?)\n```", card, flags=re.DOTALL).group(1)
    assert "import strategies" not in snippet and "dllm" not in re.sub(r'"""(.|\n)*?"""', "", snippet)
    (tmp_path / "snippet.py").write_text(snippet)
    run = subprocess.run(
        [sys.executable, "-c", BLOCKED, str(tmp_path / "snippet.py")],
        cwd=out.parent, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    ids_line, text = run.stdout.strip().splitlines()[-2:]
    theirs = [int(i) for i in re.findall(r"\d+", ids_line)]

    loaded = load_for_generation(out, "cpu")
    block, new = loaded.model.config.canvas_length, int(re.search(r"MAX_NEW_TOKENS = (\d+)", snippet).group(1))
    config = SamplerConfig(steps=-(-new // block), max_new_tokens=new, block_size=block, temperature=0.0)
    ours = generate(loaded, Request("To be, or not to be", "canvas", config, seed=0), "cpu")
    tokenizer = loaded.tokenizer
    print(f"[measured] transformers-only snippet ({len(theirs)} tokens): {text!r}")
    assert theirs and theirs == tokenizer(ours.text, add_special_tokens=False)["input_ids"] and text == ours.text


def test_the_exported_folder_gives_transformers_logits_at_every_step_of_a_longer_schedule(exported):
    """K = 4 steps per block, float64: each step of dllm-flow's sampler on the exported folder replayed through
    transformers' own class loaded from it."""
    from tasks.evaluation.trained_model import load_for_generation

    _, out = exported
    ours = _exact(load_for_generation(out, "cpu").model)
    theirs = _exact(DiffusionGemmaForBlockDiffusion.from_pretrained(out))
    calls = []
    decode = ours.decode_cached
    ours.decode_cached = lambda *a: calls.append((int(a[2][0, 0]), a[1], a[3], decode(*a))) or calls[-1][3]
    config = SamplerConfig(steps=8, max_new_tokens=16, block_size=8, temperature=0.0)
    tokens = block_canvas_sample(
        ours, [[5, 6, 7]], vocab_size=ours.config.text_config.vocab_size, block_size=8, pad_token_id=0,
        config=config, generator=torch.Generator().manual_seed(0),
    ).tokens[0]  # fmt: skip
    with torch.no_grad():
        worst = max(
            float(
                (theirs(input_ids=tokens[None, :p], decoder_input_ids=c, self_conditioning_logits=s).logits - lo)
                .abs()
                .max()
            )
            for p, c, s, lo in calls
        )
    assert len(calls) == 8 and worst <= 1e-5
