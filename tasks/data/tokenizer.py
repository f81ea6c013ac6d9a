"""The tokenizer: a byte-level BPE trained on the training documents (with pad/eos/mask specials and a chat
template), or a pretrained one loaded; a [MASK] id that is also EOS or PAD refused unless allowed."""

from __future__ import annotations

from collections.abc import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dllm_common.config import ConfigError, PipelineSpec, TokenizerConfig
from dllm_common.mask_alias import mask_alias_problem
from strategies.model_files import resolve_model_path

SPECIAL = {
    "pad": "<|pad|>",
    "eos": "<|eos|>",
    "mask": "<|mask|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "system": "<|system|>",
}
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|eos|>"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|eos|>"
    "{% else %}<|system|>{{ m['content'] }}<|eos|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(texts: list[str], cfg: TokenizerConfig):
    """Byte-level BPE trained locally, with pad/eos/mask specials and a simple chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=list(SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=SPECIAL["pad"],
        eos_token=SPECIAL["eos"],
        mask_token=SPECIAL["mask"],
        additional_special_tokens=[SPECIAL["user"], SPECIAL["assistant"], SPECIAL["system"]],
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def refuse_mask_alias(spec: PipelineSpec, tokenizer, mask_ids: dict[str, int | None] | None = None) -> None:
    """Refuse (`ConfigError`, one line) a [MASK] id equal to `tokenizer`'s EOS or PAD id unless
    `tokenizer.allow_mask_alias`: by default the ids the pipeline's strategies that write [MASK] would take (the
    config's `mask_token_id`, else the tokenizer's mask token); `mask_ids`: the config key or place that says
    each id → the id. Checked once the tokenizer is prepared, before any row is written or model trained."""
    if spec.tokenizer.allow_mask_alias:
        return
    if mask_ids is None:
        # from the options alone: loading the strategies' classes (to skip those that write no [MASK]) would make
        # the data stage run, and be keyed by, every listed strategy's code (docs/architecture.md, "Stage keys");
        # a strategy without [MASK] is checked only if its tokenizer has a mask token aliased to EOS or PAD
        from strategies.options import resolve_options

        mask_ids = {}
        for name in spec.pipeline.strategies:
            explicit = resolve_options(spec, name).mask_token_id
            where = "dllm.mask_token_id" if explicit is not None else "the tokenizer's mask token id"
            mask_ids[f"{where} ({name})"] = explicit if explicit is not None else tokenizer.mask_token_id
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    for where, mask_id in mask_ids.items():
        problem = mask_alias_problem(mask_id, ids, where)
        if problem:
            raise ConfigError(problem)


def load_tokenizer(path: str, trust_remote_code: bool = False, gguf_file: str | None = None):
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(resolve_model_path(path), trust_remote_code=trust_remote_code, **extra)


def document_texts(docs) -> Iterator[str]:
    for d in docs:
        if d.text:
            yield d.text
        for dlg in d.dialogues:
            for m in dlg:
                yield m["content"]
