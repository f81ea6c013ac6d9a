"""Test-wide environment: no telemetry, no hub, one torch thread per process."""

import os

for key, value in {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # one torch thread per process, this one and every process a test starts (a `dllm-flow run`, a server, torchrun's
    # workers, which get it already). The suite's models are tiny and its processes overlap (a run beside its
    # Prefect and MLflow servers, two ranks): with torch's default of a thread per core, a training whose two OpenMP
    # threads share the cores with any other busy process waits on its own spinning threads. Measured 2026-12-06
    # (docs/results/log.md): the smoke training, 150 steps, 4.8 s on two threads and 5.2 s on one on an idle
    # 2-core machine, but 115 s against 9.6 s beside one busy process
    "OMP_NUM_THREADS": "1",
}.items():
    os.environ.setdefault(key, value)
# every process this session starts inherits this mark, so the end-of-session check (pytest_sessionfinish below)
# finds those that outlived their test even once reparented to init or inside a test's network namespace
SESSION_MARK = "DLLM_TEST_SESSION"
if "PYTEST_XDIST_WORKER" not in os.environ:  # an xdist worker keeps its controller's mark, which checks at the end
    os.environ[SESSION_MARK] = f"{os.getpid()}-{os.urandom(6).hex()}"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def denoiser_strategies() -> list[str]:
    """The registered strategies whose trained model is the (wrapped) backbone itself (`trains == "denoiser"`),
    for tests that parametrize over every such strategy (a draft trains against a frozen target instead)."""
    from strategies import strategy_class
    from strategies.registry import REGISTRY

    return [name for name in sorted(REGISTRY) if strategy_class(name).trains == "denoiser"]


# A test that runs `dllm-flow` in this process gets the environment main() sets up for itself: a team server's
# login (credentials.apply_to_client), PREFECT_HOME under that test's workdir, Prefect's logging levels
# (flows/environment.prefect_env). None of it may outlive the test: every later test's subprocesses inherit
# os.environ. Leaked, a stale PREFECT_API_AUTH_STRING made `make deploy` answer 401, PREFECT_LOGGING_LEVEL=WARNING
# silenced the workers' "submitted to infrastructure" lines the deployment tests read, and a dead test's
# PREFECT_HOME sent a later test's client to a database without its flow run (whole-suite runs only).
@pytest.fixture(autouse=True)
def _environment_does_not_outlive_its_test():
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        os.environ.pop(key, None)
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


# ---------------------------------------------------------------- how `make test` spreads the suite over workers

# `make test TEST_WORKERS=N` runs the suite on N pytest-xdist workers (`--dist loadfile --no-loadscope-reorder`):
# each test file is one unit of work, run whole on one worker, so a module's fixtures (a trained model, a server,
# a pipeline run) are built once; the files are handed out in this order, the folders of the long tests first.
# (On 2 cores one process is faster: the long tests train or serve on both cores.)
KIND_ORDER = ("servers", "pipeline", "unit")


def pytest_collection_modifyitems(config, items):
    def kind(item) -> int:  # the folder under tests/ (tests/unit/dflash/ is unit)
        try:
            folder = Path(str(item.path)).relative_to(ROOT / "tests").parts[0]
        except ValueError:
            folder = Path(str(item.path)).parent.name
        return KIND_ORDER.index(folder) if folder in KIND_ORDER else len(KIND_ORDER)

    items.sort(key=kind)  # stable: file order and test order within a file are kept


@pytest.fixture(scope="session")
def tiny_spec():
    """A config small enough to prepare and train in seconds."""
    from dllm_common.config import validate_schema

    return validate_schema(
        {
            "pipeline": {"name": "t", "strategies": ["mdlm"]},
            "data": {"seq_len": 32, "max_documents": 4, "max_train_rows": 128, "max_val_rows": 16},
            "tokenizer": {"vocab_size": 320},
            "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 2},
            "train": {
                "steps": 12,
                "global_batch_size": 8,
                "micro_batch_size": 4,
                "lr": 3e-3,
                "warmup_steps": 2,
                "val_every": 4,
                "val_rows": 8,
                "log_every": 2,
                "checkpoint_every": 4,
            },
            "eval": {
                "val_rows": 8,
                "t_samples": 2,
                "num_samples": 1,
                "sample_length": 8,
                "sample_steps": 4,
                "sample_block_size": 4,
            },
        }
    )


@pytest.fixture(scope="session")
def prepared(tiny_spec, tmp_path_factory):
    from tasks.prepare_data import prepare_data

    workdir = tmp_path_factory.mktemp("prepared")
    return prepare_data(tiny_spec, str(workdir)), workdir


# ---------------------------------------------------------------- helpers for tests that start servers


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc, log: Path, seconds: int = 240) -> None:
    """Poll `url` until it answers 200; fail with the server's log if the process dies or time runs out."""
    import time
    import urllib.request

    deadline = time.time() + seconds
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            pass
        assert time.time() < deadline, f"{url} did not answer in {seconds} s\n" + log.read_text()[-4000:]
        time.sleep(1)


def stack_env(tmp_path: Path, prefect_port: int, mlflow_port: int, **extra: str) -> dict:
    """The environment `make server`, `make deploy` and the workers run with in the operations tests: the
    servers' state, ports and this venv's binaries under tmp_path, workers polling every 2 s, no PREFECT_API_URL
    inherited from the caller."""
    import os
    import sys

    env = {
        **os.environ,
        "DLLM_SERVER_DIR": str(tmp_path / "server"),
        "PREFECT_PORT": str(prefect_port),
        "MLFLOW_PORT": str(mlflow_port),
        "VENV_BIN": str(Path(sys.executable).parent),
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "PREFECT_HOME": str(tmp_path / "client-prefect-home"),
        "PREFECT_LOGGING_LEVEL": "INFO",
        **extra,
    }
    env.pop("PREFECT_API_URL", None)
    return env


def group_members(pgid: int) -> list[int]:
    """The live processes (zombies aside) of process group `pgid`; a session leader's pid is also its group's."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                pids.append(int(entry))
    return pids


def stop_group(proc, seconds: float = 30) -> None:
    """Stop a process started with start_new_session=True, and everything in its process group, which outlives
    the process itself when it does not wait for its children (make's prefect, mlflow's uvicorn): SIGTERM, then
    SIGKILL to what is left after `seconds`."""
    import signal
    import time

    def signal_group(sig) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    if proc.poll() is None or group_members(proc.pid):
        signal_group(signal.SIGTERM)
        deadline = time.monotonic() + seconds
        while (proc.poll() is None or group_members(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if proc.poll() is None or group_members(proc.pid):
            signal_group(signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """One Prefect API server (127.0.0.1, free port) for the CLI pipeline tests of the session.

    Without `PREFECT_API_URL` every `dllm-flow run` boots a temporary local API and migrates a fresh
    database (~20 s on 2 cores); the smoke fixture keeps testing that zero-config path, the other CLI
    runs point at this server instead. Stopped at the end of the session."""
    import subprocess
    import sys

    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    # the UI it serves calls this API (left unset, the UI would call the default port's)
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env["PREFECT_UI_API_URL"] = f"http://127.0.0.1:{port}/api"
    env.pop("PREFECT_API_URL", None)
    log = home / "server.log"
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        start_new_session=True,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}/api"
        wait_http(f"{url}/health", proc, log)
        yield url
    finally:
        stop_group(proc)


@pytest.fixture(scope="session")
def undisturbed(tmp_path_factory, prefect_api):
    """The signal and fault suites' pipeline run to its end without a fault: what every interrupted,
    killed or damaged run must reproduce once rerun."""
    from runkit import run

    workdir = tmp_path_factory.mktemp("undisturbed")
    code, _, err = run(workdir, api=prefect_api)
    assert code == 0, err[-3000:]
    return workdir


# ---------------------------------------------------------------- no process outlives the session

# helpers that live as long as the pytest process by design and exit with it
LIFELONG = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "_inductor.compile_worker")
NETNS_PREFIX = "dllm-"  # network namespaces tests make are named dllm-<host><pytest pid> (tests/servers/test_hosts.py)
_left_behind: list[str] = []


def _netns_pids() -> set[int]:
    """Processes inside the network namespaces this session made that still exist (none once deleted)."""
    import shutil
    import subprocess

    if shutil.which("ip") is None:
        return set()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip()]
    pids: set[int] = set()
    for name in names:
        if name.startswith(NETNS_PREFIX) and name.endswith(str(os.getpid())):
            out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
            pids.update(int(pid) for pid in out.split())
    return pids


def left_behind() -> dict[int, str]:
    """{pid: command line} of the processes this session started that still run: descendants of the pytest
    process, processes carrying its SESSION_MARK (reparented to init once their parent exited), and processes
    in its network namespaces; zombies and LIFELONG helpers aside."""
    import psutil

    me = psutil.Process()
    skip = {me.pid} | {p.pid for p in me.parents()}
    mark = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode() + b"\0"
    pids = {p.pid for p in me.children(recursive=True)} | _netns_pids()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in skip:
            try:
                if mark in Path(f"/proc/{entry}/environ").read_bytes():
                    pids.add(int(entry))
            except OSError:
                continue
    found = {}
    for pid in pids - skip:
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(proc.cmdline()) or proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if not any(helper in command for helper in LIFELONG):
            found[pid] = command
    return found


def pytest_sessionfinish(session, exitstatus):
    """Fail the run when a process a test started is still alive now, after every fixture's finalizer (the
    session's servers included) has run; list and kill them. A process still stopping gets 10 s."""
    import signal
    import time

    if hasattr(session.config, "workerinput"):  # an xdist worker: its controller's session checks
        return
    deadline = time.monotonic() + 10
    while (found := left_behind()) and time.monotonic() < deadline:
        time.sleep(0.5)
    if not found:
        return
    import psutil

    for pid, command in sorted(found.items()):
        try:
            parent = psutil.Process(pid).ppid()
        except psutil.NoSuchProcess:
            parent = "?"
        _left_behind.append(f"pid {pid} (parent {parent}): {command[:300]}")
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _left_behind:
        terminalreporter.section("processes left behind (the run fails; they were killed)", red=True, bold=True)
        for line in _left_behind:
            terminalreporter.write_line(line)
