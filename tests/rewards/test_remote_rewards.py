"""Remote rewards: `RemoteReward(url)` / `{url: ...}` entries against servers on 127.0.0.1 (port 0: a
free one), and `grpokit serve-reward`. The servers run in threads of this process (`RewardServer`, or
`Scripted` for answers a real server gives when things go wrong) or as a CLI subprocess, and are
stopped when each test ends. Tests that connect to them are marked `loopback` (tests/conftest.py:
loopback only; every other address stays blocked)."""

from __future__ import annotations

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from grpokit.config import ConfigError, GRPOConfig, load_config
from grpokit.rewards import (
    CallRules,
    RemoteReward,
    RemoteRewardError,
    RewardFunctionError,
    named_reward,
    score_completions,
)
from grpokit.train.grpo import train_grpo
from tests.helpers import read_metrics
from tests.rewards.remote_scorers import digit_match
from tests.train.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[2]
loopback = pytest.mark.loopback

PROMPTS = ["12+3=", "4+5=", "7+7=", "1+1="]
COMPLETIONS = ["15", "8", "", "2"]
ANSWERS = ["15", "9", "14", "2"]
IDS = [[1, 5], [8], [], [2]]


class Scripted(ThreadingHTTPServer):
    """Answers each POST with the next of `answers` (status, body, seconds to wait first), the last one
    repeated; records when each request came and from which client port."""

    daemon_threads = True

    def __init__(self, answers: list[tuple[int, str, float]]) -> None:
        self.answers, self.arrivals, self.ports = list(answers), [], []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), ScriptedHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}/score"


class ScriptedHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Scripted

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            self.server.arrivals.append(time.monotonic())
            self.server.ports.append(self.client_address[1])
            status, body, wait = self.server.answers[0]
            if len(self.server.answers) > 1:
                self.server.answers.pop(0)
        time.sleep(wait)
        data = body.encode()
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up waiting (the timeout test)
            self.close_connection = True

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def scripted():
    """scripted(answers) -> a Scripted server on 127.0.0.1 serving from a thread, closed at the end."""
    servers: list[Scripted] = []

    def start(answers: list[tuple[int, str, float]]) -> Scripted:
        server = Scripted(answers)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


# ----------------------------------------------------------------------------- the round trip


@loopback
def test_the_round_trip_equals_calling_the_function_directly(serve):
    """Same values (floats survive JSON exactly), a column and the token ids delivered, None kept; a
    column JSON cannot carry is left out rather than failing the batch; conversational completions
    (TRL's message lists) arrive as they are."""
    seen: list[dict[str, Any]] = []

    def recording(prompts, completions, answer, completion_ids, **columns):
        seen.append({"columns": sorted(columns)})
        return digit_match(prompts, completions, answer, completion_ids)

    remote = RemoteReward(serve(recording).url + "score")
    direct = digit_match(PROMPTS, COMPLETIONS, ANSWERS, IDS)
    got = remote(
        PROMPTS, COMPLETIONS, answer=ANSWERS, completion_ids=IDS, source=[object()] * 4, level=[1] * 4
    )
    assert got == direct and got[2] is None and got[0] == pytest.approx(1.002, abs=1e-12)
    assert seen == [{"columns": ["level"]}]  # `source` (objects) was not sent
    turns = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    assert remote(PROMPTS, turns, answer=ANSWERS, completion_ids=IDS) == direct


@loopback
def test_none_passes_through_the_scorer_as_unscorable(serve):
    remote = RemoteReward(serve(digit_match).url, name="digit_match")
    through = score_completions(
        [remote],
        PROMPTS,
        COMPLETIONS,
        columns={"answer": ANSWERS},
        completion_ids=IDS,
        rules=CallRules(timeout=30),
    )
    direct = score_completions(
        [digit_match], PROMPTS, COMPLETIONS, columns={"answer": ANSWERS}, completion_ids=IDS
    )
    assert through.names == ["digit_match"]
    assert through.rewards_per_func.isnan().tolist() == [[False], [False], [True], [False]]
    assert through.rewards_per_func.nan_to_num(-7).tolist() == direct.rewards_per_func.nan_to_num(-7).tolist()


# ----------------------------------------------------------------------------- failures


@loopback
def test_an_error_in_the_function_is_a_500_named_in_one_line(serve):
    """The client's line names the URL, the status and the first line of the body; the scorer passes it
    on as it is (one request: no row-by-row search, which would post every row again), or with
    on_reward_error=unscorable scores the batch None and counts it."""
    calls = []

    def boom(prompts, completions, **_):
        calls.append(len(completions))
        raise ValueError("no score today\nsecond line")

    server = serve(boom)
    url = server.url + "score"
    remote = RemoteReward(url, retries=0, name="boom")
    with pytest.raises(RemoteRewardError) as caught:
        score_completions([remote], PROMPTS, COMPLETIONS)
    line = str(caught.value)
    assert "\n" not in line
    assert f"reward function 'boom': POST {url} answered HTTP 500 Internal Server Error after 1 try: " in line
    assert """{"error": "reward function 'boom' raised ValueError: no score today\\nsecond line"}""" in line
    assert calls == [4]
    assert any("ValueError: no score today" in log for log in serve.logs)  # the traceback, server side
    scores = score_completions([remote], PROMPTS, COMPLETIONS, rules=CallRules(on_error="unscorable"))
    assert scores.num_failed == 4 and scores.rewards_per_func.isnan().all() and calls == [4, 4]
    # a 500 is the function failing on this very batch: not tried again, whatever the retries
    retrying = RemoteReward(url, retries=3, backoff=0.5, name="boom")
    with pytest.raises(RemoteRewardError, match=r"HTTP 500 Internal Server Error \(not tried again\)"):
        retrying(PROMPTS, COMPLETIONS)
    assert calls == [4, 4, 4]


@loopback
def test_a_5xx_is_tried_again_with_exponential_backoff_then_succeeds(scripted):
    server = scripted([(503, "busy", 0.0), (503, "busy", 0.0), (200, '{"rewards": [0.5, null]}', 0.0)])
    assert RemoteReward(server.url, retries=3, backoff=0.1)(["a", "b"], ["1", "2"]) == [0.5, None]
    gaps = [b - a for a, b in zip(server.arrivals, server.arrivals[1:], strict=False)]
    assert len(server.arrivals) == 3
    assert gaps[0] >= 0.1 and gaps[1] >= 0.2  # backoff, then twice it
    always = scripted([(502, "<html>\nBad Gateway\n</html>", 0.0)])
    with pytest.raises(RemoteRewardError, match=r"answered HTTP 502 Bad Gateway after 3 tries: <html>; "):
        RemoteReward(always.url, retries=2, backoff=0.01)(["a"], ["1"])
    assert len(always.arrivals) == 3


@loopback
@pytest.mark.parametrize("status", [400, 404, 422])
def test_a_4xx_is_not_tried_again(scripted, status):
    server = scripted([(status, '{"error": "no such thing"}\nmore', 0.0), (200, '{"rewards": [1.0]}', 0.0)])
    with pytest.raises(RemoteRewardError) as caught:
        RemoteReward(server.url, retries=3, backoff=0.01)(["a"], ["1"])
    assert f"POST {server.url} answered HTTP {status} " in str(caught.value)
    assert '(not tried again): {"error": "no such thing"}; ' in str(caught.value)
    assert len(server.arrivals) == 1


@loopback
def test_a_server_past_the_timeout_is_tried_again_then_named(scripted):
    server = scripted([(200, '{"rewards": [1.0]}', 1.5)])
    began = time.monotonic()
    with pytest.raises(RemoteRewardError) as caught:
        RemoteReward(server.url, timeout=0.2, retries=1, backoff=0.05)(["a"], ["1"])
    took = time.monotonic() - began
    said = f"POST {server.url} did not finish answering within 0.2 s, after 2 tries; "
    assert said in str(caught.value)
    assert len(server.arrivals) == 2
    assert 0.45 <= took < 1.4  # two waits of 0.2 s and a backoff of 0.05 s, well before the server's 1.5 s


@loopback
@pytest.mark.parametrize(
    ("body", "said"),
    [
        ('{"rewards": [1.0]}', "answered 1 rewards for 2 completions; the server must answer"),
        ('{"rewards": [1.0, 2.0, 3.0]}', "answered 3 rewards for 2 completions"),
        ('{"scores": [1.0, 2.0]}', """answered no 'rewards' list: {"scores": [1.0, 2.0]}"""),
        ("<html>ok</html>", "answered a body that is not JSON: <html>ok</html>"),
        ('{"rewards": [1.0, "yes"]}', "answered 'yes' for row 1, not a number or null"),
        ('{"rewards": [NaN, 1.0]}', "answered nan for row 0, not a number or null"),
    ],
)
def test_an_answer_that_is_not_one_reward_per_completion_is_one_line(scripted, body, said):
    server = scripted([(200, body, 0.0)])
    with pytest.raises(RemoteRewardError) as caught:
        RemoteReward(server.url, name="r")(["a", "b"], ["1", "2"])
    assert str(caught.value).startswith(f"reward function 'r': POST {server.url} ")
    assert said in str(caught.value) and "\n" not in str(caught.value)


@loopback
def test_a_server_that_is_not_there_is_named_after_the_retries():
    with socket.socket() as probe:  # a port nothing listens on: bound here, never listened
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}/score"
        with pytest.raises(RemoteRewardError, match=r"failed \(ConnectError: .*\) after 2 tries"):
            RemoteReward(url, retries=1, backoff=0.01)(["a"], ["1"])


@loopback
def test_the_server_refuses_what_is_not_the_contract_with_400(serve):
    import httpx2

    server = serve(digit_match)
    with httpx2.Client(trust_env=False) as client:
        post = lambda content: client.post(server.url, content=content)  # noqa: E731
        bad_json = post(b"{not json")
        short = post(json.dumps({"prompts": ["a", "b"], "completions": ["1", "2"], "answer": ["1"]}))
        no_completions = post(json.dumps({"prompts": ["a"]}))
        up = client.get(server.url)
    assert bad_json.status_code == 400 and bad_json.json()["error"].startswith("the body is not JSON: ")
    assert short.status_code == 400
    assert short.json() == {
        "error": "'answer' holds 1 values for 2 completions; give every field one value per completion"
    }
    assert no_completions.json() == {"error": "the body has no 'completions' list"}
    assert up.json() == {"reward_function": "digit_match"}


@loopback
def test_what_the_function_returns_is_checked_by_the_server(serve):
    import numpy as np

    answers = {
        "numpy": np.array([0.5, 1.5]),
        "nan": [float("nan"), 1.0],
        "word": ["yes", 1.0],
        "short": [1.0],
    }
    urls = {k: serve(lambda prompts, completions, v=v, **_: v).url for k, v in answers.items()}
    assert RemoteReward(urls["numpy"])(["a", "b"], ["1", "2"]) == [0.5, 1.5]
    for kind, said in [
        ("nan", "returned nan for row 0"),
        ("word", "returned 'yes' for row 0"),
        ("short", "returned 1 values for 2 completions"),
    ]:
        with pytest.raises(RemoteRewardError, match=re.escape(said)):
            RemoteReward(urls[kind], retries=0)(["a", "b"], ["1", "2"])


# ----------------------------------------------------------------------------- concurrency


@loopback
@pytest.mark.parametrize("concurrency", [1, 4])
def test_one_remote_reward_called_from_threads_at_once(serve, concurrency):
    """Eight threads share one RemoteReward (one connection pool): every answer is its own batch's, the
    requests overlap at the server (up to its `concurrency`, which bounds the calls of the function),
    and one thread's calls in a row reuse one connection (keep-alive)."""
    lock, running, most = threading.Lock(), [0], [0]

    def slow(prompts, completions, **_):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return [float(c) for c in completions]

    remote = RemoteReward(serve(slow, concurrency=concurrency).url)
    results: dict[int, list[float]] = {}

    def work(i: int) -> None:
        results[i] = remote(["p"] * 3, [str(i), str(10 * i), str(100 * i)])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {i: [float(i), 10.0 * i, 100.0 * i] for i in range(8)}
    assert most[0] == concurrency  # 8 requests in flight at once; the server lets `concurrency` run


@loopback
def test_calls_in_a_row_reuse_one_connection(scripted):
    server = scripted([(200, '{"rewards": [1.0]}', 0.0)])
    remote = RemoteReward(server.url)
    for _ in range(5):
        assert remote(["a"], ["1"]) == [1.0]
    assert len(server.ports) == 5 and len(set(server.ports)) == 1


# ----------------------------------------------------------------------------- proxies and the guard


@loopback
def test_proxy_settings_are_not_used_for_loopback(serve, monkeypatch):
    """With proxies set in the environment, a loopback server is still reached directly (through the
    proxy, 10.255.255.1, the connect would be refused by the network guard)."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://10.255.255.1:9")
    assert RemoteReward(serve(digit_match).url)(["a"], ["15"], answer=["15"], completion_ids=[[1]]) == [1.001]


@loopback
def test_the_loopback_marker_still_blocks_every_other_address():
    with pytest.raises(RemoteRewardError, match="network access attempted in a test"):
        RemoteReward("http://10.255.255.1:9/score", retries=0, timeout=2)(["a"], ["1"])


def test_without_the_marker_loopback_is_blocked_too():
    with pytest.raises(RemoteRewardError, match="network access attempted in a test"):
        RemoteReward("http://127.0.0.1:9/score", retries=0, timeout=2)(["a"], ["1"])


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ("{url: ftp://127.0.0.1/score}", "url 'ftp://127.0.0.1/score' is not an http:// or https:// address"),
        ('{url: "http://"}', "url 'http://' is not an http:// or https:// address with a host"),
        ("{url: 'http://127.0.0.1:99999/'}", "is not an address (Port out of range 0-65535)"),
        ("{url: http://127.0.0.1:8000/, timeout: 0}", "timeout 0 must be a number of seconds above 0"),
        ("{url: http://127.0.0.1:8000/, timeout: -1.5}", "timeout -1.5 must be a number of seconds above 0"),
        ("{url: http://127.0.0.1:8000/, timeout: fast}", "timeout 'fast' must be a number of seconds"),
        ("{url: http://127.0.0.1:8000/, retries: -1}", "retries -1 must be an integer from 0 to 100"),
        ("{url: http://127.0.0.1:8000/, retries: 1.5}", "retries 1.5 must be an integer from 0 to 100"),
        ("{url: http://127.0.0.1:8000/, name: ''}", "name '' must be a non-empty string"),
        ("{url: http://127.0.0.1:8000/, batch_size: 4}", "a url entry optionally timeout, retries, name"),
        ("{url: http://127.0.0.1:8000/, python: m:f}", "must have exactly one of 'model'"),
    ],
)
def test_bad_url_entries_are_one_line_naming_the_entry(entry, said):
    with pytest.raises(ConfigError) as caught:
        load_config(GRPOConfig, None, [f"reward_funcs=[{entry}]"])
    line = str(caught.value).splitlines()[-1]
    assert line.strip().startswith("reward_funcs entry {") and said in line, line


def test_url_entries_and_the_python_api_take_the_same_options():
    cfg = load_config(
        GRPOConfig,
        None,
        [
            "reward_funcs=[http://127.0.0.1:8000/a, {url: http://127.0.0.1:8000/b, timeout: 2.5, "
            "retries: 0, name: mine}]"
        ],
    )
    assert cfg.reward_funcs == [
        {"url": "http://127.0.0.1:8000/a"},
        {"url": "http://127.0.0.1:8000/b", "timeout": 2.5, "retries": 0, "name": "mine"},
    ]
    from grpokit.config.plan import RewardSpec
    from grpokit.train.inputs import configured_rewards

    first, second = configured_rewards(RewardSpec(funcs=tuple(cfg.reward_funcs)), task=None)
    assert (first.url, first.timeout, first.retries, first.__name__) == (
        "http://127.0.0.1:8000/a",
        60.0,
        3,
        "remote:127.0.0.1:8000/a",
    )
    assert (second.timeout, second.retries, second.__name__) == (2.5, 0, "mine")
    by_name = named_reward("https://scorer.example/score")
    assert isinstance(by_name, RemoteReward) and by_name.url == "https://scorer.example/score"
    for bad, said in [("ftp://x/", "url 'ftp://x/' is not an http"), ("http://h/", "timeout 0 must be")]:
        with pytest.raises(ValueError, match=re.escape(f"RemoteReward({bad!r}): {said}")):
            RemoteReward(bad, timeout=0 if bad == "http://h/" else 1)
    assert issubclass(RemoteRewardError, RewardFunctionError)  # the CLI's one-line errors include it


# ----------------------------------------------------------------------------- grpokit serve-reward


@contextmanager
def served_by_cli(reference: str, *options: str):
    """`grpokit serve-reward REFERENCE --port 0` in a subprocess (the repository on its PYTHONPATH):
    yields the URL once it says where it listens; SIGTERM at the end, which it must survive cleanly
    (exit 0, "stopped"). Its output (stdout and stderr) is read on a thread, so it never blocks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "grpokit", "serve-reward", reference, "--port", "0", *options]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=lambda: [*map(lines.put, process.stdout), lines.put(None)], daemon=True)
    reader.start()
    said: list[str] = []
    found = None
    try:
        while (line := lines.get(timeout=60)) is not None:
            said.append(line)
            found = re.search(
                r"serving reward function '.*' at (http://127\.0\.0\.1:\d+/) \(Ctrl-C stops\)", line
            )
            if found:
                break
        assert found, said
        yield found.group(1)
    finally:
        process.terminate()
        process.wait(timeout=30)
        reader.join(timeout=30)
        process.stdout.close()
    while (line := lines.get_nowait()) is not None:
        said.append(line)
    assert process.returncode == 0 and said[-1].strip() == "stopped", said


def _metrics(output_dir: Path) -> list[dict[str, Any]]:
    changing = ("time", "step_time", "tokens_per_second")  # wall-clock figures
    rows = read_metrics(output_dir)
    return [
        {k: v for k, v in row.items() if k not in changing and not k.startswith("timing/")} for row in rows
    ]


@loopback
@pytest.mark.slow
def test_a_training_run_scored_by_serve_reward_equals_one_scored_directly(tmp_path):
    """A tests module's function served by the CLI and named by a {url: ...} entry in the config: the
    run's metrics (rewards, losses, gradient norms, evaluation) equal those of the same run given the
    function directly, exactly (the same rewards make the same run, bit for bit)."""
    with served_by_cli("tests.rewards.remote_scorers:digit_match") as url:
        entry = {"url": url + "score", "name": "digit_match", "timeout": 30}
        train_grpo(tiny_config(tmp_path / "remote", reward_funcs=[entry], eval_steps=2))
    train_grpo(tiny_config(tmp_path / "direct", eval_steps=2), reward_funcs=[digit_match])
    remote, direct = _metrics(tmp_path / "remote" / "run"), _metrics(tmp_path / "direct" / "run")
    assert len(remote) == 4 and remote == direct
    assert {"reward", "rewards/digit_match/mean", "eval/reward", "loss", "grad_norm"} <= set().union(*remote)
    assert remote[1]["reward"] > 0  # the served function did score (partial credit, token counts)


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["no_such_module:score", "--port", "0"], "reward function 'no_such_module:score': no module named"),
        (["exact_answer", "--port", "70000"], "--port 70000 is not a port (0 to 65535"),
        (["exact_answer", "--port", "BUSY"], "cannot listen on 127.0.0.1:BUSY: Address already in use"),
        (["exact_answer", "--port", "0", "--concurrency", "0"], "--concurrency 0 must be at least 1"),
    ],
)
def test_serve_reward_errors_are_one_line(capsys, arguments, said):
    from grpokit.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        assert main(["serve-reward", *[port if a == "BUSY" else a for a in arguments]]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("grpokit serve-reward: error: ") and said.replace("BUSY", port) in err[0], err
    assert err[1:] == ["(run with --debug for the traceback)"]
