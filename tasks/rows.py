"""Prepared training rows on disk: one `.npy` file per array and split, written row block by row block and
read back memory-mapped, so neither `prepare_data` nor training holds a corpus in memory.

A split `<name>` is `<name>.input_ids.npy` (int32, `[rows, seq_len]`), `<name>.loss_mask.npy` and
`<name>.attention_mask.npy` (uint8), and, for packed pretraining rows, `<name>.doc_starts.npy` (uint8: 1
where a document begins). The boundaries feed attention masks that take per-token document ids (DFlash's
`dflash.document_mask`, docs/strategies.md). `<name>.json` holds the row count and the sums the manifest reports.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from dllm_common.store import MANIFEST

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


class MissingRowsError(FileNotFoundError):
    """A prepared split's file is gone from its published store entry (deleted while a run used it): names the
    entry and that rerunning the pipeline rebuilds it. `run_id` is filled in by the pipeline that hit it."""

    def __init__(self, path: Path):
        super().__init__(errno.ENOENT, "prepared rows missing", str(path))
        self.path, self.run_id = Path(path), None

    def __reduce__(self):  # across processes and Prefect's result storage, with the run id it may have got
        return type(self), (self.path,), self.__dict__

    def __str__(self) -> str:
        entry = self.path.parent
        rerun = (
            f"`dllm-flow resume {self.run_id}`"
            if self.run_id
            else "`dllm-flow resume RUN_ID` (`dllm-flow runs` lists them)"
        )
        return (
            f"{self.path.name} is missing from the store entry {entry.parent.name}/{entry.name} ({entry}): the entry "
            f"was deleted or changed while this run used it. {rerun}, or the same `dllm-flow run` again, sets what is "
            "left of it aside and rebuilds it"
        )


def _load(folder: Path, name: str) -> np.ndarray:
    """One prepared array, memory-mapped copy-on-write (`MissingRowsError` if its file is gone)."""
    path = Path(folder) / name
    try:
        return np.load(path, mmap_mode="c")
    except FileNotFoundError:
        raise MissingRowsError(path) from None


def open_split(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids int32, loss_mask uint8, attention_mask uint8), memory-mapped copy-on-write: pages are read
    from disk when a row is used and the file is never written. Index rows, then convert (`Split`)."""
    return tuple(
        torch.from_numpy(_load(folder, f"{split}.{name}.npy")) for name in ("input_ids", "loss_mask", "attention_mask")
    )


def open_doc_starts(folder: Path, split: str) -> torch.Tensor | None:
    """The split's document starts (uint8 `[N, L]`, memory-mapped like `open_split`), or None where the rows are
    not packed (chat rows, regenerated rows). One its store entry lists but lost is `MissingRowsError`."""
    name = f"{split}.doc_starts.npy"
    if (Path(folder) / name).is_file() or name in _published_files(folder):
        return torch.from_numpy(_load(folder, name))
    return None


def _published_files(folder: Path) -> set[str]:
    """The files the store entry `folder` published (empty outside a store, or where its manifest is unreadable:
    the store's own check reports that)."""
    try:
        return set(json.loads((Path(folder) / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def document_ids(doc_starts: torch.Tensor) -> torch.Tensor:
    """Per-token document numbers `[n, L]` (int64) of packed rows: the running count of document starts."""
    return doc_starts.long().cumsum(dim=1)


def load_split(folder: Path, split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split in memory as (int64 ids, float loss mask, int64 attention mask), for the stages that use
    every row at once (evaluation's validation rows, DFlash's regeneration and feature cache)."""
    ids, loss, attn = open_split(folder, split)
    return ids.long(), loss.float(), attn.long()
