"""`grpokit eval --server URL` and `grpokit report RUN --server URL` when the server cannot sample for
them (down, or another tokenizer): one line, exit code 2; and the http://HOST:PORT/v1 URL that
`grpokit serve-policy` prints is taken wherever a server URL is (those commands, rollout_server_urls)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from grpokit.cli import main
from grpokit.serve.policy import PolicyServer
from tests.helpers import TINY_RUN_VALUES
from tests.train.helpers import tiny_config

pytestmark = pytest.mark.loopback


def _quiet(_: str) -> None:
    """A server's log, unread."""


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A server of the tiny run's policy (model=tiny: the tokenizer `grpokit eval` loads for it)."""
    from grpokit.config.plan import eval_plan
    from grpokit.train.eval_run import policy_engine

    engine, _ = policy_engine(eval_plan(tiny_config(tmp_path_factory.mktemp("tiny"))))
    with PolicyServer(engine, "tiny", log=_quiet) as running:
        yield running


@pytest.fixture
def qwen_server(engine):
    """A server of another model, whose tokenizer is not the tiny run's."""
    with PolicyServer(engine, "tiny-qwen", log=_quiet) as running:
        yield running


@pytest.fixture
def dead() -> str:
    """The URL of a port nothing listens on."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{closed.getsockname()[1]}"


def _command(command: str, tmp_path: Path, server: str) -> list[str]:
    """`grpokit eval CONFIG --server URL`, or `grpokit report RUN --server URL --samples 2` of a run
    directory holding that config and one metrics row: the tiny run's values."""
    values = dict(task="addition", model="tiny", seed=3) | TINY_RUN_VALUES
    if command == "eval":
        (tmp_path / "eval.yaml").write_text(yaml.safe_dump(values))
        return ["eval", str(tmp_path / "eval.yaml"), "--server", server]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(values | {"output_dir": str(run)}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    return ["report", str(run), "--server", server, "--samples", "2"]


def _one_line(capsys, command: str) -> str:
    """The error line `grpokit COMMAND` printed (no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[0]
    prefix = f"grpokit {command}: error: "
    assert line.startswith(prefix), err
    return line.removeprefix(prefix)


@pytest.mark.parametrize("command", ["eval", "report"])
def test_a_server_that_is_down_is_one_line_and_exit_code_2(command, tmp_path, dead, capsys):
    assert main(_command(command, tmp_path, f"{dead}/v1")) == 2
    said = _one_line(capsys, command)
    assert said.startswith(f"rollout server {dead} cannot be reached (ConnectError: ")
    assert said.endswith("is `grpokit serve-policy` running there?")


@pytest.mark.parametrize("command", ["eval", "report"])
def test_a_server_with_another_tokenizer_is_one_line_and_exit_code_2(command, tmp_path, qwen_server, capsys):
    assert main(_command(command, tmp_path, qwen_server.url)) == 2
    said = _one_line(capsys, command)
    url = qwen_server.url.rstrip("/")
    assert said.startswith(f"rollout server {url} serves 'tiny-qwen' with another tokenizer (vocabulary 470")
    assert said.endswith("serve the trainer's model (grpokit serve-policy MODEL)")


def test_eval_takes_the_v1_url_serve_policy_prints(tmp_path, tiny_server, capsys):
    """The figures sampled through http://HOST:PORT/v1 are those through http://HOST:PORT."""
    base = tiny_server.url.rstrip("/")
    assert main(_command("eval", tmp_path, base)) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(_command("eval", tmp_path, f"{base}/v1")) == 0
    assert json.loads(capsys.readouterr().out) == plain and "accuracy" in plain


def test_report_takes_the_v1_url_serve_policy_prints(tmp_path, tiny_server):
    base = tiny_server.url.rstrip("/")
    command = _command("report", tmp_path, f"{base}/v1/")
    assert main(command) == 0
    page = (Path(command[1]) / "report" / "index.html").read_text()
    assert f"greedy, from {base} (tiny, weight version 0)" in page


def test_rollout_server_urls_take_the_v1_url_and_know_it_names_the_same_server(tmp_path):
    url = "http://127.0.0.1:8000"
    cfg = tiny_config(tmp_path, max_staleness=1, rollout_server_urls=[f"{url}/v1"])
    assert cfg.rollout_server_urls == [f"{url}/v1"]  # (the client strips /v1: engine/remote.py)
    with pytest.raises(ValueError, match="rollout_server_urls names a server twice: each server once"):
        tiny_config(tmp_path, max_staleness=1, rollout_server_urls=[url, f"{url}/v1/"])
