"""Sliding-window DFlash drafts and the draft's own attention shape (docs/strategies.md §10.12): the windowed mask
against an element-wise reference; z-lab's `dflash` package (0.1.0, installed `--no-deps`) as the oracle, loading the
exported folder with its own `DFlashDraftModel` and giving the same block logits (≤ 1e-5, fp32) on contexts longer
than the window and, through its `dflash_generate`, the same greedy tokens and acceptance lengths (bar the last cycle,
counted differently: docs/strategies.md §10.11); an attention shape with head_dim ≠ hidden ÷ heads training a step
and round-tripping export → import; a published-layout sliding draft importing, decoding and training on; and the
refusals, each naming its key."""

import json
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from dflashkit import greedy_rows, train_draft
from safetensors.torch import save_file
from torch.nn.attention.flex_attention import create_mask

from strategies import Microbatch, SetupContext, StepContext
from strategies.dflash.blocks import build_dflash_mask_mod, create_dflash_sdpa_mask, dflash_visibility
from strategies.dflash.config import parse_draft_config, read_draft_config
from strategies.dflash.decoding import greedy_generate, sample_continuations, speculative_generate
from strategies.dflash.draft import (
    DFlashDraftConfig,
    DFlashDraftModel,
    draft_block_hidden,
    draft_block_logits,
    target_features,
)
from strategies.dflash.serving_layout import write_serving_layout
from strategies.dflash.strategy import DFlashStrategy
from strategies.dflash.window import draft_masks, trim_context
from strategies.dflash.window_config import attention_shape_fields
from strategies.models import build_model, tiny_model_config
from strategies.options import DFlashOptions, validate_config
from tasks.speculative.export import draft_rows
from tasks.speculative.setup import draft_strategy, import_draft

MASK, V, BS, W = 63, 64, 4, 6
SLIDE, FULL = "sliding_attention", "full_attention"
PROMPTS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 9, 9, 4, 2, 7, 3, 1], [7, 7, 2])


@pytest.fixture(scope="module")
def target():
    model = build_model(tiny_model_config("llama", V, 128, 32, 5, 4, None, None, False), seed=0)
    return model.eval().requires_grad_(False)


def _cfg(**kw) -> DFlashDraftConfig:
    """A 2-layer draft: 6 query heads of width 12 over 2 key/value heads (head_dim ≠ 32 ÷ 6), every layer sliding."""
    base = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "block_size": BS,
        "target_layer_ids": [1, 2],
        "mask_token_id": MASK,
        "num_target_layers": 5,
        "vocab_size": V,
        "sliding_window": W,
    }
    return DFlashDraftConfig(**{**base, **kw})


def _random(cfg, seed=1) -> DFlashDraftModel:
    torch.manual_seed(seed)
    draft = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.3)
    return draft


# ---------------------------------------------------------------------------------------- the mask


def _reference(anchors, keep, ctx_len, bs, window, docs=None):
    """Element by element: query (b, o) sees context k < A_b (same document, A_b + o − k < window) and its block."""
    bsz, n = anchors.shape
    out = torch.zeros(bsz, n * bs, ctx_len + n * bs, dtype=torch.bool)
    for r in range(bsz):
        for b in range(n):
            a = int(anchors[r, b])
            for o in range(bs):
                q = b * bs + o
                for k in range(ctx_len):
                    same = docs is None or int(docs[r, k]) == int(docs[r, a])
                    near = window is None or a + o - k < window
                    out[r, q, k] = bool(keep[r, b]) and k < a and same and near
                for j in range(bs):
                    out[r, q, ctx_len + b * bs + j] = True
    return out


@pytest.mark.parametrize("window", [None, 4, 7])
@pytest.mark.parametrize("with_docs", [False, True])
def test_the_windowed_mask_is_the_elementwise_reference(window, with_docs):
    g = torch.Generator().manual_seed(3)
    ctx_len, n = 22, 3
    anchors = torch.randint(1, ctx_len - BS, (2, n), generator=g)
    keep = torch.tensor([[True, True, False], [True, False, True]])
    docs = torch.tensor([[0] * 9 + [1] * 13, [0] * 15 + [1] * 7]) if with_docs else None
    ref = _reference(anchors, keep, ctx_len, BS, window, docs)
    assert torch.equal(dflash_visibility(anchors, keep, ctx_len, BS, document_ids=docs, sliding_window=window), ref)
    dense = create_dflash_sdpa_mask(anchors, keep, ctx_len, BS, document_ids=docs, sliding_window=window)
    assert torch.equal(dense[:, 0] == 0, ref)
    mod = build_dflash_mask_mod(anchors, keep, ctx_len, BS, document_ids=docs, sliding_window=window)
    flex = create_mask(mod, 2, None, n * BS, ctx_len + n * BS, device="cpu")
    assert torch.equal(flex[:, 0], ref)
    if window is not None:  # the window really hides something here
        assert not torch.equal(ref, _reference(anchors, keep, ctx_len, BS, None, docs))


def test_each_layer_type_gets_its_own_mask():
    anchors, keep = torch.tensor([[12, 3]]), torch.ones(1, 2, dtype=torch.bool)
    full = create_dflash_sdpa_mask(anchors, keep, 16, BS)
    windowed = create_dflash_sdpa_mask(anchors, keep, 16, BS, sliding_window=W)
    mixed = draft_masks(_cfg(layer_types=[SLIDE, FULL]), anchors, keep, 16, BS, torch.float32)
    assert torch.equal(mixed[SLIDE], windowed) and torch.equal(mixed[FULL], full)
    assert torch.equal(draft_masks(_cfg(), anchors, keep, 16, BS, torch.float32), windowed)
    plain = _cfg(sliding_window=None)
    assert plain.layer_types == [FULL, FULL] and torch.equal(
        draft_masks(plain, anchors, keep, 16, BS, torch.float32), full
    )


def test_blocks_of_a_row_under_the_training_mask_draft_as_each_block_alone_from_the_trimmed_context(target):
    """The training mask over a row longer than the window gives each block what the decoder gives it from the
    context it keeps (the features from anchor − window + 1 on, at their own positions); float64."""
    draft = _random(_cfg()).double()
    row = torch.randint(0, 60, (1, 30), generator=torch.Generator().manual_seed(2))
    feats = target_features(target, row, [1, 2])[0].double()
    anchors = torch.tensor([[3, 11, 20, 25]])
    blocks = torch.full((1, 4 * BS), MASK)
    blocks[0, ::BS] = row[0, anchors[0]]
    emb = target.get_input_embeddings()
    together = draft_block_hidden(draft, BS, emb, feats, anchors, torch.ones(1, 4, dtype=torch.bool), blocks)
    for i, a in enumerate(anchors[0].tolist()):
        ctx, start = trim_context(draft.config, feats[:, :a], 0, a)
        assert start == max(0, a - W + 1) and ctx.shape[1] == a - start
        block = blocks[:, i * BS : (i + 1) * BS]
        alone = draft_block_hidden(
            draft, BS, emb, ctx, torch.tensor([[a - start]]), torch.ones(1, 1, dtype=torch.bool), block, offset=start
        )
        torch.testing.assert_close(alone[0], together[0, i * BS : (i + 1) * BS], rtol=0, atol=1e-12)


@pytest.mark.parametrize("layers", [[SLIDE, SLIDE], [SLIDE, FULL]], ids=["all-sliding", "mixed"])
def test_the_flex_block_mask_drafts_like_the_dense_mask(target, layers):
    """The windowed flex BlockMask (forward only: flex attention has no CPU backward in torch 2.13) gives the dense
    mask's hidden states, blocks of two rows anchored inside and past the window."""
    draft = _random(_cfg(layer_types=layers))
    row = torch.randint(0, 60, (2, 40), generator=torch.Generator().manual_seed(2))
    feats = target_features(target, row, [1, 2])[0]
    anchors, keep = torch.tensor([[3, 11, 20, 25], [30, 2, 14, 35]]), torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]]).bool()
    blocks, emb = torch.full((2, 4 * BS), MASK), target.get_input_embeddings()
    with torch.no_grad():
        dense = draft_block_hidden(draft, BS, emb, feats, anchors, keep, blocks)
        flex = draft_block_hidden(draft, BS, emb, feats, anchors, keep, blocks, backend="flex_attention")
    torch.testing.assert_close(flex, dense, rtol=0, atol=2e-5)


# ---------------------------------------------------------------------------------------- z-lab's package, the oracle

try:
    import dflash.model as zlab
except ImportError:  # the mask, shape, layout and refusal tests run without it
    zlab = None
NEEDS_ZLAB = pytest.mark.skipif(zlab is None, reason="z-lab's dflash package (make install: NODEPS) is not installed")


def _zlab(draft, folder):
    """The exported folder loaded by z-lab's own class; no weight left out."""
    folder.mkdir(parents=True, exist_ok=True)
    write_serving_layout(folder, draft.config, draft.state_dict(), "zlab", {})
    cls = zlab.DFlash2DraftModel if draft.config.variant == "dflash2" else zlab.DFlashDraftModel
    model, info = cls.from_pretrained(folder, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model.eval()


def _max_block_logit_difference(target, draft, theirs, row) -> float:
    """Largest |Δ logit| over the blocks anchored at every position of `row` (contexts up to its length − 1)."""
    worst = 0.0
    with torch.no_grad():
        for end in range(2, row.shape[1] + 1):
            feats, _, _ = target_features(target, row[:, : end - 1], draft.config.target_layer_ids)
            block = torch.tensor([[int(row[0, end - 1])] + [MASK] * (BS - 1)])
            ours = draft_block_logits(draft, target, feats, torch.tensor([[end - 1]]), torch.ones(1, 1).bool(), block)
            hidden = theirs(
                position_ids=torch.arange(end - 1 + BS)[None],
                noise_embedding=target.get_input_embeddings()(block),
                target_hidden=feats,
            )
            worst = max(worst, float((ours - theirs.compute_logits(hidden, target.lm_head)).abs().max()))
    return worst


DFLASH2 = {"variant": "dflash2", "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4}


@NEEDS_ZLAB
@pytest.mark.parametrize(
    "layers, variant",
    [([SLIDE, SLIDE], {}), ([SLIDE, FULL], {}), ([FULL, SLIDE], DFLASH2)],
    ids=["all-sliding", "mixed", "dflash2-mixed"],
)
def test_z_lab_gives_the_same_block_logits_on_a_context_longer_than_the_window(target, layers, variant, tmp_path):
    draft = _random(_cfg(layer_types=layers, **variant))
    theirs = _zlab(draft, tmp_path / "zlab")
    assert [(layer.self_attn.is_causal, layer.self_attn.sliding_window) for layer in theirs.layers] == [
        (False, W if t == SLIDE else None) for t in layers
    ]
    row = torch.randint(0, 60, (1, 2 * W + 3), generator=torch.Generator().manual_seed(4))
    found = _max_block_logit_difference(target, draft, theirs, row)
    what = f"{variant.get('variant', 'dflash')} {'+'.join(layers)}, window {W}, contexts up to {row.shape[1] - 1}"
    print(f"\nmax |Δ logit| vs z-lab ({what}): {found:.2e}")
    assert found <= 1e-5
    unwindowed = DFlashDraftModel(replace(draft.config, layer_types=[FULL, FULL], sliding_window=None)).eval()
    unwindowed.load_state_dict(draft.state_dict())
    apart = _max_block_logit_difference(target, unwindowed, theirs, row)
    print(f"the same weights without the window: {apart:.2e}")
    assert apart > 1e-2  # the comparison sees the window


def _trained(target, cfg, steps=60) -> DFlashDraftModel:
    """A sliding-window draft trained a little (under the windowed training masks) on the target's greedy text."""
    torch.manual_seed(0)
    draft = DFlashDraftModel(cfg)
    options = {"block_size": BS, "num_blocks_per_sample": 4, "draft_sliding_window": cfg.sliding_window}
    built = draft_strategy("dflash", options, draft, target, mask_token_id=MASK)
    return train_draft(built, draft, greedy_rows(target), steps)


@NEEDS_ZLAB
def test_z_lab_decodes_the_same_greedy_tokens_and_acceptance_past_the_window(target, tmp_path, monkeypatch):
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # its timing synchronizes CUDA; none here
    draft = _trained(target, _cfg())
    theirs = _zlab(draft, tmp_path / "zlab")
    row = sample_continuations(target, torch.tensor([[3, 1, 4]]), 16, temperature=0.0)
    found = _max_block_logit_difference(target, draft, theirs, row)
    print(f"\ntrained sliding draft: max |Δ logit| vs z-lab on contexts up to {row.shape[1] - 1}: {found:.2e}")
    assert found <= 1e-5
    seen, plain = [], draft_block_logits
    monkeypatch.setattr(
        "strategies.dflash.decoding.draft_block_logits", lambda *a, **kw: seen.append(a[2].shape[1]) or plain(*a, **kw)
    )
    accepted = 0
    for prompt in PROMPTS:
        ours = speculative_generate(target, draft, prompt, 24)
        stats = zlab.dflash_generate(theirs, target, torch.tensor([prompt]), 24, None, return_stats=True)
        assert ours.tokens == stats.output_ids[0, len(prompt) :].tolist() == greedy_generate(target, prompt, 24)
        assert ours.acceptance[:-1] == stats.acceptance_lengths[:-1]
        print(f"\nprompt {prompt}: acceptance ours {ours.acceptance}, z-lab {stats.acceptance_lengths}")
        accepted += sum(ours.acceptance[:-1]) - len(ours.acceptance[:-1])
    assert accepted > 0  # proposals stood: the comparison saw the draft's tokens, not just the target's
    assert max(seen) == W - 1  # the decoder kept only the context its sliding layers can read


# ---------------------------------------------------------------------------------------- shape, layout, import


def test_an_attention_shape_unlike_the_targets_trains_a_step_and_round_trips(target, tmp_path):
    options = DFlashOptions(
        block_size=BS,
        draft_sliding_window=W,
        draft_num_attention_heads=6,
        draft_num_key_value_heads=2,
        draft_head_dim=8,
    )
    model = SimpleNamespace(num_heads=4, num_kv_heads=None, num_layers=2, hidden_size=32, model_fields_set=set())
    fields = attention_shape_fields(options, model)
    cfg = _cfg(**fields)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (6, 2, 8) and 6 * 8 != 32
    draft = _trained(target, cfg, steps=1)
    assert draft.layers[0].self_attn.q_proj.weight.shape == (48, 32)
    (tmp_path / "out").mkdir()
    write_serving_layout(tmp_path / "out", cfg, draft.state_dict(), "zlab", {})
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    print("\nexported config.json (excerpt):", json.dumps({k: raw[k] for k in sorted(raw) if k in EXCERPT}, indent=1))
    assert {k: raw[k] for k in EXCERPT} == {
        "head_dim": 8,
        "is_causal": False,
        "layer_types": [SLIDE, SLIDE],
        "max_window_layers": 0,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "sliding_window": W,
        "use_sliding_window": True,
    }
    rows = dict(draft_rows(raw, 1, "float32"))  # the model card says what the layers read
    assert rows["layer_types (sliding_window: positions a sliding layer reads back)"] == f"{[SLIDE, SLIDE]} ({W})"
    loaded = DFlashDraftModel.load(tmp_path / "out")
    assert loaded.config == cfg
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in draft.state_dict().items())
    as_speculators = cfg.to_speculators("org/t", ["LlamaForCausalLM"])
    assert as_speculators["sliding_window_non_causal"] is True
    assert parse_draft_config(json.loads(json.dumps(as_speculators)), "s").config == replace(
        cfg, num_target_layers=None
    )


EXCERPT = (
    "head_dim",
    "is_causal",
    "layer_types",
    "max_window_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "sliding_window",
    "use_sliding_window",
)


def _published(folder, target, layers=5):
    """A sliding draft as NeMo Automodel's recipe writes it: every layer sliding, max_window_layers = the layer
    count, is_causal false, block_size and mask token inside dflash_config only; random weights."""
    cfg = _cfg(num_hidden_layers=layers, target_layer_ids=[0, 1, 1, 2, 3][:layers], layer_types=[SLIDE] * layers)
    draft = _random(cfg, seed=7)
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": layers,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12, "intermediate_size": 96,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": V, "num_target_layers": 5,
        "layer_types": [SLIDE] * layers, "sliding_window": W, "use_sliding_window": True,
        "max_window_layers": layers, "is_causal": False, "tie_word_embeddings": False,
        "dflash_config": {"block_size": BS, "mask_token_id": MASK, "target_layer_ids": cfg.target_layer_ids},
    }  # fmt: skip
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(folder / "model.safetensors"))
    return draft


@NEEDS_ZLAB
def test_a_published_layout_sliding_draft_imports_decodes_and_trains_on(target, tiny_spec, tmp_path):
    original = _published(tmp_path / "published", target)
    raw = tiny_spec.model_dump(mode="json")
    raw["pipeline"]["strategies"] = ["dflash"]
    raw["model"].update(kind="pretrained", path=str(tmp_path / "published"), hidden_size=32)
    raw["dflash"] = {"block_size": 0, "num_blocks_per_sample": 2, "target_features": "online"}
    spec = validate_config(raw)
    options = DFlashOptions(block_size=0, num_blocks_per_sample=2)
    draft = import_draft(spec, options, target)
    assert draft.config.layer_types == [SLIDE] * 5 and draft.config.sliding_window == W
    assert draft.config.block_size == BS and draft.config.head_dim == 12
    assert all(torch.equal(draft.state_dict()[k], v) for k, v in original.state_dict().items())
    prompt = list(range(1, 12))  # longer than the window
    assert speculative_generate(target, draft.eval(), prompt, 16).tokens == greedy_generate(target, prompt, 16)
    theirs = zlab.DFlashDraftModel.from_pretrained(tmp_path / "published", dtype=torch.float32).eval()
    row = torch.randint(0, 60, (1, 2 * W), generator=torch.Generator().manual_seed(5))
    assert _max_block_logit_difference(target, draft, theirs, row) <= 1e-5  # read as z-lab reads the published keys
    options = DFlashStrategy.complete_options(
        DFlashOptions(num_blocks_per_sample=2), draft
    )  # block size 0: the draft's
    built = draft_strategy("dflash", options, draft.train(), target, mask_token_id=MASK)
    rows = sample_continuations(target, torch.randint(0, 60, (4, 4), generator=torch.Generator().manual_seed(0)), 20, 0)
    mb = Microbatch(rows, torch.ones_like(rows, dtype=torch.float32), torch.ones_like(rows), torch.arange(len(rows)))
    ctx = StepContext(model=draft, loss_fn=built.loss_fn, mask_token_id=MASK, step=0, base_seed=0)
    (batch,), n, _ = built.strategy.pre_step(ctx, [mb])
    out = built.strategy.forward_backward(ctx, batch, num_diffusion_tokens=n, num_ar_tokens=n, is_train=True)
    assert torch.isfinite(out.total_loss) and all(p.grad is not None for p in draft.parameters())
    torch.optim.SGD(draft.parameters(), lr=0.1).step()
    assert not torch.equal(draft.state_dict()["fc.weight"], original.state_dict()["fc.weight"])
    write_serving_layout(tmp_path / "published", draft.config, draft.state_dict(), "zlab", {})  # exported again
    written = read_draft_config(tmp_path / "published").config
    assert (
        written == draft.config
        and json.loads((tmp_path / "published" / "config.json").read_text())["is_causal"] is False
    )


# ---------------------------------------------------------------------------------------- refusals


def test_a_window_smaller_than_the_block_or_an_odd_head_is_refused_by_name():
    with pytest.raises(ValueError, match=r"draft_sliding_window \(3\) is smaller than dflash.block_size \(4\)"):
        DFlashOptions(block_size=4, draft_sliding_window=3)
    with pytest.raises(ValueError, match=r"draft_head_dim \(7\) must be even"):
        DFlashOptions(draft_head_dim=7)
    with pytest.raises(ValueError, match=r"sliding_window \(3\) is smaller than block_size \(4\)"):
        _cfg(sliding_window=3)
    with pytest.raises(ValueError, match=r"sliding_window \(6\) is set but no layer is 'sliding_attention'"):
        _cfg(layer_types=[FULL, FULL])
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention'\]"):
        _cfg(layer_types=[SLIDE, "linear_attention"])


def _spec(tiny_spec, model=None, **dflash):
    raw = tiny_spec.model_dump(mode="json")
    raw["pipeline"]["strategies"] = ["dflash"]
    raw["model"] = {"hidden_size": 32, "num_layers": 1, **(model or {})}
    raw["dflash"] = {"block_size": 4, **dflash}
    return validate_config(raw)


def test_draft_attention_options_that_disagree_are_refused_at_load(tiny_spec):
    from dllm_common.config import ConfigError

    assert _spec(tiny_spec, draft_num_attention_heads=6, draft_head_dim=8, draft_sliding_window=8)
    assert _spec(tiny_spec, {"num_heads": 2}, draft_num_attention_heads=4)  # the option takes model.num_heads' place
    for model, dflash, message in (
        ({}, {"draft_num_attention_heads": 6}, r"draft_num_attention_heads \(6\) does not split the hidden size 32"),
        ({}, {"draft_num_attention_heads": 4, "draft_num_key_value_heads": 3}, "key/value heads must divide"),
    ):
        with pytest.raises(ConfigError, match=message):
            _spec(tiny_spec, model, **dflash)


def test_a_new_draft_takes_its_window_and_attention_shape_from_the_dflash_options(tiny_spec, target):
    """Through the train stage's construction (`new_draft` with `new_draft_fields`): the options, not `model:`."""
    from strategies.options import resolve_options
    from tasks.common import StageRef
    from tasks.speculative.setup import new_draft, new_draft_fields

    attention = {"draft_num_attention_heads": 6, "draft_num_key_value_heads": 3, "draft_head_dim": 8}
    spec = _spec(tiny_spec, {"num_layers": 2}, draft_sliding_window=8, target_layer_ids=[1, 2], **attention)
    options = resolve_options(spec, "dflash")
    ref = StageRef("target", "k", "", info={"num_layers": 5})
    cfg = new_draft(spec, target, ref, BS, MASK, False, new_draft_fields(spec, options)).config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (6, 3, 8)
    assert (cfg.layer_types, cfg.sliding_window) == ([SLIDE, SLIDE], 8)
    plain = new_draft(spec, target, ref, BS, MASK).config  # without the options: `model:` and full attention
    assert (plain.num_attention_heads, plain.head_dim, plain.layer_types) == (4, 8, [FULL, FULL])


def test_an_imported_draft_must_have_the_attention_the_options_ask(target, tmp_path):
    draft = _random(_cfg())
    for options, message in (
        ({"draft_sliding_window": 8}, "draft_sliding_window is 8 but the draft has 6"),
        ({"draft_head_dim": 8}, "draft_head_dim is 8 but the draft has 12"),
    ):
        with pytest.raises(ValueError, match=message):  # assembling runs the strategy's setup checks
            draft_strategy("dflash", {"block_size": BS, **options}, draft, target, mask_token_id=MASK)
    built = draft_strategy("dflash", {"block_size": BS, "draft_sliding_window": W}, draft, target, mask_token_id=MASK)
    assert built.strategy.setup_extra(SetupContext(draft, None, MASK)) == MASK


def test_published_configs_a_bidirectional_draft_cannot_honour_are_refused_by_name():
    raw = json.loads(json.dumps(_cfg().to_zlab()))
    assert parse_draft_config(raw, "x").config == _cfg()
    derived = {k: v for k, v in raw.items() if k != "layer_types"}  # Qwen3Config's rule: sliding from max_window_layers
    assert parse_draft_config({**derived, "max_window_layers": 1}, "x").config.layer_types == [FULL, SLIDE]
    unused = {**raw, "layer_types": [FULL, FULL], "use_sliding_window": False, "sliding_window": 4096}
    assert parse_draft_config(unused, "x").config.sliding_window is None  # a window no layer uses is dropped
    assert parse_draft_config({**raw, "is_causal": True}, "x").config.variant == "jetspec"  # causal in the block
    for change, message in (
        ({"is_causal": None}, "no is_causal"),
        ({"use_sliding_window": False}, "use_sliding_window is not true"),
        ({"sliding_window": None}, "need sliding_window"),
        ({"layer_types": [SLIDE, "chunked_attention"]}, r"layer_types \['chunked_attention'\]"),
    ):
        bad = {k: v for k, v in {**raw, **change}.items() if v is not None}
        with pytest.raises(ValueError, match=message):
            parse_draft_config(bad, "x")
    speculators = _cfg().to_speculators("org/t", [])
    with pytest.raises(ValueError, match="sliding_window_non_causal"):
        parse_draft_config({**speculators, "sliding_window_non_causal": False}, "s")
