"""Prepared training rows on disk: one `.npy` file per array and split, written row block by row block and
read back memory-mapped, so neither `prepare_data` nor training holds a corpus in memory.

A split `<name>` is `<name>.input_ids.npy` (int32, `[rows, seq_len]`), `<name>.loss_mask.npy` and
`<name>.attention_mask.npy` (uint8), and, for packed pretraining rows, `<name>.doc_starts.npy` (uint8: 1
where a document begins). The boundaries feed attention masks that take per-token document ids (DFlash's
`dflash.document_mask`, docs/strategies.md). `<name>.json` holds the row count and the sums the manifest reports.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch

ARRAYS = {"input_ids": np.int32, "loss_mask": np.uint8, "attention_mask": np.uint8, "doc_starts": np.uint8}


class RowWriter:
    """Appends `[n, seq_len]` row blocks of each array to raw files; `close` turns them into `.npy` files
    (header + the raw bytes, copied in chunks) and writes the split's summary."""

    def __init__(self, folder: Path, split: str, seq_len: int, arrays: tuple[str, ...]):
        self.folder, self.split, self.seq_len, self.arrays = Path(folder), split, seq_len, arrays
        self.rows, self.supervised = 0, 0
        self.raw = {a: open(self.folder / f".{split}.{a}.raw", "wb") for a in arrays}

    def add(self, **blocks: np.ndarray) -> None:
        n = len(next(iter(blocks.values())))
        for name in self.arrays:
            block = np.ascontiguousarray(blocks[name], dtype=ARRAYS[name])
            if block.shape != (n, self.seq_len):
                raise ValueError(f"{self.split}.{name}: a block of shape {block.shape}, expected ({n}, {self.seq_len})")
            self.raw[name].write(block.tobytes())
        self.rows += n
        self.supervised += int(blocks["loss_mask"].sum())

    def discard(self) -> None:
        """A failed preparation: close the raw files and remove them (no open handle outlives the stage)."""
        for name, handle in self.raw.items():
            try:
                with contextlib.suppress(OSError):  # a full disk fails the flush: the file goes anyway
                    handle.close()
            finally:
                (self.folder / f".{self.split}.{name}.raw").unlink(missing_ok=True)

    def close(self, **summary) -> dict:
        for name, handle in self.raw.items():
            handle.close()
            raw = self.folder / f".{self.split}.{name}.raw"
            with open(self.folder / f"{self.split}.{name}.npy", "wb") as out, open(raw, "rb") as src:
                header = {
                    "descr": np.dtype(ARRAYS[name]).str,
                    "fortran_order": False,
                    "shape": (self.rows, self.seq_len),
                }
                np.lib.format.write_array_header_1_0(out, header)
                shutil.copyfileobj(src, out, 1 << 22)
            raw.unlink()
        info = {"rows": self.rows, "seq_len": self.seq_len, "supervised_tokens": self.supervised, **summary}
        (self.folder / f"{self.split}.json").write_text(json.dumps(info, indent=2))
        return info


def write_split(folder: Path, split: str, ids, loss_mask, attention_mask) -> dict:
    """A whole split from tensors (regenerated rows, tests)."""
    ids, loss, attn = (torch.as_tensor(t).cpu().numpy() for t in (ids, loss_mask, attention_mask))
    writer = RowWriter(Path(folder), split, ids.shape[1], ("input_ids", "loss_mask", "attention_mask"))
    writer.add(input_ids=ids, loss_mask=loss, attention_mask=attn)
    return writer.close()


def open_split(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids int32, loss_mask uint8, attention_mask uint8), memory-mapped copy-on-write: pages are read
    from disk when a row is used and the file is never written. Index rows, then convert (`Split`)."""
    out = []
    for name in ("input_ids", "loss_mask", "attention_mask"):
        array = np.load(Path(folder) / f"{split}.{name}.npy", mmap_mode="c")
        out.append(torch.from_numpy(array))
    return tuple(out)


def open_doc_starts(folder: Path, split: str) -> torch.Tensor | None:
    """The split's document starts (uint8 `[N, L]`, memory-mapped like `open_split`), or None where the rows are
    not packed (chat rows, regenerated rows)."""
    path = Path(folder) / f"{split}.doc_starts.npy"
    return torch.from_numpy(np.load(path, mmap_mode="c")) if path.is_file() else None


def document_ids(doc_starts: torch.Tensor) -> torch.Tensor:
    """Per-token document numbers `[n, L]` (int64) of packed rows: the running count of document starts."""
    return doc_starts.long().cumsum(dim=1)


def load_split(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split in memory as (int64 ids, float loss mask, int64 attention mask), for the stages that use
    every row at once (evaluation's validation rows, DFlash's regeneration and feature cache)."""
    ids, loss, attn = open_split(folder, split)
    return ids.long(), loss.float(), attn.long()
