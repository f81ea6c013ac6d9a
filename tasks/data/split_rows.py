"""One split's rows as they are produced (`SplitRows`): pretraining streams packed and cut into full rows, or
one row per conversation, written a block at a time through `tasks.rows.RowWriter`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dllm_common.config import DataConfig
from tasks.rows import RowWriter


class SplitRows:
    """One split's rows as they are produced: packed pretraining streams cut into full rows, or one row per
    conversation; written a block at a time, at most `limit` rows."""

    def __init__(self, folder: Path, split: str, cfg: DataConfig, tokenizer, limit: int | None):
        self.shape, self.seq_len, self.limit = cfg.shape, cfg.seq_len, limit
        arrays = ("input_ids", "loss_mask", "attention_mask") + (("doc_starts",) if cfg.shape == "pretrain" else ())
        self.writer = RowWriter(folder, split, cfg.seq_len, arrays)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.eos = tokenizer.eos_token_id
        self.fill, self.fill_block = cfg.supervise_eos_fill, cfg.eos_fill_block
        self.carry, self.carry_starts = np.zeros(0, np.int32), np.zeros(0, np.uint8)
        self.documents, self.tokens = 0, 0

    @property
    def full(self) -> bool:
        return self.limit is not None and self.writer.rows >= self.limit

    def add(self, units: list) -> None:
        self.documents += 1
        if self.full:
            return
        if self.shape == "pretrain":
            self._pack(units)
        else:
            self._rows(units)

    def _room(self, n: int) -> int:
        return n if self.limit is None else min(n, self.limit - self.writer.rows)

    def _pack(self, streams: list[np.ndarray]) -> None:
        self.tokens += sum(len(t) for t in streams)
        starts = [np.eye(1, len(t), dtype=np.uint8)[0] for t in streams]
        ids = np.concatenate([self.carry, *streams])
        flags = np.concatenate([self.carry_starts, *starts])
        n = self._room(len(ids) // self.seq_len)
        cut = n * self.seq_len
        if n:
            block = ids[:cut].reshape(n, self.seq_len)
            ones = np.ones_like(block, dtype=np.uint8)
            self.writer.add(input_ids=block, loss_mask=ones, attention_mask=ones, doc_starts=flags[:cut].reshape(n, -1))
        keep = len(ids) - (len(ids) // self.seq_len) * self.seq_len  # a row's worth or less carries over
        self.carry, self.carry_starts = ids[len(ids) - keep :], flags[len(ids) - keep :]

    def _rows(self, rows: list[tuple[list[int], list[int]]]) -> None:
        rows = rows[: self._room(len(rows))]
        if not rows:
            return
        ids = np.full((len(rows), self.seq_len), self.pad, dtype=np.int32)
        loss = np.zeros((len(rows), self.seq_len), dtype=np.uint8)
        attn = np.zeros_like(loss)
        for r, (row_ids, row_mask) in enumerate(rows):
            ids[r, : len(row_ids)] = row_ids
            loss[r, : len(row_mask)] = row_mask
            end = self._fill_end(row_mask)
            ids[r, len(row_ids) : end] = self.eos
            loss[r, len(row_ids) : end] = 1
            attn[r, :end] = 1
        self.writer.add(input_ids=ids, loss_mask=loss, attention_mask=attn)

    def _fill_end(self, mask: list[int]) -> int:
        """Where a conversation's row ends once filled (docs/post-training.md, "Chat SFT"): with
        `supervise_eos_fill`, a row whose last token is supervised (it ends with an assistant turn) is EOS up to the
        end of the row, or of the `eos_fill_block` its end falls in; otherwise it ends with its tokens (PAD after,
        at loss 0)."""
        n = len(mask)
        if not (self.fill and n and mask[-1]):
            return n
        if self.fill_block is None:
            return self.seq_len
        return min(self.seq_len, -(-n // self.fill_block) * self.fill_block)

    def close(self) -> dict:
        return self.writer.close(documents=self.documents, tokens=self.tokens)
