"""Two hosts with their own addresses: network namespaces joined by a veth pair (docs/operations.md, "Other hosts").

Host A (10.231.x.1) and host B (10.231.x.2) share this machine's files, as a cluster's nodes share a filesystem,
but not its network: each has its own loopback and reaches the other only over the veth pair. Nothing here
can pass by talking to 127.0.0.1 of the other host.

1. Two nodes of one training: `dllm-flow run` on each host with `train.nnodes: 2`, rendezvous at A's address,
   gloo bound to each host's own interface; the per-step losses equal a one-process run's.
2. A team's server on A (`make server SERVER_HOST=<A>`), a cpu worker on A and a gpu worker on B: a pipeline
   submitted on A has its training run by the worker on B, tracked in A's MLflow.

Needs root and iproute2 (CI runs as root on these machines); elsewhere the tests skip, saying why.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, free_port, stack_env, stop_group
from runkit import latest_record, metric_history

pytestmark = pytest.mark.slow

VENV = Path(sys.executable).parent.parent
DLLM = str(VENV / "bin" / "dllm-flow")
QUIET = {"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true"}


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root; run the suite as root to include this)")
    if shutil.which("ip") is None:
        pytest.skip("network namespaces need iproute2's `ip`, which is not installed")
    tag = os.getpid()
    a, b, net = f"dllm-a{tag}", f"dllm-b{tag}", f"10.231.{tag % 250}"
    steps = [
        ("netns", "add", a),
        ("netns", "add", b),
        ("link", "add", "dla", "netns", a, "type", "veth", "peer", "name", "dlb", "netns", b),
        ("-n", a, "addr", "add", f"{net}.1/24", "dev", "dla"),
        ("-n", b, "addr", "add", f"{net}.2/24", "dev", "dlb"),
        ("-n", a, "link", "set", "dla", "up"),
        ("-n", b, "link", "set", "dlb", "up"),
        ("-n", a, "link", "set", "lo", "up"),
        ("-n", b, "link", "set", "lo", "up"),
    ]
    try:
        for step in steps:
            out = _ip(*step)
            if out.returncode != 0:
                pytest.skip(
                    f"this machine cannot build two network namespaces (`ip {' '.join(step)}`: {out.stderr.strip()})"
                )
        yield {"A": (a, f"{net}.1", "dla"), "B": (b, f"{net}.2", "dlb")}
    finally:
        stop_namespaces(a, b)  # deleting a namespace would leave its processes running, unreachable by name
        for ns in (a, b):
            _ip("netns", "del", ns)  # takes the veth pair with it


def stop_namespaces(*names: str, seconds: float = 30) -> None:
    """Stop every process still inside these namespaces: what a signal to a started process's group misses (a
    worker's flow runs in sessions of their own, what a timed-out `subprocess.run` had started); SIGTERM, then
    SIGKILL to what is left after `seconds`."""

    def pids() -> set[int]:
        return {int(pid) for ns in names for pid in _ip("netns", "pids", ns).stdout.split()}

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + seconds
        while pids() and time.monotonic() < deadline:
            time.sleep(0.5)
        if not pids():
            return


def on(host, args):
    """Run `args` inside host's namespace (same files, its own network)."""
    return ["ip", "netns", "exec", host[0], *args]


def tx_bytes(host) -> int:
    out = subprocess.run(
        on(host, ["cat", f"/sys/class/net/{host[2]}/statistics/tx_bytes"]), capture_output=True, text=True, check=True
    )
    return int(out.stdout)


def losses(workdir: Path) -> list[tuple[int, float]]:
    """(step, train/loss) of the workdir's one pipeline run, which must have completed."""
    record = latest_record(workdir)
    assert record["status"] == "COMPLETED", record
    run_id = next(s for s in record["stages"] if s["name"] == "train[mdlm]")["mlflow_run_id"]
    return metric_history(workdir, run_id, "train/loss")


SMOKE = [
    "configs/smoke.yaml",
    "--set",
    "train.steps=6",
    "--set",
    "train.log_every=1",
    "--set",
    "train.val_every=3",
    "--set",
    "train.checkpoint_every=3",
]


def test_two_hosts_train_one_model_like_one_process(hosts, tmp_path):
    A, B = hosts["A"], hosts["B"]
    env = {**os.environ, **QUIET}
    env.pop("PREFECT_API_URL", None)
    one = subprocess.run(
        [DLLM, "run", *SMOKE, "--workdir", str(tmp_path / "one")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]

    shared = tmp_path / "shared"  # one folder both hosts see, as on a cluster's shared filesystem
    port = free_port()
    before = tx_bytes(B)
    nodes = []
    for rank, host in enumerate((A, B)):
        sets = [
            "--set",
            "train.nnodes=2",
            "--set",
            f"train.rdzv_endpoint={A[1]}:{port}",
            "--set",
            f"train.node_rank={rank}",
        ]
        log = open(tmp_path / f"node{rank}.log", "w")
        nodes.append(
            subprocess.Popen(
                on(host, [DLLM, "run", *SMOKE, *sets, "--workdir", str(shared)]),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, "GLOO_SOCKET_IFNAME": host[2]},
                start_new_session=True,
            )
        )
    try:
        codes = [p.wait(timeout=900) for p in nodes]
    finally:
        for p in nodes:
            stop_group(p)
        stop_namespaces(A[0], B[0])
    logs = "".join((tmp_path / f"node{r}.log").read_text()[-2500:] for r in (0, 1))
    assert codes == [0, 0], logs
    sent = tx_bytes(B) - before
    a, b = losses(tmp_path / "one"), losses(shared)
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(6))
    diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    print(
        f"[measured] 2 hosts ({A[1]}, {B[1]}) vs 1 process: max per-step loss difference {diff:.1e}; "
        f"{sent:,} bytes sent B -> A over the veth"
    )
    assert diff < 1e-5
    assert sent > 1_000_000  # the gradients' all-reduce crossed between the hosts, not a loopback
    layouts = [json.loads(p.read_text()).get("layout") for p in shared.rglob("model/dllm.json")]
    assert layouts and {layout["nodes"] for layout in layouts if layout} == {2}


def test_a_gpu_worker_on_another_host_trains_a_pipeline_submitted_here(hosts, tmp_path):
    A, B = hosts["A"], hosts["B"]
    prefect_port, mlflow_port = free_port(), free_port()
    api, mlflow_url = f"http://{A[1]}:{prefect_port}/api", f"http://{A[1]}:{mlflow_port}"
    env = stack_env(tmp_path, prefect_port, mlflow_port, **QUIET)
    make = ["make", "-o", "install", f"VENV={VENV}", f"DLLM_PREFECT_API={api}"]
    procs = []

    def start(host, args, name):
        log = tmp_path / f"{name}.log"
        procs.append(
            subprocess.Popen(
                on(host, args),
                cwd=ROOT,
                env=env,
                start_new_session=True,
                stdout=open(log, "w"),
                stderr=subprocess.STDOUT,
            )
        )
        return procs[-1], log

    try:
        refused = subprocess.run(
            [*make, "server", f"SERVER_HOST={A[1]}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert refused.returncode != 0 and "ALLOW_ANONYMOUS=1" in refused.stderr, refused.stderr[-2000:]
        server, server_log = start(A, [*make, "server", f"SERVER_HOST={A[1]}", "ALLOW_ANONYMOUS=1"], "server")
        # B asks across the veth: the servers are up and reachable from the other host
        probe = "import sys, urllib.request as u; [u.urlopen(x + '/health', timeout=2) for x in sys.argv[1:]]"
        deadline = time.time() + 240
        while (
            subprocess.run(on(B, [sys.executable, "-c", probe, api, mlflow_url]), capture_output=True).returncode != 0
        ):
            assert server.poll() is None and time.time() < deadline, server_log.read_text()[-3000:]
            time.sleep(2)
        deploy = subprocess.run(
            on(A, [*make, "deploy"]), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
        start(A, [*make, "worker-cpu"], "worker-cpu")
        start(B, [*make, "worker-gpu", "WORKER_NAME=host-b"], "worker-host-b")
        workdir = tmp_path / "work"
        overrides = ["pipeline.train_deployment=dllm-train/train-gpu", f"tracking.uri={mlflow_url}"]
        trigger = f"""
import json
from prefect.deployments import run_deployment
run = run_deployment("dllm-pipeline/smoke-gpu-training", timeout=900, parameters={{
    "workdir": {str(workdir)!r}, "overrides": {overrides!r}}})
print(json.dumps({{"state": run.state.type.value}}))
"""
        out = subprocess.run(
            on(A, [sys.executable, "-c", trigger]),
            cwd=ROOT,
            env={**env, "PREFECT_API_URL": api},
            capture_output=True,
            text=True,
            timeout=1000,
        )
        worker_b = (tmp_path / "worker-host-b.log").read_text()
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.strip().splitlines()[-1])["state"] == "COMPLETED", worker_b[-3000:]
        record = json.loads(next((workdir / "runs").glob("*.json")).read_text())
        assert record["status"] == "COMPLETED"
        stage = next(s for s in record["stages"] if s["name"] == "train[mdlm]")
        assert stage["status"] == "COMPLETED"
        # the training's flow run was taken by the worker on B and by no worker on A
        names = [
            line.split("Flow run '")[1].split("'")[0]
            for line in worker_b.splitlines()
            if "submitted to infrastructure" in line
        ]
        assert len(names) == 1, worker_b[-3000:]
        assert f"Flow run '{names[0]}'" not in (tmp_path / "worker-cpu.log").read_text()
        history = subprocess.run(
            on(
                A,
                [
                    sys.executable,
                    "-c",
                    f"from mlflow.tracking import MlflowClient; print(len(MlflowClient("
                    f"{mlflow_url!r}).get_metric_history({stage['mlflow_run_id']!r}, 'train/loss')))",
                ],
            ),
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert history.stdout.strip() == "30", history.stderr[-2000:]
        print(
            f"[measured] training flow run {names[0]!r} ran on host-b ({B[1]}); server on {A[1]}; "
            "30 train/loss values in A's MLflow"
        )
    finally:
        # the workers first (make's group: make and its prefect worker), then the servers; then anything left in
        # either host, e.g. a flow run a worker started in a session of its own
        for proc in reversed(procs):
            stop_group(proc)
        stop_namespaces(A[0], B[0])
