"""Peak resident memory of `prepare_data` and of 20 training steps at corpus size N and 8N, in the same run:
the prepared rows stream through the tokenizer to row files and training reads them memory-mapped, so
neither should grow with the corpus (goal, issue 13: 8N ÷ N ≤ 1.2).

    python benchmarks/data_scale.py [--docs 4000 --scale 8]

A synthetic jsonl corpus of `--docs` documents (~1 KB of text each) and `scale` times as many; each stage runs
in a fresh interpreter and reports its peak RSS (`ru_maxrss`; the tokenizing processes' largest separately).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = "thou thee thy shall would love death king lord night day sweet fair heaven heart blood crown".split()

STAGE = """
import json, resource, sys
from dllm_common.config import validate_schema
from tasks.prepare_data import prepare_data
from tasks.train import train
spec = validate_schema(json.loads(sys.argv[1]))
data = prepare_data(spec, sys.argv[2])
peak = {"prepare_data": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "tokenizer workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}
if sys.argv[3] == "train":
    train(spec, "mdlm", data, sys.argv[2])
    peak["prepare_data + 20 steps"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({**peak, "train_rows": data.info["train_rows"]}))
"""


def corpus(path: Path, docs: int) -> int:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(docs):
            text = " ".join(rng.choice(WORDS) for _ in range(200))
            f.write(json.dumps({"text": f"{i}. {text}"}) + "\n")
    return path.stat().st_size


def measure(corpus_path: Path, work: Path, what: str) -> dict:
    spec = {
        "pipeline": {"name": "scale", "strategies": ["mdlm"]},
        "data": {"source": "jsonl", "path": str(corpus_path), "seq_len": 128, "max_val_rows": 64},
        "tokenizer": {"vocab_size": 2048},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4},
        "train": {"steps": 20, "global_batch_size": 16, "micro_batch_size": 16, "val_every": 20, "log_every": 10},
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    out = subprocess.run(
        [sys.executable, "-c", STAGE, json.dumps(spec), str(work), what],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=4000)
    ap.add_argument("--scale", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for label, docs in (("N", args.docs), (f"{args.scale}N", args.docs * args.scale)):
            size = corpus(Path(tmp) / f"{label}.jsonl", docs)
            results[label] = measure(Path(tmp) / f"{label}.jsonl", Path(tmp) / f"w{label}", "train")
            print(f"{label}: {docs} documents, {size / 2**20:.0f} MiB of jsonl, {results[label]['train_rows']} rows")
    small, big = results["N"], results[f"{args.scale}N"]
    print(f"| peak RSS (MiB) | N | {args.scale}N | {args.scale}N ÷ N |")
    print("|---|---|---|---|")
    for key in ("prepare_data", "tokenizer workers", "prepare_data + 20 steps"):
        a, b = small[key] / 1024, big[key] / 1024  # ru_maxrss is in KiB on Linux
        print(f"| {key} | {a:.0f} | {b:.0f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
