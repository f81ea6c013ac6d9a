"""Bad inputs caught when the config is loaded (issue 41): one line naming what to change, before any stage runs and
before anything is published. A YAML alias bomb, a prompt of megabytes, a tracking server that refuses the login
(and a credentials file others can read), a data.seq_len no model holds, dllm.overrides for a strategy the pipeline
does not train, and a pipeline.name MLflow's registry would refuse."""

import base64
import http.server
import json
import threading
import time
import tracemalloc

import pytest
from conftest import ROOT

from dllm_common import config as pipeline_config
from dllm_common.config import ALIAS_EXPANSION_LIMIT, MAX_CHARS_PER_TOKEN, MAX_SEQ_LEN, ConfigError
from strategies.options import load_config, validate_config

SMOKE = str(ROOT / "configs/smoke.yaml")  # data.seq_len 64, a tiny model


def _spec(strategies=("mdlm",), dllm=None, **sections):
    return {"pipeline": {"strategies": list(strategies)}, "data": {"seq_len": 64}, "dllm": dllm or {}, **sections}


def _cli(capsys, *argv) -> tuple[int, str]:
    from flows.cli import main

    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err


# ---------------------------------------------------------------- 1. a YAML alias bomb


def _bomb(path, levels=9):
    lines = ["pipeline: {name: bomb}", "x:", "  a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefghij", "bcdefghijk"[: levels - 1]):
        lines.append(f"  {name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_yaml_alias_bomb_is_refused_in_milliseconds_without_expanding_it(tmp_path, capsys):
    bomb = _bomb(tmp_path / "bomb.yaml")
    assert bomb.stat().st_size < 1024
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        load_config(bomb)
    took = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert took < 0.5 and peak < 5_000_000, (took, peak)  # 65 s and 3.5 GB before it was sized, not expanded
    assert str(err.value) == (
        f"config file {bomb}: its YAML aliases would expand it to 926177145 values and characters, more than "
        f"{ALIAS_EXPANSION_LIMIT} beyond what is written (&h on line 10, 91474282 of them, is repeated by 9 aliases); "
        "write the repeated parts out instead of nesting aliases"
    )
    code, out = _cli(capsys, "validate", str(bomb))
    assert (
        code == 2 and out.startswith(f"dllm-flow: error: config file {bomb}: its YAML aliases") and out.count("\n") == 1
    ), out
    flow = "{" + ", ".join(bomb.read_text().split("x:\n", 1)[1].strip().replace("  ", "").splitlines()) + "}"
    with pytest.raises(ConfigError, match=r"^override 'dllm\.x=.*: its YAML aliases would expand it"):
        pipeline_config.parse_override(f"dllm.x={flow}")  # --set takes YAML too


def test_an_alias_of_itself_and_deep_nesting_are_one_line_each(tmp_path):
    looped = tmp_path / "loop.yaml"
    looped.write_text("pipeline: &a {name: loop, strategies: [mdlm], more: *a}\n")
    with pytest.raises(ConfigError) as err:
        pipeline_config.read_yaml(looped)
    assert str(err.value) == (
        f"config file {looped}: the anchor &a (line 1) holds an alias of itself (*a), which would expand forever; "
        "write the value out"
    )
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nests its lists or mappings too deeply to read"):
        pipeline_config.read_yaml(deep)


def test_anchors_a_config_reuses_still_load(tmp_path):
    reused = tmp_path / "reused.yaml"
    reused.write_text(
        "pipeline: {name: reused, strategies: [mdlm, scdd]}\n"
        "eval:\n  prompts: &prompts [To be, My lord]\n  overrides:\n    scdd: &hot {temperature: 1.3}\n"
        "    mdlm: *hot\n"
        "data: {seq_len: 64}\n"
    )
    spec = load_config(reused)
    assert spec.eval.overrides["mdlm"].temperature == 1.3 and spec.eval.prompts == ("To be", "My lord")


# ---------------------------------------------------------------- 2. a prompt of megabytes


def test_a_prompt_no_context_can_hold_is_refused_at_load_by_its_characters(tmp_path, capsys):
    limit = 64 * MAX_CHARS_PER_TOKEN
    huge = "x" * 50_000_000  # 7.8 GB and an aborted tokenizer (exit 134) once it reached the evaluation
    started = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        validate_config(_spec(eval={"prompts": ["To be", huge]}))
    assert time.perf_counter() - started < 2
    assert str(err.value).splitlines()[1] == (
        f"  eval.prompts[1] is 50000000 characters, more than {limit} (the model's context (data.seq_len) of 64 "
        f"positions × {MAX_CHARS_PER_TOKEN} characters, more than any token holds): it cannot fit; shorten it"
    )
    validate_config(_spec(eval={"prompts": ["To be", "x" * limit]}))  # the tokenized prompt is checked later
    config = tmp_path / "long-prompt.yaml"
    config.write_text(f"pipeline: {{name: p}}\ndata: {{seq_len: 64}}\neval:\n  prompts: [ok, {'y' * 100_000}]\n")
    code, out = _cli(capsys, "validate", str(config))
    assert code == 2 and out.splitlines()[1].startswith("  eval.prompts[1] is 100000 characters, more than 2048"), out


def test_a_pretrained_models_context_bounds_the_prompts_and_the_rows(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 128}))
    pretrained = {"kind": "pretrained", "path": str(folder)}
    with pytest.raises(ConfigError) as err:
        pipeline_config.validate_schema({"model": pretrained, "eval": {"prompts": ["z" * (128 * 32 + 1)]}})
    assert "eval.prompts[0] is 4097 characters, more than 4096 (the model's context (max_position_embeddings)" in str(
        err.value
    )
    with pytest.raises(ConfigError) as err:
        pipeline_config.validate_schema({"model": pretrained, "data": {"seq_len": 256}})
    assert str(err.value).splitlines()[1] == (
        f"  data.seq_len (256) is more than model.path {str(folder)!r} holds (its max_position_embeddings is 128); "
        "lower data.seq_len to at most 128"
    )
    pipeline_config.validate_schema({"model": pretrained, "data": {"seq_len": 128}})
    hub = {"kind": "pretrained", "path": "some/hub-model"}  # not readable here: bounded by MAX_SEQ_LEN
    pipeline_config.validate_schema({"model": hub, "data": {"seq_len": 4096}, "eval": {"prompts": ["z" * 100_000]}})


# ---------------------------------------------------------------- 3. a tracking server that refuses the login


@pytest.fixture
def login_server():
    """A tiny MLflow stand-in: /health answers anyone (as MLflow's basic-auth app does), the API only team:right."""
    good = "Basic " + base64.b64encode(b"team:right-password").decode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.startswith("/health") or self.headers.get("Authorization") == good:
                body = b"{}"
                self.send_response(200)
            else:
                body = b"You are not authenticated. Please see the documentation ..."
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def no_login(monkeypatch):
    for key in (
        "DLLM_SERVER_USER",
        "DLLM_SERVER_PASSWORD",
        "DLLM_SERVER_AUTH_FILE",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_TOKEN",
        "PREFECT_API_AUTH_STRING",
    ):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


def _refused_login(uri: str, who: str) -> str:
    return (
        f"dllm-flow: error: tracking.uri {uri}: the MLflow server refused the login {who}; set DLLM_SERVER_USER and "
        "DLLM_SERVER_PASSWORD, or DLLM_SERVER_AUTH_FILE (one line USER:PASSWORD, mode 0600), to a login it accepts "
        '(docs/operations.md, "Credentials")\n'
    )


@pytest.mark.parametrize(
    "login, who",
    [
        ({}, "(no credentials are set)"),
        (
            {"DLLM_SERVER_USER": "team", "DLLM_SERVER_PASSWORD": "wrong-password"},
            "of user 'team' (a wrong password or an unknown user)",
        ),
    ],
    ids=["no-login", "wrong-password"],
)
def test_a_refused_login_is_one_line_naming_the_variables_in_seconds(
    login_server, no_login, tmp_path, capsys, login, who
):
    for key, value in login.items():
        no_login.setenv(key, value)
    workdir = tmp_path / "w"
    started = time.monotonic()
    code, err = _cli(capsys, "run", SMOKE, "--set", f"tracking.uri={login_server}", "--workdir", str(workdir))
    assert code == 2 and time.monotonic() - started < 5, err  # ~20 s and MLflow's raw 401 text before
    assert err == _refused_login(login_server, who)
    assert not workdir.exists()  # refused before the workdir, the Prefect API or any stage


def test_the_right_login_passes_the_check(login_server, no_login):
    from dllm_common.tracking import check_tracking_server

    no_login.setenv("MLFLOW_TRACKING_USERNAME", "team")
    no_login.setenv("MLFLOW_TRACKING_PASSWORD", "right-password")
    check_tracking_server(login_server)


def test_a_credentials_file_others_can_read_is_refused(no_login, tmp_path, capsys):
    from dllm_common import credentials

    secret = tmp_path / "login"
    secret.write_text("team:right-password\n")
    secret.chmod(0o644)
    no_login.setenv("DLLM_SERVER_AUTH_FILE", str(secret))
    code, err = _cli(capsys, "validate", SMOKE)
    assert code == 2 and err == (
        f"dllm-flow: error: DLLM_SERVER_AUTH_FILE={secret} is open to group or others (mode 0644) and holds the "
        f"server's password; chmod 600 {secret}\n"
    )
    secret.chmod(0o640)
    with pytest.raises(ConfigError, match=r"\(mode 0640\)"):
        credentials.read({"DLLM_SERVER_AUTH_FILE": str(secret)})
    secret.chmod(0o600)  # as docs/operations.md writes it
    assert credentials.read({"DLLM_SERVER_AUTH_FILE": str(secret)}) == ("team", "right-password")


# ---------------------------------------------------------------- 4. a data.seq_len no model holds


def test_a_seq_len_no_model_holds_is_refused_by_validate(capsys):
    code, err = _cli(capsys, "validate", SMOKE, "--set", "data.seq_len=10000000")
    assert code == 2 and err.splitlines()[1] == (
        f"  data.seq_len (10000000) is more than {MAX_SEQ_LEN} positions, the longest training row dllm-flow accepts; "
        "lower data.seq_len"
    ), err
    assert len(err.splitlines()) == 2, err
    pipeline_config.validate_schema({"data": {"seq_len": MAX_SEQ_LEN}})


# ---------------------------------------------------------------- 5. overrides of a strategy the pipeline lacks


def test_dllm_overrides_of_a_strategy_not_in_the_pipeline_are_refused(capsys):
    with pytest.raises(ConfigError) as err:
        validate_config(_spec(["mdlm"], {"overrides": {"block_diffusion": {"block_size": 16}}}))
    assert str(err.value) == (
        "dllm.overrides.block_diffusion: 'block_diffusion' is not in pipeline.strategies ['mdlm']; remove the entry "
        "or add the strategy"
    )
    code, err = _cli(capsys, "validate", SMOKE, "--set", "dllm.overrides.hybrid.block_size=8")
    assert code == 2 and err.startswith("dllm-flow: error: dllm.overrides.hybrid: 'hybrid' is not in pipeline"), err
    with pytest.raises(ConfigError, match=r"eval.overrides.scdd: 'scdd' is not in pipeline.strategies \['mdlm'\]"):
        validate_config(_spec(["mdlm"], eval={"overrides": {"scdd": {"temperature": 1.3}}}))
    validate_config(_spec(["mdlm", "block_diffusion"], {"overrides": {"block_diffusion": {"block_size": 16}}}))


# ---------------------------------------------------------------- 6. a pipeline.name nothing can be named after


@pytest.mark.parametrize(
    "name, fixed",
    [("team/exp", "team-exp"), ("a:b", "a-b"), ("..hidden", "hidden"), ("my run@v2", "my-run-v2"), ("", "dllm")],
)
def test_a_pipeline_name_mlflow_would_refuse_after_training_is_refused_at_load(capsys, name, fixed):
    with pytest.raises(ConfigError) as err:
        validate_config({**_spec(), "pipeline": {"name": name, "strategies": ["mdlm"]}})
    assert str(err.value).splitlines()[1] == (
        f"  pipeline.name {name!r} must be 1 to 100 letters, digits, '.', '_' or '-', starting with a letter or "
        f"digit: it names the MLflow experiment, runs and registered models (NAME-STRATEGY); e.g. {fixed!r}"
    )


def test_pipeline_names_that_are_safe_everywhere_are_kept(capsys):
    for name in ("smoke", "dflash-smollm2", "Run_2.1", "x" * 100):
        validate_config({**_spec(), "pipeline": {"name": name, "strategies": ["mdlm"]}})
    code, err = _cli(capsys, "validate", SMOKE, "--set", "pipeline.name=team/exp")
    assert code == 2 and "pipeline.name 'team/exp' must be 1 to 100 letters" in err, err


def test_a_new_draft_too_deep_for_the_embedded_target_is_refused_at_load(capsys):
    """Both depths are in the config: refused before the target is pretrained (it failed in cache_target)."""
    code, err = _cli(
        capsys,
        "validate",
        str(ROOT / "configs/dflash.yaml"),
        "--set",
        "model.num_layers=2",
        "--set",
        "dflash.pretrain.num_layers=2",
    )
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("dllm-flow: error: model.num_layers (2) vs dflash.pretrain.num_layers: a 2-layer draft")
    assert "needs a target with at least 5 layers (got 2)" in err and "dflash.target_layer_ids" in err
    ok = ["--set", "model.num_layers=2", "--set", "dflash.pretrain.num_layers=5"]
    assert _cli(capsys, "validate", str(ROOT / "configs/dflash.yaml"), *ok)[0] == 0
    own = [
        "--set",
        "model.num_layers=2",
        "--set",
        "dflash.pretrain.num_layers=2",
        "--set",
        "dflash.target_layer_ids=[0,1]",
    ]
    assert _cli(capsys, "validate", str(ROOT / "configs/dflash.yaml"), *own)[0] == 0  # layers the user chose
