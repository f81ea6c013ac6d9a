"""Sample-quality metrics, reproducibility cards and the report renderer, against hand-computed values."""

import json
import math
from pathlib import Path

import pytest
import torch

from tasks.evaluation.scoring import generative_perplexity, mean_entropy, unigram_entropy
from tasks.report import card_mismatches, render_markdown, render_plots


class CharTokenizer:
    """One token per character (ids = byte values), optional BOS."""

    def __init__(self, bos=None):
        self.bos_token_id = bos

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode())}


class TableScorer(torch.nn.Module):
    """Next-token distribution depends only on the current token: p(next = 'a') = 1/2, rest uniform."""

    def __init__(self, vocab=256):
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits[..., ord("a")] = math.log(self.vocab - 1)  # exp → (V−1) · rest ⇒ p('a') = 1/2
        return type("Out", (), {"logits": logits})()


def test_unigram_entropy_by_hand():
    assert unigram_entropy([1, 1, 2, 2]) == math.log(2)
    assert unigram_entropy([7, 7, 7]) == 0
    assert math.isclose(unigram_entropy([1, 2, 3, 4]), math.log(4))
    assert math.isclose(mean_entropy([[1, 1, 2, 2], [5], []]), math.log(2) / 2)


def test_generative_perplexity_scores_only_the_continuation():
    # "xy" + "ab": continuation tokens 'a' (p = 1/2) and 'b' (p = 1/(2·255)), scored given the prompt
    p_a, p_b = 0.5, 0.5 / 255
    expected = math.exp(-(math.log(p_a) + math.log(p_b)) / 2)
    for bos in (None, 0):
        ppl, n = generative_perplexity(TableScorer(), CharTokenizer(bos), [("xy", "ab"), ("q", "")])
        assert n == 2 and math.isclose(ppl, expected, rel_tol=1e-5)
    assert math.isnan(generative_perplexity(TableScorer(), CharTokenizer(), [("xy", " ")])[0])


def card(**changes):
    base = {
        "strategy": "mdlm",
        "sampler_name": "absorbing",
        "data_key": "d1",
        "dtype": "float32",
        "device": "cpu",
        "eval": {"val_rows": 32, "t_samples": 8, "batch_size": 32, "seed": 1, "nfe_budgets": [8, 4], "prompts": ["O"]},
        "sampler": {
            "steps": 8,
            "max_new_tokens": 16,
            "block_size": 8,
            "temperature": 0.0,
            "remasking": "low_confidence",
            "threshold": None,
            "logit_shift": 0,
        },
        "scorer": None,
        "versions": {"torch": "2.13.0", "transformers": "5.24.0", "python": "3.11"},
        "checkpoint_digest": "abc",
    }
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            base[section] = {**base[section], field: value}
        else:
            base[section] = value
    return base


def row(strategy, c, **metrics):
    return {
        "strategy": strategy,
        "run_id": f"run-{strategy}",
        "metrics": metrics,
        "card": c,
        "samples": "text",
        "val_history": [(0, 5.0), (10, 4.0)],
        "curve": [
            {"steps": 8, "nfe": 8.0, "entropy": 2.0, "gen_ppl": 30.0, "tokens_per_forward": 2.0},
            {"steps": 4, "nfe": 4.0, "entropy": 1.5, "gen_ppl": 60.0, "tokens_per_forward": 4.0},
        ],
    }


def test_cards_that_differ_on_a_result_changing_field_are_flagged():
    rows = [
        row("mdlm", card()),
        row(
            "scdd",
            card(strategy="scdd", sampler_name="scdd_ancestral", checkpoint_digest="zzz", sampler__logit_shift=0),
        ),
        row("idlm", card(strategy="idlm", sampler__logit_shift=1, dtype="bfloat16", eval__seed=2)),
    ]
    flags = card_mismatches(rows)
    # strategy, sampler name, logit shift and digest differ by design; dtype and the eval seed change results
    assert set(flags) == {"idlm"}
    assert {f for f, _, _ in flags["idlm"]} == {"dtype", "eval.seed"}
    md = render_markdown("demo", rows, flags, [])
    assert "| idlm ⚠ |" in md and "| mdlm |" in md
    assert '- **idlm**: `dtype` = "bfloat16" (others: "float32")' in md


def test_markdown_table_and_plots_from_rows(tmp_path):
    rows = [
        row("mdlm", card(), **{"eval/nelbo": 5.0, "eval/nelbo_se": 0.1, "eval/gen_ppl": 30.0, "val/loss": 4.0}),
        row("idlm", card(), **{"eval/ar_nll": 4.5, "eval/ar_nll_se": 0.05}),
    ]
    md = render_markdown("demo", rows, {}, ["nelbo.png"])
    lines = [ln for ln in md.splitlines() if ln.startswith("| mdlm |") or ln.startswith("| idlm |")]
    assert "5.0000 ± 0.1000" in lines[0] and "30.00" in lines[0]
    assert "4.5000 ± 0.0500" in lines[1] and "Not compared silently" not in md
    written = render_plots(rows, tmp_path)
    assert written == ["training_curves.png", "nelbo.png", "genppl_vs_entropy.png", "quality_vs_nfe.png"]
    for name in written:
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    no_scorer = [{**r, "curve": [{k: v for k, v in p.items() if k != "gen_ppl"} for p in r["curve"]]} for r in rows]
    (tmp_path / "no_scorer").mkdir()
    assert "genppl_vs_entropy.png" not in render_plots(no_scorer, tmp_path / "no_scorer")  # nothing to plot
    json.dumps(rows)  # rows stay JSON-serializable (report.json)


def test_bits_per_byte_divides_total_nats_by_the_bytes_the_scored_tokens_spell():
    from tasks.evaluation.likelihood import bits_per_byte, supervised_bytes

    class TwoByteTokens:  # every token spells "é" (2 UTF-8 bytes); token 0 is special and spells nothing
        def decode(self, ids, skip_special_tokens=False):
            return "".join("" if (t == 0 and skip_special_tokens) else "é" for t in ids)

    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    n_bytes = supervised_bytes(TwoByteTokens(), ids, mask)
    assert n_bytes == 2 * 4  # 4 scored non-special tokens × 2 bytes; the scored EOS spells none
    # ln 2 nats per token over 5 scored tokens = 5 bits, over 8 bytes
    assert bits_per_byte(math.log(2), 5, n_bytes) == pytest.approx(5 / 8)
    assert math.isnan(bits_per_byte(1.0, 3, 0))


def test_gen_ppl_interval_is_the_ratio_estimator_over_prompts():
    from tasks.evaluation.scoring import gen_ppl_with_interval

    out = gen_ppl_with_interval([1.0, 4.0], [1, 1])  # r = 2.5, se = sqrt(((1−2.5)² + (4−2.5)²)/2) = 1.5
    assert out["gen_ppl"] == pytest.approx(math.exp(2.5))
    assert out["gen_ppl_lo"] == pytest.approx(math.exp(2.5 - 1.96 * 1.5))
    assert out["gen_ppl_hi"] == pytest.approx(math.exp(2.5 + 1.96 * 1.5))
    assert "gen_ppl_lo" not in gen_ppl_with_interval([3.0], [2])  # one prompt: no interval


def test_data_row_cuts_held_out_rows_like_the_prompts_and_is_reported_beside_every_strategy():
    from types import SimpleNamespace

    from tasks.evaluation.data_row import data_row_metrics

    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0], [1, 1, 2, 2, 3, 3]])
    attn = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1] * 6])
    ev = SimpleNamespace(
        spec=SimpleNamespace(eval=SimpleNamespace(sample_length=3, data_rows=5)),
        val=(ids, torch.ones_like(ids), attn),
        scorer=None,
        tokenizer=None,
    )
    m = data_row_metrics(ev, prompts=[[5], [6, 7], [8, 9, 9]])  # median prompt length 2
    assert m["eval/data_rows"] == 2  # the 3-token row is too short for 2 + 3
    assert m["eval/data_entropy"] == pytest.approx(mean_entropy([[3, 4, 5], [2, 2, 3]]))
    rows = [row("mdlm", card(), **{**m, "eval/entropy": 0.5}), row("scdd", card(), **{"eval/entropy": 0.0})]
    md = render_markdown("demo", rows, {}, [])
    assert "## Samples against real text" in md and "| **data** (2 held-out rows" in md
    ratio = 0.5 / mean_entropy([[3, 4, 5], [2, 2, 3]])
    assert f"| mdlm | – | – | 0.500 | {ratio:.2f} |" in md


def test_report_reads_samples_at_the_eval_settings_first_and_greedy_second():
    data = {"eval/data_entropy": 4.0, "eval/data_rows": 32, "eval/data_gen_ppl": 200.0}
    sampled = card(sampler__temperature=1.0, sampler__top_p=0.9, sampler__top_k=0)
    rows = [
        row(
            "mdlm",
            sampled,
            **data,
            **{"eval/gen_ppl": 300.0, "eval/entropy": 3.6, "eval/greedy_gen_ppl": 8.0, "eval/greedy_entropy": 1.0},
        ),
        row("scdd", sampled, **{"eval/gen_ppl": 500.0, "eval/entropy": 3.2, "eval/revised_tokens": 5.25}),
    ]
    md = render_markdown("demo", rows, {}, [])
    main, _, greedy = md.partition("### Greedy decoding (temperature 0")
    assert "## Samples against real text (temperature 1.0, top-p 0.9, low_confidence remasking)" in main
    assert "| mdlm | 300.00 | 1.50 | 3.600 | 0.90 | – |" in main
    assert "| scdd | 500.00 | 2.50 | 3.200 | 0.80 | 5.2 |" in main  # tokens the sampler revised
    assert "| mdlm | 8.00 | 0.04 | 1.000 | 0.25 | – |" in greedy
    assert "| scdd |" not in greedy.split("\n\n")[1]  # no greedy run for scdd: no greedy row


def test_a_strategys_own_sampler_settings_are_named_on_its_row_and_not_flagged():
    data = {"eval/data_entropy": 4.0, "eval/data_rows": 32, "eval/data_gen_ppl": 200.0}
    shared = card(sampler__temperature=1.0, sampler__top_p=0.95)
    own = {**card(strategy="scdd", sampler__temperature=1.3, sampler__top_p=0.95), "sampler_overrides": ["temperature"]}
    stray = card(strategy="hybrid", sampler__temperature=0.7, sampler__top_p=0.95)  # no override: a real mismatch
    rows = [
        row("mdlm", shared, **data, **{"eval/gen_ppl": 300.0, "eval/entropy": 3.6}),
        row("idlm", shared, **data, **{"eval/gen_ppl": 250.0, "eval/entropy": 3.0}),
        row("scdd", own, **data, **{"eval/gen_ppl": 120.0, "eval/entropy": 3.2}),
        row("hybrid", stray, **data, **{"eval/gen_ppl": 150.0, "eval/entropy": 3.4}),
    ]
    flags = card_mismatches(rows)
    assert set(flags) == {"hybrid"} and flags["hybrid"][0][0] == "sampler.temperature"
    md = render_markdown("demo", rows, flags, [])
    assert "## Samples against real text (temperature 1.0, top-p 0.95, low_confidence remasking)" in md
    assert "| scdd (temperature 1.3) | 120.00 | 0.60 | 3.200 | 0.80 | – |" in md
    assert "| mdlm | 300.00 | 1.50 |" in md and "| idlm | 250.00 | 1.25 |" in md
    # the override listed first, one other strategy: still the other's settings are the reference and the heading
    pair = [rows[2], rows[0]]
    assert card_mismatches(pair) == {}
    assert "## Samples against real text (temperature 1.0, top-p 0.95," in render_markdown("demo", pair, {}, [])
    # a threshold set by an override is named too; in the greedy table, everything it set but the temperature
    gated = {**own, "sampler": {**own["sampler"], "threshold": 0.9}, "sampler_overrides": ["temperature", "threshold"]}
    greedy = {"eval/greedy_gen_ppl": 20.0, "eval/greedy_entropy": 2.0}
    md = render_markdown("demo", [rows[0], row("scdd", gated, **data, **greedy, **{"eval/entropy": 3.2})], {}, [])
    main, _, greedy_table = md.partition("### Greedy decoding")
    assert "| scdd (temperature 1.3, threshold 0.9) |" in main and "| scdd (threshold 0.9) | 20.00 |" in greedy_table


def test_dflash_table_flags_a_gap_between_tau_sim_and_real_tau():
    rows = [
        row(
            "dflash (dflash.loss_type=decay)",
            card(),
            **{"dflash/tau_sim": 2.0, "dflash/tau": 1.9, "dflash/acc_k1": 0.5},
        ),
        row("dflash (dflash.loss_type=dpace)", card(), **{"dflash/tau_sim": 3.0, "dflash/tau": 1.5}),
    ]
    md = render_markdown("demo", rows, {}, [])
    assert "| dflash (dflash.loss_type=decay) | 2.000 | 1.900 | 1.05 |" in md  # within 15 %: no flag
    assert "| dflash (dflash.loss_type=dpace) | 3.000 | 1.500 | 2.00 ⚠ |" in md
    assert "- **dflash (dflash.loss_type=dpace)**: τ_sim 3.00 vs real τ 1.50" in md
    assert "decay)**: τ_sim" not in md
    assert "lookup_share" not in md  # no row decoded with the context lookup: no such columns
    # with the context lookup, τ_sim is set against the draft's own τ, and both τ are shown
    rows.append(
        row(
            "dflash (dflash.lookup_ngram=2)",
            card(),
            **{"dflash/tau_sim": 1.2, "dflash/tau": 2.1, "dflash/tau_draft": 1.25, "dflash/lookup_share": 0.2},
        )
    )
    md = render_markdown("demo", rows, {}, [])
    assert "| dflash (dflash.lookup_ngram=2) | 1.200 | 2.100 | 1.250 | 0.20 | 0.96 |" in md
    assert "| dflash (dflash.loss_type=decay) | 2.000 | 1.900 | – | – | 1.05 |" in md
    assert "`dflash/tau_draft` with the draft alone" in md
    assert "speculative sampling" not in md  # no row measured at a temperature: no such line
    rows.append(row("dflash (dflash.eval_temperature=1.0)", card(), **{"dflash/tau": 2.0, "dflash/tau_sampled": 2.5}))
    md = render_markdown("demo", rows, {}, [])
    assert "speculative sampling at `dflash.eval_temperature`" in md and "eval_temperature=1.0) 2.500" in md
    walked = {"dflash/tau": 2.0, "dflash/tau_sampled": 2.4, "dflash/tau_sampled_walk": 1.9}
    rows.append(row("dflash (dflash.draft_variant=dflash2)", card(), **walked))
    md = render_markdown("demo", rows, {}, [])
    assert "dflash2) 2.400 (sampling its serial walk, as the engines do: 1.900)" in md
    assert "tree branches" not in md  # no row measured with a tree: no such line
    tree = {"dflash/tau": 2.0, "dflash/tau_tree": 2.3, "dflash/tree_branches": 2.0, "dflash/tau_tree_gain": 0.3}
    tree.update({"dflash/tau_tree_gain_low": 0.11, "dflash/tau_tree_gain_high": 0.52})
    rows.append(row("dflash (dflash.eval_tree_branches=2)", card(), **tree))
    md = render_markdown("demo", rows, {}, [])
    assert "eval_tree_branches=2) 2.300 with 2 branches (+0.300 [+0.110, +0.520])" in md
    # a row decoded with the lookup is flagged against rows without it: its τ is not the same measurement
    plain, looked = card(strategy="dflash"), card(strategy="dflash", sampler__lookup_ngram=2)
    flags = card_mismatches([row("a", plain), row("b", plain), row("c", looked)])
    assert flags == {"c": [("sampler.lookup_ngram", "2", "missing")]}  # values as the flattened card holds them


def test_report_and_model_card_take_an_evaluations_metrics_from_its_own_record_only(tmp_path):
    """A run evaluated twice (with the context lookup, then without) keeps the first evaluation's
    `dflash/tau_draft` among its latest MLflow metrics: neither the report nor the model card shows it beside
    the second evaluation's numbers; training-side metrics still come from the run."""
    from types import SimpleNamespace

    from tasks.commands.provenance import _mlflow_evaluation
    from tasks.report import collect_rows

    latest = {"dflash/tau": 1.8, "dflash/tau_draft": 1.7, "eval/ar_nll": 5.0, "train/loss": 2.0}
    second = {"dflash/tau": 1.8, "eval/ar_nll": 5.0}

    def download(run_id, path, dst):  # MLflow's: the folder or file `path` of the run's artifacts, under dst
        folder = Path(dst, "eval", "abc")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "metrics.json").write_text(json.dumps(second))
        return str(Path(dst, path))

    client = SimpleNamespace(
        get_run=lambda run_id: SimpleNamespace(
            data=SimpleNamespace(metrics=latest, params={}), info=SimpleNamespace(run_id=run_id)
        ),
        get_metric_history=lambda run_id, key: [],
        download_artifacts=download,
        list_artifacts=lambda run_id, path: [SimpleNamespace(path="eval/abc", is_dir=True)],
    )
    (r,) = collect_rows(client, [{"strategy": "dflash", "run_id": "r1", "eval_artifacts": "eval/abc"}])
    assert r["metrics"] == {**second, "train/loss": 2.0}
    found = _mlflow_evaluation(client, client.get_run("r1"))
    assert found.metrics == second


def test_runs_of_one_strategy_from_several_pipeline_runs_are_labelled_by_what_differs():
    from types import SimpleNamespace

    from tasks.report import _labelled

    params = {
        "a": {"dflash.loss_type": "decay", "train.steps": "100", "dllm.run_id": "x", "stage.key": "k1"},
        "b": {"dflash.loss_type": "dpace", "train.steps": "100", "dllm.run_id": "y", "stage.key": "k2"},
        "c": {"train.steps": "100"},
        # the strategy's resolved options name the difference better than the settings that echo them
        "d": {"options.loss_type": "decay", "settings.loss_type": "None", "stage.key": "k1", "data.path": "/a"},
        "e": {"options.loss_type": "dpace", "settings.loss_type": "dpace", "stage.key": "k2", "data.path": "/b"},
        "f": {"stage.key": "k3"},
        "g": {"stage.key": "k4"},
    }
    client = SimpleNamespace(get_run=lambda rid: SimpleNamespace(data=SimpleNamespace(params=params[rid])))
    runs = [
        {"strategy": "dflash", "run_id": "a"},
        {"strategy": "dflash", "run_id": "b"},
        {"strategy": "mdlm", "run_id": "c"},
    ]
    assert [r["strategy"] for r in _labelled(client, runs)] == [
        "dflash (dflash.loss_type=decay)",
        "dflash (dflash.loss_type=dpace)",
        "mdlm",
    ]
    more = [{"strategy": "dflash", "run_id": "d"}, {"strategy": "dflash", "run_id": "e"}]
    assert [r["strategy"] for r in _labelled(client, more)] == ["dflash (loss_type=decay)", "dflash (loss_type=dpace)"]
    same = [{"strategy": "scdd", "run_id": "f"}, {"strategy": "scdd", "run_id": "g"}]
    assert [r["strategy"] for r in _labelled(client, same)] == ["scdd (f)", "scdd (g)"]  # nothing differs: run ids


def test_a_report_leaves_out_what_no_strategy_has(tmp_path):
    """No strategy with a likelihood: no likelihood columns and no likelihood plot (not an empty one with an
    empty legend); a row without a likelihood beside one with it shows dashes only in that row."""
    import warnings

    plain = [row("toy", card(), **{"val/loss": 4.0, "eval/gen_ppl": 30.0, "eval/entropy": 2.0})]
    md = render_markdown("demo", plain, {}, [])
    header = next(ln for ln in md.splitlines() if ln.startswith("| strategy |"))
    assert "nelbo" not in header and "ar_nll" not in header and "bits/byte" not in header
    assert "eval/nelbo" not in md and "bits/byte" not in md and "| toy | absorbing | 4.0000 | 30.00 |" in md
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend" included
        written = render_plots(plain, tmp_path)
    assert "nelbo.png" not in written and written[0] == "training_curves.png"
    mixed = [*plain, row("mdlm", card(), **{"eval/nelbo": 5.0, "eval/nelbo_se": 0.1})]
    md = render_markdown("demo", mixed, {}, [])
    assert "eval/nelbo ± se" in md and "eval/ar_nll" not in md and "| toy | absorbing | 4.0000 | – |" in md
    (tmp_path / "mixed").mkdir()
    assert "nelbo.png" in render_plots(mixed, tmp_path / "mixed")


def test_the_samples_heading_names_the_settings_the_sampler_reads():
    data = {"eval/data_entropy": 4.0, "eval/data_rows": 32, "eval/data_gen_ppl": 200.0}
    cuts_only = {**card(sampler__temperature=1.0, sampler__top_p=0.9), "sampler_settings": ["temperature", "top_p"]}
    absorbing = {
        **card(sampler__temperature=1.0, sampler__top_p=0.9, sampler__threshold=0.8),
        "sampler_settings": ["temperature", "top_k", "top_p", "remasking", "threshold"],
    }
    lone = render_markdown("demo", [row("isd", cuts_only, **data, **{"eval/entropy": 3.0})], {}, [])
    assert "## Samples against real text (temperature 1.0, top-p 0.9)\n" in lone and "remasking" not in lone
    rows = [
        row("mdlm", absorbing, **data, **{"eval/entropy": 3.6}),
        row("hybrid", absorbing, **data, **{"eval/entropy": 3.4}),
        row("isd", cuts_only, **data, **{"eval/entropy": 3.0}),
    ]
    md = render_markdown("demo", rows, {}, [])
    heading = "## Samples against real text (temperature 1.0, top-p 0.9, threshold 0.8, low_confidence remasking)"
    assert heading in md and "| mdlm |" in md and "| hybrid |" in md
    assert "| isd (temperature 1.0, top-p 0.9) |" in md  # its sampler reads less than the heading says
    before = row("mdlm", card(sampler__temperature=1.0), **data, **{"eval/entropy": 3.0})
    old_card = render_markdown("demo", [before], {}, [])
    assert "(temperature 1.0, low_confidence remasking)" in old_card  # a card from before `sampler_settings`
