"""Multi-node placement: which node this is and where node 0 waits, from the config or the scheduler's
environment, the torchrun command of one node, and the Kubernetes / Slurm examples that use them. The
two-node training itself is tests/pipeline/test_distributed.py::test_two_nodes_of_one_process_train_like_one_process."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from dllm_common.config import ConfigError, TrainConfig, apply_overrides, read_yaml, validate_schema
from tasks.training.distributed import NODE_RANK_ENV, node_rank, rendezvous, torchrun_command


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*NODE_RANK_ENV, "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def two_nodes(**extra) -> TrainConfig:
    return TrainConfig(global_batch_size=16, micro_batch_size=4, nnodes=2, **extra)


@pytest.mark.parametrize("name", NODE_RANK_ENV)
def test_the_node_rank_comes_from_the_schedulers_environment(clean_env, name):
    clean_env.setenv(name, "1")
    assert node_rank(two_nodes()) == 1
    assert node_rank(two_nodes(node_rank=0)) == 0  # the config wins
    assert node_rank(TrainConfig()) == 0  # one node: always 0, whatever the environment says


def test_an_unknown_or_impossible_node_rank_is_one_clear_error(clean_env):
    with pytest.raises(ConfigError, match="train.nnodes is 2 but this node's rank is unknown: set train.node_rank"):
        node_rank(two_nodes())
    clean_env.setenv("JOB_COMPLETION_INDEX", "2")
    with pytest.raises(ConfigError, match=r"\$JOB_COMPLETION_INDEX is 2, but train.nnodes is 2"):
        node_rank(two_nodes())
    with pytest.raises(ValueError, match=r"train.node_rank \(2\) must be below train.nnodes \(2\)"):
        two_nodes(node_rank=2)
    with pytest.raises(ValueError, match="train.rdzv_endpoint .* must be HOST:PORT"):
        two_nodes(rdzv_endpoint="no-port")
    with pytest.raises(ValueError, match=r"multiple of train.nnodes × train.nproc_per_node × train.micro_batch_size"):
        TrainConfig(global_batch_size=8, micro_batch_size=8, nnodes=2)  # 8 rows cannot be 2 × 8


def test_the_rendezvous_is_node_zeros_endpoint(clean_env):
    with pytest.raises(ConfigError, match="set train.rdzv_endpoint to HOST:PORT of node 0"):
        rendezvous(two_nodes())
    clean_env.setenv("MASTER_ADDR", "node-a")
    clean_env.setenv("MASTER_PORT", "29400")
    assert rendezvous(two_nodes()) == ("node-a", 29400)
    assert rendezvous(two_nodes(rdzv_endpoint="trainer-0.trainer:29500")) == ("trainer-0.trainer", 29500)


def test_one_nodes_torchrun_command(clean_env):
    cmd = torchrun_command(two_nodes(rdzv_endpoint="h:29500", node_rank=1, nproc_per_node=2), Path("a.json"))
    assert cmd[1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--nnodes=2",
        "--node_rank=1",
        "--master_addr=h",
        "--master_port=29500",
        "-m",
        "tasks.training.torchrun_entry",
        "a.json",
    ]
    assert "--standalone" in torchrun_command(
        TrainConfig(nproc_per_node=2, global_batch_size=8, micro_batch_size=4), Path("a")
    )


def test_the_kubernetes_template_is_one_pod_per_node_with_a_rendezvous_at_pod_zero():
    docs = list(yaml.safe_load_all((ROOT / "deployments/multinode/kubernetes-train.yaml").read_text()))
    service, job = docs
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    container = spec["template"]["spec"]["containers"][0]
    sets = dict(a.split("=", 1) for a in container["args"] if a != "--set")
    nodes, gpus = int(sets["train.nnodes"]), int(sets["train.nproc_per_node"])
    assert spec["completions"] == spec["parallelism"] == nodes
    assert (
        container["resources"]["requests"]["nvidia.com/gpu"]
        == gpus
        == container["resources"]["limits"]["nvidia.com/gpu"]
    )
    host, port = sets["train.rdzv_endpoint"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{spec['template']['spec']['subdomain']}"
    assert service["metadata"]["name"] == spec["template"]["spec"]["subdomain"]
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    # the overrides are valid against a real pipeline config
    raw = apply_overrides(read_yaml(ROOT / "configs/compare.yaml"), [f"{k}={v}" for k, v in sets.items()])
    raw["train"]["global_batch_size"] = nodes * gpus * raw["train"]["micro_batch_size"]
    assert validate_schema(raw).train.world_size == nodes * gpus


def test_the_slurm_example_is_valid_bash_reading_the_allocation():
    script = ROOT / "deployments/multinode/slurm-train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert re.search(r"train\.nnodes=\"\$SLURM_NNODES\"", text) and 'train.rdzv_endpoint="$MASTER:29500"' in text
    assert "#SBATCH --ntasks-per-node=1" in text


def test_multi_node_trainings_are_not_fanned_out():
    raw = apply_overrides(read_yaml(ROOT / "configs/smoke.yaml"), ["train.nnodes=2", "pipeline.max_parallel=2"])
    raw["train"]["global_batch_size"] = 16
    with pytest.raises(ConfigError, match="would share node 0's rendezvous port"):
        validate_schema(raw)
