"""Two processes make the one-process GRPO update (docs/post-training.md, "The GRPO stage"): each rank holds half
of a step's groups, the gradients are summed over gloo, and the weights after two updates equal those of one
process that held every group."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from strategies import assemble_strategy
from strategies.models import build_model, tiny_model_config
from strategies.options import validate_config
from tasks.posttrain.update import Group, Policy, grpo_step
from tasks.training.runtime import OptimSettings, make_optimizer

GROUPS, G, MASK, EOS = 4, 3, 23, 22


def _spec():
    raw = yaml.safe_load(open("configs/sft-arithmetic.yaml"))
    raw["grpo"] = {"prompts_per_step": GROUPS, "group_size": G, "inner_updates": 2, "lr": 1e-2, "beta": 0.1}
    return validate_config(raw)


def _policy():
    model = build_model(tiny_model_config("llama", 24, 40, 16, 1, 2, None, None, False), seed=0).eval()
    reference = build_model(tiny_model_config("llama", 24, 40, 16, 1, 2, None, None, False), seed=0).eval()
    built = assemble_strategy("mdlm", {}, model, None, mask_token_id=MASK)
    return Policy(model, reference.requires_grad_(False), built.strategy, None, MASK, {}, "cpu", "one_step")


def _groups() -> list[Group]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(GROUPS):
        prompt = torch.randint(0, 20, (1, 5), generator=gen).repeat(G, 1)
        completion = torch.randint(0, 23, (G, 4), generator=gen)
        completion[:, 3] = EOS
        advantages = torch.randn(G, generator=gen)
        out.append(Group(prompt, completion, torch.ones(G, 4), advantages - advantages.mean(), [], [], {}, [], []))
    return out


def _run(rank: int | None, world: int, port: int, out: str | None = None):
    """One GRPO step (two inner updates) on this rank's groups; rank 0 (or the lone process) returns the weights
    and, given `out`, saves them there."""
    if rank is not None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    spec, policy, groups = _spec(), _policy(), _groups()
    opt, _ = make_optimizer(policy.model, OptimSettings(steps=10, lr=spec.grpo.lr, warmup_steps=0, schedule="constant"))
    mine = list(range(GROUPS)) if rank is None else [i for i in range(GROUPS) if i % world == rank]
    grpo_step(policy, opt, spec, [groups[i] for i in mine], step=0, indices=mine)
    weights = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    if rank is not None:
        dist.destroy_process_group()
    if rank == 0 and out:
        torch.save(weights, out)
    return weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_two_processes_make_the_one_process_update(tmp_path):
    alone = _run(None, 1, 0)
    port, saved = _free_port(), tmp_path / "rank0.pt"
    procs = [mp.get_context("spawn").Process(target=_run, args=(r, 2, port, str(saved))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        assert p.exitcode == 0
    shared = torch.load(saved, weights_only=True)
    before = _policy().model.state_dict()
    assert any(not torch.equal(before[k], alone[k]) for k in alone)  # the update moved the weights
    for k in alone:
        torch.testing.assert_close(shared[k], alone[k], rtol=0, atol=1e-6)
