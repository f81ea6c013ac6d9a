"""The program an export's model card shows under "Sampling without dllm-flow" (tasks/commands/snippets/): taken from
the exported README.md and run where dllm-flow's packages cannot be imported, it prints the tokens `dllm-flow generate
--temperature 0` prints for the same prompt, steps, block size, length and seed, for mdlm, idlm, hybrid and scdd
(plain, and time-conditioned with the other tempering and noise removal): several blocks, an EOS inside a later
block, the threshold and random-remasking settings."""

import ast
import contextlib
import io
import json
import runpy
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForCausalLM

from dllm_common.checkpoint import read_meta, write_checkpoint
from dllm_common.config import DLLMSection
from strategies.models import model_logits
from strategies.scdd.schedule import scdd_schedule
from tasks.commands.export import export_checkpoint
from tasks.commands.snippets import program
from tasks.evaluation.trained_model import checkpoint_tokenizer, load_trained_model
from tasks.train import model_dir, train

PROMPT = "To be, or not to be"  # 10 tokens: with 12 new ones inside the tiny model's 32 positions
SECTION = "## Sampling without dllm-flow"
# name → (strategy, its options where they differ from the defaults)
EXPORTS = {
    "mdlm": ("mdlm", {}),
    "idlm": ("idlm", {}),
    "hybrid": ("hybrid", {}),
    "scdd": ("scdd", {}),
    "scdd-timed": (
        "scdd",
        {
            "time_conditioning": True,
            "tempering": "weights",
            "noise_removal": "argmax",
            "schedule_peak": 0.3,  # a bump off centre: t^a (1 - t)^b is not symmetric in a and b
            "schedule_shape": 2.0,
        },
    ),
}
CHAT = {"mdlm"}  # exported as dialogue models (`chat` in dllm.json, a chat template in the tokenizer)
CHAT_TEMPLATE = "{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
# runs each (program, arguments) as __main__, with dllm-flow's packages unimportable; prints [stdout, stderr] of
# each as JSON
RUNNER = """
import contextlib, importlib.abc, io, json, runpy, sys

BLOCKED = {"strategies", "tasks", "flows", "dllm_common"}


class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the program must run without dllm-flow")
        return None


sys.meta_path.insert(0, Blocked())
assert not [m for m in sys.modules if m.partition(".")[0] in BLOCKED], "imported before the block"
outputs = []
for program, argv in json.loads(sys.argv[1]):
    sys.argv = [program, *argv]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        runpy.run_path(program, run_name="__main__")
    outputs.append([out.getvalue(), err.getvalue()])
print(json.dumps(outputs))
"""


@pytest.fixture(scope="module")
def exports(prepared, tiny_spec, tmp_path_factory):
    """{name: exported folder}: each strategy trained two steps through the train stage, then exported from a
    checkpoint whose weights got seeded noise (std 0.3) first. Two steps leave a tiny model repeating one token,
    where a sampler that ranks or schedules wrongly still prints the same text; the noise gives it varied
    proposals (and the time embedding a real effect), and the checkpoint keeps its record and digests. The `CHAT`
    exports are marked as dialogue models on the way."""
    data, _ = prepared
    workdir = tmp_path_factory.mktemp("snippet-work")
    (workdir / "elsewhere").mkdir()  # no store or MLflow database for the exports to find
    folders = {}
    for name, (strategy, options) in EXPORTS.items():
        spec = tiny_spec.model_copy(
            update={
                "train": tiny_spec.train.model_copy(update={"steps": 2, "val_every": 2, "checkpoint_every": 2}),
                "dllm": DLLMSection(overrides={strategy: options}),
            }
        )
        ckpt = model_dir(train(spec, strategy, data, str(workdir)))
        assert read_meta(ckpt)["options"].items() >= options.items()
        model = load_trained_model(ckpt, "cpu")
        noise = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.add_(0.3 * torch.randn(p.shape, generator=noise))
        tokenizer, meta = checkpoint_tokenizer(ckpt, model), read_meta(ckpt)
        if name in CHAT:  # a dialogue model: both samplers must encode the prompt through its chat template
            tokenizer.chat_template, meta["chat"] = CHAT_TEMPLATE, True
        noisy = write_checkpoint(workdir / f"noisy-{name}", model, tokenizer, meta)
        folders[name] = export_checkpoint(str(noisy), workdir / "exports" / name, workdir / "elsewhere")
    return folders


def card_program(folder: Path) -> str:
    """The python block of the card's "Sampling without dllm-flow" section."""
    section = (folder / "README.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("\n```\n", 1)[0] + "\n"


def run_blocked(jobs: list[tuple[str, list[str]]], where: Path) -> list[list[str]]:
    """Each (program text, arguments) saved as a file and run, in one fresh interpreter where importing strategies,
    tasks, flows or dllm_common fails, from `where` (outside the repository); what each printed: [stdout, stderr]."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "runner.py").write_text(RUNNER)
    runs = []
    for i, (text, argv) in enumerate(jobs):
        (where / f"program{i}.py").write_text(text)
        runs.append((f"program{i}.py", argv))
    proc = subprocess.run(
        [sys.executable, "-I", "runner.py", json.dumps(runs)], cwd=where, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


class _Recording:
    """The checkpoint's tokenizer as `dllm-flow generate` uses it, remembering the ids it decodes last (the
    generated ids, cut at EOS) and, for an EOS case, naming another token as EOS."""

    def __init__(self, tokenizer, eos: int | None, seen: dict):
        self._tokenizer, self._eos, self._seen = tokenizer, eos, seen

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __len__(self):
        return len(self._tokenizer)

    @property
    def eos_token_id(self):
        return self._tokenizer.eos_token_id if self._eos is None else self._eos

    def decode(self, ids, **kwargs):
        self._seen["ids"], self._seen["text"] = list(ids), self._tokenizer.decode(ids, **kwargs)
        return self._seen["text"]


@dataclass(frozen=True)
class Case:
    flags: tuple[str, ...]  # given to both
    cli: tuple[str, ...] = ()  # given to `dllm-flow generate` only ...
    settings: dict = field(default_factory=dict)  # ... and their counterpart in the export's generation_config.json
    eos: int | None = None  # another EOS id, in generation_config.json and for `dllm-flow generate`


def dllm_flow_generate(folder: Path, case: Case) -> tuple[list[int], str]:
    """(ids, text) of `dllm-flow generate --checkpoint FOLDER --prompt PROMPT --temperature 0 ...`, run as the
    command line runs it."""
    import tasks.evaluation.trained_model
    from flows.cli import main

    seen, real = {}, tasks.evaluation.trained_model.load_for_generation

    def load(ckpt, device, adapter=None, **kwargs):  # where= names the flag a misfit is reported against
        loaded = real(ckpt, device, adapter, **kwargs)
        return loaded._replace(tokenizer=_Recording(loaded.tokenizer, case.eos, seen))

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()):
        patch.setattr(tasks.evaluation.trained_model, "load_for_generation", load)
        assert main(generate_argv(folder, case)) == 0
    return seen["ids"], seen["text"]


def generate_argv(folder: Path, case: Case) -> list[str]:
    """The arguments of `dllm-flow` for a case."""
    argv = ["generate", "--checkpoint", str(folder), "--prompt", PROMPT, "--temperature", "0", "--device", "cpu"]
    return [*argv, *case.flags, *case.cli]


def edited(folder: Path, case: Case, where: Path) -> Path:
    """The export, or a copy at `where` whose generation_config.json carries the case's settings."""
    if not case.settings and case.eos is None:
        return folder
    shutil.copytree(folder, where)
    config = json.loads((where / "generation_config.json").read_text())
    config.update(case.settings)
    if case.eos is not None:
        config["eos_token_id"] = case.eos
    (where / "generation_config.json").write_text(json.dumps(config))
    return where


def first_new_token_after(ids: list[int], start: int) -> int:
    """The first index ≥ `start` whose token does not occur before it: with that token as EOS, the output stops
    there (ids[:k])."""
    found = [k for k in range(start, len(ids)) if ids[k] not in ids[:k]]
    assert found, f"no token of {ids} past {start} is new: the EOS case needs one"
    return found[0]


MULTI_BLOCK = ("--steps", "8", "--block-size", "4", "--max-new-tokens", "12")  # 3 blocks of 4, 3 steps each
UNEVEN = ("--steps", "7", "--block-size", "5", "--max-new-tokens", "12")  # blocks 5, 5, 2; 3 steps each
VARIANTS = {  # a third case per export: the other sampler settings its program reads
    "mdlm": Case(MULTI_BLOCK + ("--seed", "7"), ("--remasking", "random"), {"dllm_remasking": "random"}),
    "idlm": Case(UNEVEN, ("--threshold", "0.2"), {"dllm_threshold": 0.2}),
    "hybrid": Case(UNEVEN, ("--threshold", "0.2"), {"dllm_threshold": 0.2}),
    "scdd": Case(MULTI_BLOCK + ("--seed", "7"), ("--remasking", "random"), {"dllm_remasking": "random"}),
    "scdd-timed": Case(("--steps", "5", "--max-new-tokens", "9", "--seed", "3")),
}


@dataclass
class Compared:
    plain: list[int]  # `dllm-flow generate`'s ids in the first case
    eos_at: int  # where the EOS case put its EOS
    expected: list[list[int]]  # `dllm-flow generate`'s ids, case by case
    got: list[list[int]]  # the program's
    text: tuple[str, str]  # the text of the first case: dllm-flow's, the program's
    ran: list[list[str]]  # the `dllm-flow` arguments of each case
    stated: list[list[str]] = field(default_factory=list)  # the `dllm-flow` arguments the program says match it


@pytest.fixture(scope="module")
def compared(exports, tmp_path_factory) -> dict[str, Compared]:
    """Per export, three cases (several blocks; an EOS inside a later block; the variant of `VARIANTS`) through
    `dllm-flow generate` and through the card's program, the programs all run in one interpreter without
    dllm-flow (the first case twice: ids, then text)."""
    where = tmp_path_factory.mktemp("outside")
    found, jobs = {}, []
    for name, folder in exports.items():
        base = Case(UNEVEN if name == "idlm" else MULTI_BLOCK)
        plain, text = dllm_flow_generate(folder, base)
        assert len(plain) == 12 and len(set(plain)) >= 3, plain  # no EOS, and varied tokens
        # past the first block; scdd decodes in one block, and with `tempering: weights` at temperature 0 its
        # canvas collapses onto the argmax (docs/strategies.md §11.5): its new tokens come early
        k = first_new_token_after(plain, 1 if name == "scdd-timed" else 5)
        cases = [base, Case(base.flags, eos=plain[k]), VARIANTS[name]]
        expected = [plain] + [dllm_flow_generate(folder, c)[0] for c in cases[1:]]
        found[name] = Compared(plain, k, expected, [], (text, ""), [generate_argv(folder, c) for c in cases])
        program_text = card_program(folder)
        for i, case in enumerate(cases):
            jobs.append(
                (program_text, [str(edited(folder, case, where / f"{name}-{i}")), PROMPT, *case.flags, "--ids"])
            )
        jobs.append((program_text, [str(folder), PROMPT, *base.flags]))
    outputs = iter(run_blocked(jobs, where / "run"))
    for result in found.values():  # in the order the jobs were queued
        printed = [next(outputs) for _ in result.expected]
        result.got = [json.loads(out) for out, _ in printed]
        result.stated = [_stated_command(err) for _, err in printed]
        result.text = (result.text[0], next(outputs)[0])
    return found


@pytest.mark.parametrize("name", list(EXPORTS))
def test_the_cards_program_prints_what_dllm_flow_generate_prints(name, compared):
    result = compared[name]
    print(f"\n{name}: dllm-flow {result.expected}\n{name}: program   {result.got}")
    assert result.expected[1] == result.plain[: result.eos_at]  # the EOS case stops at the EOS, by hand
    assert result.got == result.expected
    assert result.text[1] == result.text[0] + "\n"


@pytest.mark.parametrize("name", list(EXPORTS))
def test_the_program_names_the_dllm_flow_command_it_matches(name, compared):
    """dllm-flow's defaults are not the export's generation_config.json: the program says on stderr which
    `dllm-flow generate` command prints its tokens, and that is the one the test ran (the folder aside)."""
    result = compared[name]
    unread = ("block_size",) if EXPORTS[name][0] == "scdd" else ()  # scdd decodes the continuation in one piece
    stated, ran = ([_cli_settings(argv, unread) for argv in both] for both in (result.stated, result.ran))
    assert stated == ran


def _stated_command(stderr: str) -> list[str]:
    """The arguments after `dllm-flow` of the program's "same tokens as: dllm-flow ..." line."""
    lines = [line for line in stderr.splitlines() if line.startswith("same tokens as: ")]
    assert len(lines) == 1, stderr
    words = shlex.split(lines[0].removeprefix("same tokens as: "))
    assert words[0] == "dllm-flow", lines
    return words[1:]


def _cli_settings(argv: list[str], unread: tuple[str, ...]) -> dict:
    """What `dllm-flow` parses from the arguments, but the checkpoint folder, the device and the `unread` ones."""
    from flows.cli import build_parser

    left_out = ("checkpoint", "device", *unread)
    return {k: v for k, v in vars(build_parser().parse_args(argv)).items() if k not in left_out}


def test_the_runner_blocks_dllm_flow(tmp_path):
    """The equality checks above would catch a program that needs dllm-flow."""
    with pytest.raises(AssertionError, match="dllm_common is blocked: the program must run without dllm-flow"):
        run_blocked([("import dllm_common\n", [])], tmp_path)


@pytest.mark.parametrize("name", list(EXPORTS))
def test_the_card_shows_the_strategys_program_self_contained(name, exports, tmp_path):
    folder = exports[name]
    strategy = EXPORTS[name][0]
    text = card_program(folder)
    found = program(strategy)
    assert text == found.text  # verbatim
    card = (folder / "README.md").read_text()
    assert f"{SECTION}\n\n{found.summary}\n\nSave it as `{strategy}.py`" in card
    assert f" {strategy} export of dllm-flow with torch and transformers alone" in found.summary
    assert "--temperature 0" in found.summary and ("--seed" in found.summary) == (strategy == "scdd")
    imported = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            imported |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module.partition(".")[0])
    assert imported - set(sys.stdlib_module_names) == {"torch", "transformers"}
    # what the user copies is lint-clean under the repository's own settings, as tasks/commands/snippets/ is
    path = tmp_path / f"{strategy}.py"
    path.write_text(text)
    ruff = Path(sys.executable).parent / "ruff"
    config = ["--config", str(ROOT / "pyproject.toml")]
    for check in (["check", *config, str(path)], ["format", "--check", *config, str(path)]):
        proc = subprocess.run([str(ruff), *check], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_program_for_a_strategy_without_one():
    assert program("dflash") is None and program("no-such-strategy") is None
    hybrid = program("hybrid").text  # only what it uses of the shared parts
    assert "def fill_window(" in hybrid and "def absorbing_sample(" not in hybrid
    assert "from common import" not in hybrid and "from absorbing import" not in hybrid


def test_the_time_embedding_rebuilt_outside_dllm_flow_is_the_trained_one(exports):
    """transformers leaves the time embedding out of a time-conditioned scdd model; the program rebuilds it from
    the weight files and its logits are dllm-flow's at every noise level."""
    folder = exports["scdd-timed"]
    _, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert sorted(info["unexpected_keys"]) == [
        f"dllm_time_embedding.mlp.{i}.{p}" for i in (0, 2) for p in ("bias", "weight")
    ]
    snippet = runpy.run_path(str(_saved(card_program(folder), folder.parent / "scdd_program.py")), run_name="card")
    model, tokenizer, settings = snippet["load_export"](folder)
    weights = snippet["read_time_embedding"](folder)
    ours = load_trained_model(folder, "cpu")
    mask = settings["mask_token_id"]
    x = torch.tensor([tokenizer(PROMPT, add_special_tokens=False)["input_ids"] + [mask] * 6])
    with torch.no_grad():
        untimed = snippet["denoise"](model, x, 0.5, settings, None)
        for t in (1.0, 0.5, 0.001):
            theirs = snippet["denoise"](model, x, t, settings, weights)
            expected = model_logits(ours, {"input_ids": x}, time=torch.tensor([t])).float()
            expected[..., mask] = float("-inf")
            assert torch.allclose(theirs, expected, atol=1e-5), (theirs - expected).abs().nan_to_num().max()
            if t == 0.5:
                assert (theirs - untimed).nan_to_num().abs().max() > 0.1  # the time embedding matters here


def _saved(text: str, path: Path) -> Path:
    path.write_text(text)
    return path


def test_a_dialogue_export_prompts_through_its_chat_template(exports, tmp_path):
    """The export says which models are dialogue models, and the program then encodes the prompt as the template
    renders it (the equality above holds for such a model too: `CHAT`)."""
    for name, folder in exports.items():
        assert json.loads((folder / "generation_config.json").read_text())["dllm_chat"] is (name in CHAT)
    folder = exports["mdlm"]
    snippet = runpy.run_path(str(_saved(card_program(folder), tmp_path / "mdlm_program.py")), run_name="card")
    _, tokenizer, settings = snippet["load_export"](folder)
    by_hand = tokenizer(f"Q: {PROMPT}\nA:", add_special_tokens=False)["input_ids"]
    assert snippet["prompt_ids"](tokenizer, PROMPT, settings) == by_hand
    assert by_hand != tokenizer(PROMPT, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("ratio,shape,peak", [(0.1, 1.0, 0.5), (0.2, 2.0, 0.3), (0.05, 4.0, 0.8)])
def test_the_scdd_programs_schedule_is_dllm_flows(ratio, shape, peak, tmp_path):
    """Bit for bit, off-centre bumps included: the program compares these masses with random draws."""
    snippet = runpy.run_path(str(_saved(program("scdd").text, tmp_path / "scdd_program.py")), run_name="card")
    options = {"uniform_ratio": ratio, "schedule_shape": shape, "schedule_peak": peak}
    for t in torch.linspace(1.0, 1e-3, 9, dtype=torch.float64):
        theirs = snippet["noise_schedule"](t[None], options)
        ours = scdd_schedule(t[None], max_ratio=ratio, gamma_shape=shape, t_peak=peak)
        fields = {"clean": ours.clean_mass, "uniform": ours.uniform_mass, "absorbed": ours.absorbed_mass}
        assert theirs == {name: float(mass) for name, mass in {**fields, "gamma": ours.gamma}.items()}
