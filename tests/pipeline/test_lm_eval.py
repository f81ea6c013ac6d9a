"""lm-evaluation-harness integration (docs/evaluation.md §4.10): the `dllm-flow` harness model scores with
each strategy's own estimator (exact causal NLL for idlm, Monte-Carlo ELBO for mdlm) against hand
computations, generates through the strategy's sampler, runs the local tasks of tests/data/lm_eval
through `simple_evaluate`, and the evaluate stage logs `lm_eval/...` metrics and writes lm_eval.json."""

import importlib.metadata
import json
import random
import statistics
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from conftest import ROOT  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.utils import make_table  # noqa: E402

from dllm_common.config import LMEvalConfig  # noqa: E402
from tasks.evaluation.lm_eval_model import DLLMFlowLM, harness_metrics, pieces, run_tasks  # noqa: E402

TASKS = ROOT / "tests" / "data" / "lm_eval"
CONTEXT = "LEAR: Nothing will come of"


def ll(context, continuation):
    return Instance("loglikelihood", {}, (context, continuation), 0)


def rolling(text):
    return Instance("loglikelihood_rolling", {}, (text,), 0)


def gen(context, **kwargs):
    return Instance("generate_until", {}, (context, kwargs), 0)


@pytest.fixture(scope="module")
def trained(prepared, tiny_spec, tmp_path_factory):
    """A tiny mdlm (scored by its ELBO) and idlm (exact causal path), trained on the prepared rows."""
    from tasks.train import train

    data, _ = prepared
    train_cfg = tiny_spec.train.model_copy(update={"steps": 30, "val_every": 10, "checkpoint_every": 30})
    spec = tiny_spec.model_copy(update={"train": train_cfg})
    workdir = tmp_path_factory.mktemp("lm-eval")
    return spec, data, workdir, {s: train(spec, s, data, str(workdir)) for s in ("mdlm", "idlm")}


@pytest.fixture(scope="module")
def loaded(trained):
    from tasks.evaluation.trained_model import load_for_generation
    from tasks.train import model_dir

    return {s: load_for_generation(model_dir(ref), "cpu") for s, ref in trained[3].items()}


def test_the_model_type_is_registered_and_builds_from_a_checkpoint_argument(trained, loaded):
    from tasks.train import model_dir

    cls = get_model("dllm-flow")
    assert cls is DLLMFlowLM
    args = f"checkpoint={model_dir(trained[3]['mdlm'])},mc_samples=4,seed=7"
    lm = cls.create_from_arg_string(args, {"batch_size": 4, "max_batch_size": None, "device": "cpu"})
    assert lm.strategy.name == "mdlm" and lm.likelihood == "nelbo" and lm.max_length == 32
    assert lm.settings.batch_size == 4 and lm.settings.mc_samples == 4
    same = DLLMFlowLM(loaded=loaded["mdlm"], mc_samples=4, seed=7, batch_size=4)
    requests = [ll(CONTEXT, " nothing"), ll("", "My lord")]
    assert lm.loglikelihood(requests) == same.loglikelihood(requests)
    with pytest.raises(ValueError, match="offers"):
        DLLMFlowLM(loaded=loaded["mdlm"], likelihood="ar_nll")


def _causal_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def test_exact_causal_path_equals_the_models_own_logits(loaded):
    """idlm: log p(continuation | context) = Σ log softmax of the causal logits, is_greedy = argmax at
    every continuation position; the context is left-truncated to the model's 32 positions."""
    m = loaded["idlm"]
    tok, lm = m.tokenizer, DLLMFlowLM(loaded=m, batch_size=2)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids, ctx = enc(CONTEXT + " nothing: speak again."), enc(CONTEXT)
    logp = _causal_logprobs(m.model, ids)
    hand = sum(logp[j - 1, ids[j]].item() for j in range(len(ctx), len(ids)))
    (value, greedy), *_ = lm.loglikelihood([ll(CONTEXT, " nothing: speak again."), ll(CONTEXT, " x")])
    assert value == pytest.approx(hand, abs=1e-4) and value < 0
    assert greedy == all(logp[j - 1].argmax().item() == ids[j] for j in range(len(ctx), len(ids)))

    greedy_ids = list(ctx)  # a continuation the model decodes greedily is reported as greedy
    for _ in range(3):
        greedy_ids.append(int(_causal_logprobs(m.model, greedy_ids)[-1].argmax()))
    text = tok.decode(greedy_ids[len(ctx) :])
    assert enc(CONTEXT + text)[len(ctx) :] == greedy_ids[len(ctx) :]  # the text round-trips to those ids
    assert lm.loglikelihood([ll(CONTEXT, text)])[0][1] is True

    long_context = " ".join([CONTEXT] * 6)  # > 32 tokens: only the last 32 − len(continuation) are kept
    ids, cont = enc(long_context + " nothing"), enc(long_context + " nothing")[len(enc(long_context)) :]
    window = ids[-32:]
    logp = _causal_logprobs(m.model, window)
    hand = sum(logp[j - 1, window[j]].item() for j in range(32 - len(cont), 32))
    assert len(ids) > 32 and lm.loglikelihood([ll(long_context, " nothing")])[0][0] == pytest.approx(hand, abs=1e-4)

    short = "FOOL: The more pity."  # rolling: the whole text after the EOS token
    ids = [tok.eos_token_id, *enc(short)]
    logp = _causal_logprobs(m.model, ids)
    hand = sum(logp[j - 1, ids[j]].item() for j in range(1, len(ids)))
    assert lm.loglikelihood_rolling([rolling(short)])[0] == pytest.approx(hand, abs=1e-4)
    long_text = " ".join([short] * 8)  # longer than the model: scored in pieces, as an empty-context request
    assert lm.loglikelihood_rolling([rolling(long_text)])[0] == pytest.approx(
        lm.loglikelihood([ll("", long_text)])[0][0]
    )


def test_a_dflash_draft_scores_and_generates_with_its_frozen_target(prepared):
    """A DFlash draft has no likelihood of its own: its target's exact NLL, and speculative decoding,
    which is the target's greedy text (an untrained draft only changes how many target forwards it takes)."""
    from strategies.dflash.blocks import build_target_layer_ids
    from strategies.dflash.decoding import greedy_generate
    from strategies.dflash.draft import DFlashDraftConfig, DFlashDraftModel
    from strategies.models import build_model, tiny_model_config
    from strategies.sampling import trim_at_eos
    from tasks.evaluation.lm_eval_model import Checkpoint
    from tasks.prepare_data import load_tokenizer
    from tasks.speculative.setup import draft_strategy

    tok = load_tokenizer(str(Path(prepared[0].path) / "tokenizer"))
    target = build_model(tiny_model_config("llama", len(tok), 32, 32, 2, 2, None, None, False), seed=0)
    target = target.eval().requires_grad_(False)
    layers = build_target_layer_ids(2, 1)
    cfg = DFlashDraftConfig(32, 1, 2, 4, layers, tok.mask_token_id)
    torch.manual_seed(0)
    draft = DFlashDraftModel(cfg).eval()
    built = draft_strategy("dflash", {}, draft, target, mask_token_id=tok.mask_token_id)
    lm = DLLMFlowLM(loaded=Checkpoint(draft, tok, built.strategy, built.mask_token_id, {"seq_len": 32}))
    assert lm.likelihood == "ar_nll"
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids, ctx = enc(CONTEXT + " nothing"), enc(CONTEXT)
    logp = _causal_logprobs(target, ids)
    hand = sum(logp[j - 1, ids[j]].item() for j in range(len(ctx), len(ids)))
    assert lm.loglikelihood([ll(CONTEXT, " nothing")])[0][0] == pytest.approx(hand, abs=1e-4)
    greedy = tok.decode(trim_at_eos(torch.tensor(greedy_generate(target, ctx, 6, tok.eos_token_id)), tok.eos_token_id))
    assert lm.generate_until([gen(CONTEXT, until=[], max_gen_toks=6)]) == [greedy]


def test_pieces_cover_the_continuation_once_within_the_model_length():
    context, continuation = list(range(100, 140)), list(range(70))
    parts = pieces(context, continuation, 32)
    assert [t for _, p in parts for t in p] == continuation
    assert all(len(b) + len(p) <= 32 and len(b) >= 1 for b, p in parts)
    assert parts[0] == (context[-1:], continuation[:31]) and parts[-1][0] == (context + continuation)[-32:-8]
    assert pieces([5, 6], [7], 32) == [([5, 6], [7])]


def test_monte_carlo_elbo_is_seeded_unbiased_and_sharpens_with_samples(loaded):
    m = loaded["mdlm"]
    lm = DLLMFlowLM(loaded=m, mc_samples=8, seed=3)
    requests = [ll(CONTEXT, " nothing: speak again."), ll(CONTEXT, " nothing")]
    first = lm.loglikelihood(requests)
    assert all(v < 0 and v == v and v != float("-inf") for v, _ in first)
    assert lm.loglikelihood(requests[::-1]) == first[::-1]  # a request's noise is its own, not its batch's
    assert DLLMFlowLM(loaded=m, mc_samples=8, seed=4).loglikelihood(requests) != first

    # one continuation token: the ELBO is unbiased for log p(token | context) = one pass with it masked
    tok, hamlet = m.tokenizer, "HAMLET: To be, or not to"
    ctx = tok(hamlet, add_special_tokens=False)["input_ids"]
    target = tok(hamlet + " be", add_special_tokens=False)["input_ids"][len(ctx) :]
    assert len(target) == 1
    with torch.no_grad():
        logits = m.strategy.denoiser(m.model)(torch.tensor([ctx + [m.mask_id]]), None)
    exact = torch.log_softmax(logits[0, -1].float(), -1)[target[0]].item()
    one = [ll(hamlet, " be")]
    draws = [DLLMFlowLM(loaded=m, mc_samples=32, seed=s, batch_size=32).loglikelihood(one)[0][0] for s in range(32)]
    assert statistics.mean(draws) == pytest.approx(exact, rel=0.15)

    def spread(k):
        return statistics.stdev(
            DLLMFlowLM(loaded=m, mc_samples=k, seed=s, batch_size=32).loglikelihood(requests[:1])[0][0]
            for s in range(12)
        )

    assert spread(32) < spread(2)

    # the trained model's bound prefers Shakespeare's words to random letters of the same length
    rnd = random.Random(0)
    lines = [("HAMLET: To be, or not to", " be, that is the question"), (CONTEXT, " nothing: speak again.")]
    lines += [("MACBETH: Is this a dagger which I see", " before me, the handle toward my hand?")]
    noise = [(c, " " + "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in x[1:])) for c, x in lines]
    real, shuffled = (sum(v for v, _ in lm.loglikelihood([ll(*p) for p in ps])) for ps in (lines, noise))
    assert real > shuffled


def test_generate_until_runs_the_strategys_sampler_and_stops_at_until(loaded):
    """Greedy generation equals `dllm-flow generate` with the same sampler settings (one token per step),
    then is cut at the first `until` string; a prompt longer than the model is left-truncated."""
    from strategies.sampling import SamplerConfig
    from tasks.commands.generate import Request, check_sampler, generate

    for name, m in loaded.items():
        lm = DLLMFlowLM(loaded=m, block_size=4)
        text = lm.generate_until([gen(CONTEXT, until=[], max_gen_toks=8)])[0]
        config = SamplerConfig(steps=8, max_new_tokens=8, block_size=4)
        assert text == generate(m, Request(CONTEXT, check_sampler(name, "auto", False), config), "cpu").text
        stop = text.strip()[:2] or "e"
        cut = lm.generate_until([gen(CONTEXT, until=[stop], max_gen_toks=8, do_sample=False)])[0]
        assert cut == text.split(stop)[0] and stop not in cut
        assert isinstance(lm.generate_until([gen(" ".join([CONTEXT] * 8), until=["\n"], max_gen_toks=8)])[0], str)


def test_local_tasks_through_simple_evaluate(loaded):
    """The shipped multiple-choice, generation and rolling-perplexity tasks, offline, for both estimators."""
    settings = LMEvalConfig(
        tasks=("shakespeare_mc", "shakespeare_gen", "shakespeare_ppl"), include_path=str(TASKS), mc_samples=8
    )
    for name, m in loaded.items():
        results = run_tasks(DLLMFlowLM(loaded=m, mc_samples=8), settings, seed=0)
        print(f"\nlm-eval local tasks, tiny {name} ({DLLMFlowLM(loaded=m).likelihood}):\n{make_table(results)}")
        r = results["results"]
        assert results["n-samples"]["shakespeare_mc"]["effective"] == 8
        assert 0 <= r["shakespeare_mc"]["acc,none"] <= 1 and 0 <= r["shakespeare_mc"]["acc_norm,none"] <= 1
        assert 0 <= r["shakespeare_gen"]["exact_match,first_word"] <= 1
        assert r["shakespeare_ppl"]["word_perplexity,none"] > 1 and r["shakespeare_ppl"]["bits_per_byte,none"] > 0
        metrics = harness_metrics(results)
        assert metrics["lm_eval/shakespeare_mc/acc"] == r["shakespeare_mc"]["acc,none"]
        assert "lm_eval/shakespeare_gen/exact_match/first_word" in metrics


def test_harness_metric_names_are_mlflow_names_with_numbers_only():
    results = {
        "results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": "N/A", "exact_match,strict-match": 1}},
        "groups": {"g": {"acc,none": 0.25, "flag,none": True}},
    }
    assert harness_metrics(results) == {
        "lm_eval/t/acc": 0.5,
        "lm_eval/t/exact_match/strict-match": 1.0,
        "lm_eval/g/acc": 0.25,
    }


def _with_lm_eval(spec, **settings):
    harness = LMEvalConfig(**{"tasks": ("shakespeare_mc", "shakespeare_gen"), "include_path": str(TASKS), **settings})
    return spec.model_copy(update={"eval": spec.eval.model_copy(update={"lm_eval": harness})})


def test_evaluate_stage_runs_the_tasks_and_logs_them(trained):
    from mlflow.tracking import MlflowClient

    from dllm_common.tracking import default_tracking_uri
    from tasks.evaluate import evaluate, stage_of

    spec, data, workdir, refs = trained
    ref = refs["mdlm"]
    harness = _with_lm_eval(spec, mc_samples=4, limit=4)
    keys = {stage_of(s, "mdlm", ref, data, str(workdir))[1] for s in (spec, harness, _with_lm_eval(spec, limit=4))}
    assert len(keys) == 3  # the key follows eval.lm_eval

    plain = evaluate(spec, "mdlm", ref, data, str(workdir))
    done = evaluate(harness, "mdlm", ref, data, str(workdir))
    metrics = done.info["metrics"]
    assert (
        0 <= metrics["lm_eval/shakespeare_mc/acc"] <= 1 and "lm_eval/shakespeare_gen/exact_match/first_word" in metrics
    )
    # everything else is what the evaluation without harness tasks reports (wall-clock rates aside)
    rest = {k: v for k, v in metrics.items() if not k.startswith("lm_eval/") and "per_s" not in k}
    assert rest == {k: v for k, v in plain.info["metrics"].items() if "per_s" not in k}
    saved = json.loads((Path(done.path) / "lm_eval.json").read_text())
    assert saved["results"]["shakespeare_mc"]["acc,none"] == metrics["lm_eval/shakespeare_mc/acc"]
    card = json.loads((Path(done.path) / "repro_card.json").read_text())
    assert card["lm_eval"]["mc_samples"] == 4 and card["lm_eval"]["lm_eval"] == importlib.metadata.version("lm_eval")
    assert "lm_eval" not in json.loads((Path(plain.path) / "repro_card.json").read_text())
    logged = MlflowClient(default_tracking_uri(workdir)).get_run(ref.mlflow_run_id).data.metrics
    assert logged["lm_eval/shakespeare_mc/acc"] == metrics["lm_eval/shakespeare_mc/acc"]
    artifacts = MlflowClient(default_tracking_uri(workdir)).list_artifacts(ref.mlflow_run_id, f"eval/{done.key[:12]}")
    assert "lm_eval.json" in {Path(a.path).name for a in artifacts}


def test_without_the_extra_the_stage_says_how_to_install_it(trained, monkeypatch):
    import tasks.evaluate as evaluate_mod

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    spec, data, workdir, refs = trained
    monkeypatch.setattr(evaluate_mod.importlib.metadata, "version", missing)
    with pytest.raises(ImportError, match=r"pip install 'dllm-flow\[lmeval\]'"):
        evaluate_mod.stage_of(_with_lm_eval(spec), "mdlm", refs["mdlm"], data, str(workdir))
