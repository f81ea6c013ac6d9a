"""Chat SFT rows as LLaDA's SFT and Automodel's collator build them (docs/post-training.md, "Chat SFT"): the EOS
fill after the last assistant turn (whole row or block-aligned; PAD at loss 0 when off), chat templates that would
supervise the wrong tokens refused naming the template, empty reasoning spans left unsupervised; and what the
evaluation of a chat model reads (answer statistics, accuracy intervals, held-out problems)."""

import numpy as np
import pytest

from dllm_common.config import DataConfig, TokenizerConfig
from tasks.data.documents import DataError, split_documents, task_documents
from tasks.data.split_rows import SplitRows
from tasks.data.tokenizer import CHAT_TEMPLATE, train_tokenizer
from tasks.data.tokenizing import check_chat_template, dialogue_row
from tasks.evaluation.chat import answer_stats, bootstrap_mean, held_out_problems, paired_difference
from tasks.posttrain.families import generate
from tasks.rows import load_split


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"{a}+{b}={a + b} what is it" for a in range(30) for b in range(30)]
    return train_tokenizer(texts, TokenizerConfig(vocab_size=300))


def _cfg(**kw) -> DataConfig:
    return DataConfig(source="task", shape="dialogue", task={"family": "arithmetic"}, seq_len=16, **kw)


def _rows(tmp_path, tokenizer, cfg, dialogues):
    tmp_path.mkdir(parents=True, exist_ok=True)
    rows = SplitRows(tmp_path, "train", cfg, tokenizer, None)
    rows.add([dialogue_row(d, tokenizer, cfg.seq_len) for d in dialogues])
    rows.close()
    ids, loss, attn = load_split(tmp_path, "train")
    return {"input_ids": ids, "loss_mask": loss, "attention_mask": attn}


QA = [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "7"}]


def test_the_eos_fill_supervises_the_rest_of_the_row_after_the_last_assistant_turn(tmp_path, tokenizer):
    ids, mask = dialogue_row(QA, tokenizer, 16)
    n, eos, pad = len(ids), tokenizer.eos_token_id, tokenizer.pad_token_id
    assert n < 16 and mask[-1] == 1  # the assistant turn ends the conversation, its end token supervised
    got = _rows(tmp_path / "on", tokenizer, _cfg(), [QA])
    assert got["input_ids"][0, :n].tolist() == ids and (got["input_ids"][0, n:] == eos).all()
    assert got["loss_mask"][0].tolist() == mask + [1] * (16 - n)
    assert (got["attention_mask"][0] == 1).all()
    off = _rows(tmp_path / "off", tokenizer, _cfg(supervise_eos_fill=False), [QA])
    assert (off["input_ids"][0, n:] == pad).all() and (off["loss_mask"][0, n:] == 0).all()
    assert off["attention_mask"][0].tolist() == [1] * n + [0] * (16 - n)


def test_the_block_aligned_fill_ends_with_the_block_the_answer_ends_in(tmp_path, tokenizer):
    ids, mask = dialogue_row(QA, tokenizer, 16)
    n, block = len(ids), 4
    end = -(-n // block) * block
    got = _rows(tmp_path, tokenizer, _cfg(eos_fill_block=block), [QA])
    assert got["loss_mask"][0].tolist() == mask + [1] * (end - n) + [0] * (16 - end)
    assert got["attention_mask"][0].tolist() == [1] * end + [0] * (16 - end)
    assert (got["input_ids"][0, n:end] == tokenizer.eos_token_id).all()


def test_a_conversation_that_ends_with_a_user_turn_is_not_filled(tmp_path, tokenizer):
    dialogue = [*QA, {"role": "user", "content": "and 5+5="}]
    ids, mask = dialogue_row(dialogue, tokenizer, 16)
    got = _rows(tmp_path, tokenizer, _cfg(), [dialogue])
    assert got["loss_mask"][0].tolist() == mask + [0] * (16 - len(ids))


def _with_template(template: str):
    """A small trained tokenizer whose chat template is `template`."""
    tok = train_tokenizer(["3+4=7 what is it"], TokenizerConfig(vocab_size=300))
    tok.chat_template = template
    return tok


@pytest.mark.parametrize(
    "template, what",
    [
        # the assistant turns are not rendered at all: nothing would be supervised
        ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}", "no token"),
        # only the assistant turns are rendered: everything would be
        ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{% endif %}{% endfor %}", "every"),
    ],
)
def test_a_template_that_supervises_nothing_or_everything_is_refused_naming_it(template, what):
    tok = _with_template(template)
    with pytest.raises(DataError, match=f"the chat template of my/tokenizer marks {what}"):
        check_chat_template(tok, "my/tokenizer")
    tok.chat_template = CHAT_TEMPLATE
    check_chat_template(tok, "my/tokenizer")  # the shipped template passes


def test_a_template_whose_prompt_is_no_prefix_is_refused():
    # the generation prompt differs from how the assistant turn is rendered in the conversation
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
        "{% if add_generation_prompt %}<|bot|>{% endif %}"
    )
    with pytest.raises(DataError, match="no prefix of the conversation"):
        check_chat_template(_with_template(template), "odd")


def test_an_empty_reasoning_span_is_not_supervised(tokenizer):
    tok = _with_template(
        CHAT_TEMPLATE.replace(
            "<|assistant|>{{ m['content'] }}", "<|assistant|><think>\n\n</think>\n\n{{ m['content'] }}"
        )
    )
    text = tok.apply_chat_template(QA, tokenize=False)
    ids, mask = dialogue_row(QA, tok, 64)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    supervised = "".join(text[a:b] for (a, b), m in zip(enc["offset_mapping"], mask) if m)
    assert supervised == "7<|eos|>"  # the answer and its end; the template's empty <think></think> is not
    reasoned = [QA[0], {"role": "assistant", "content": "<think>3 and 4</think>7"}]
    text = tok.apply_chat_template(reasoned, tokenize=False)
    ids, mask = dialogue_row(reasoned, tok, 64)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    supervised = "".join(text[a:b] for (a, b), m in zip(enc["offset_mapping"], mask) if m)
    assert "<think>3 and 4</think>7" in supervised  # a reasoning span with content is the answer's: supervised


def test_answer_statistics_by_hand():
    eos = 9
    stats = answer_stats([[1, 2, 9, 9], [1, 1, 1, 1], [9, 9, 9, 9]], eos)
    assert stats["eval/eos_rate"] == pytest.approx(6 / 12)
    assert stats["eval/ended"] == pytest.approx(2 / 3)
    assert stats["eval/answer_len_mean"] == pytest.approx((2 + 4 + 0) / 3)
    assert stats["eval/answer_len_p50"] == 2.0
    assert stats["eval/answer_len_p90"] == pytest.approx(np.percentile([2, 4, 0], 90))


def test_bootstrap_intervals():
    assert bootstrap_mean([1.0] * 10, 0) == (1.0, 1.0, 1.0)
    mean, lo, hi = bootstrap_mean([0.0, 1.0] * 50, 0)
    assert mean == 0.5 and 0.38 < lo < 0.5 < hi < 0.62
    diff, lo, hi = paired_difference([0.0] * 40, [1.0] * 30 + [0.0] * 10, 0)
    assert diff == 0.75 and 0 < lo < diff < hi
    with pytest.raises(ValueError, match="same problems"):
        paired_difference([1.0], [1.0, 0.0], 0)


def test_held_out_problems_are_the_validation_documents_and_never_trained_on():
    cfg = _cfg()
    train, val = split_documents(list(task_documents(cfg)), cfg.val_fraction, cfg.seed)
    spec = type("S", (), {"data": cfg})()
    held = held_out_problems(spec, 10_000)
    val_prompts = [d.dialogues[0][0]["content"] for d in val]
    assert [p.prompt for p in held] == val_prompts and len(held) == len(val) > 0
    assert not {p.prompt for p in held} & {d.dialogues[0][0]["content"] for d in train}
    assert [p.prompt for p in generate("arithmetic", 5, cfg.seed)] == [
        d.dialogues[0][0]["content"] for d in list(task_documents(cfg))[:5]
    ]
