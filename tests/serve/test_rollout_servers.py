"""Asynchronous GRPO sampling on `grpokit serve-policy` servers (rollout_server_urls, engine/remote.py):
the same numbers as the in-process worker with one server, every server sent every version, and a
server that stops answering ends the run in one line."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from grpokit.config.plan import eval_plan
from grpokit.net.server import ServeLimits
from grpokit.serve.policy import PolicyServer
from grpokit.train.eval_run import policy_engine
from grpokit.train.grpo import train_grpo
from grpokit.train.rollout_worker import RolloutError
from tests.helpers import TINY_RUN_VALUES, read_steps
from tests.train.helpers import ones_reward, tiny_config, weights
from tests.train.test_async import _without_clocks

pytestmark = [pytest.mark.loopback, pytest.mark.slow]  # servers on 127.0.0.1; worker processes


@pytest.fixture
def one_thread():
    """The servers decode in this process: on one thread, as the worker does with num_threads=1 (a
    matrix product split over another number of threads rounds differently)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _server(cfg, **limits) -> PolicyServer:
    """A server of the run's model (the architecture its weights load into: the trainer's own)."""
    engine, _ = policy_engine(eval_plan(cfg))
    return PolicyServer(engine, "tiny", limits=ServeLimits(**limits), log=lambda _: None)


def test_one_server_samples_what_the_worker_samples_bitwise(tmp_path, one_thread):
    """max_staleness=1 on one server: the in-process async run's metrics (clocks aside) and weights, bit
    for bit; the server was sent each version a batch needs (the last: 6 − 2 = 4) and decoded each
    batch once. Stopped after its step-3 checkpoint (a batch in flight, sampled on the server) and
    resumed, it ends there too."""
    import shutil

    local = tiny_config(tmp_path / "local", max_steps=6, save_steps=3, max_staleness=1, num_threads=1)
    train_grpo(local, reward_funcs=[ones_reward])
    with _server(local) as server:
        remote = local.model_copy(
            update={"output_dir": str(tmp_path / "remote" / "run"), "rollout_server_urls": [server.url]}
        )
        train_grpo(remote, reward_funcs=[ones_reward])
        assert server.version == 4 and server.decodes == 6
        stopped = tmp_path / "stopped" / "run"  # as a run killed after its step-3 checkpoint leaves it
        shutil.copytree(remote.output_dir, stopped)
        shutil.rmtree(stopped / "checkpoint-6")
        train_grpo(
            remote.model_copy(update={"output_dir": str(stopped), "resume": True}), reward_funcs=[ones_reward]
        )
    a, b = read_steps(local.output_dir), read_steps(remote.output_dir)
    assert [r["async/weight_version"] for r in b] == [0.0, 0.0, 1.0, 2.0, 3.0, 4.0]
    assert _without_clocks(a) == _without_clocks(b) == _without_clocks(read_steps(stopped))
    wa, wb, wc = weights(Path(local.output_dir)), weights(Path(remote.output_dir)), weights(stopped)
    assert all(torch.equal(wa[k], wb[k]) and torch.equal(wa[k], wc[k]) for k in wa)


def test_two_servers_share_each_batch_and_both_get_every_version(tmp_path, one_thread):
    """Each batch's 4 prompts split 2 and 2 (one request each, n = G), both servers updated to every
    version; the staleness exact as with one."""
    cfg = tiny_config(tmp_path, max_steps=4, max_staleness=1, num_threads=1)
    with _server(cfg) as first, _server(cfg) as second:
        loaded: dict[int, list[int]] = {id(first): [], id(second): []}
        for server in (first, second):  # each version a server loads, in order
            load = server._load
            server._load = lambda job, s=server, load=load: (load(job), loaded[id(s)].append(s.version))
        cfg = cfg.model_copy(update={"rollout_server_urls": [first.url, second.url]})
        train_grpo(cfg, reward_funcs=[ones_reward])
        assert loaded[id(first)] == loaded[id(second)] == [0, 1, 2]  # steps 1-2: v0, step 3: v1, step 4: v2
        assert (first.decodes, second.decodes) == (4, 4)
    rows = read_steps(cfg.output_dir)
    assert [r["async/weight_version"] for r in rows] == [0.0, 0.0, 1.0, 2.0]
    assert all(r["num_generation_batches"] == 1 for r in rows)


@pytest.mark.parametrize("how", ["stops answering", "is stopped"])
def test_a_server_that_stops_answering_or_is_stopped_ends_the_run_in_one_line(tmp_path, one_thread, how):
    """After its second batch the server hangs in its decode (request_timeout=3 s bounds the wait), or
    is stopped (its port refuses): the run ends with one line naming the server and the last checkpoint,
    within request_timeout and a few seconds."""
    cfg = tiny_config(
        tmp_path, max_steps=8, save_steps=2, max_staleness=1, num_threads=1, request_timeout=3.0
    )
    server = _server(cfg).start()
    generate, calls, release = server.engine.generate, [], threading.Event()

    def stalls(*args, **kwargs):
        calls.append(time.monotonic())
        if len(calls) == 3:
            if how == "stops answering":
                release.wait(60)
            else:
                threading.Thread(target=server.close, daemon=True).start()
                time.sleep(0.5)
        return generate(*args, **kwargs)

    server.engine.generate = stalls
    url = server.url.rstrip("/")
    cfg = cfg.model_copy(update={"rollout_server_urls": [url]})
    try:
        with pytest.raises(RolloutError) as raised:
            train_grpo(cfg, reward_funcs=[ones_reward])
        ended = time.monotonic()
    finally:
        release.set()
        server.close()
    said = str(raised.value)
    assert "\n" not in said and f"rollout server {url} " in said
    if how == "stops answering":
        assert "did not answer POST /v1/completions within request_timeout=3 s" in said
    else:
        assert "cannot be reached" in said or "did not answer" in said
    assert "the last checkpoint is" in said or "no checkpoint yet" in said
    assert ended - calls[2] < 3.0 + 5


def test_eval_on_a_server_is_eval_in_process(tmp_path, one_thread, capsys):
    """`grpokit eval --server URL`: the held-out metrics (greedy accuracy, reward, pass@k) the in-process
    eval gives, sampled on a server of the same weights."""
    import json

    import yaml

    from grpokit.cli import main
    from grpokit.train.eval_run import evaluate_policy

    cfg = tiny_config(tmp_path, pass_at_k=2)
    local = evaluate_policy(eval_plan(cfg))
    assert set(local) >= {"accuracy", "reward"}
    with _server(tiny_config(tmp_path)) as server:
        assert evaluate_policy(eval_plan(cfg), server=server.url) == local
        config = tmp_path / "eval.yaml"  # tiny_config's values, as a file (no preset under them)
        config.write_text(
            yaml.safe_dump(dict(task="addition", model="tiny", seed=3, pass_at_k=2) | TINY_RUN_VALUES)
        )
        assert main(["eval", str(config), "--server", server.url]) == 0
    assert json.loads(capsys.readouterr().out) == local  # the command line: the same figures


def test_the_doctor_checks_each_server_and_a_server_with_another_tokenizer_is_refused(tmp_path, one_thread):
    import socket

    from grpokit.engine.remote import RemotePolicy, RolloutServerError
    from grpokit.train.doctor import checkup

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    cfg = tiny_config(tmp_path, max_staleness=1, sft_steps=0)
    with _server(cfg) as server:
        good = server.url.rstrip("/")
        report = checkup(cfg.model_copy(update={"rollout_server_urls": [good, dead]}), groups=2)
        found = {f.item: f for f in report.findings if f.section == "servers"}
        assert found[good].level == "ok" and found[good].value.startswith(
            "'tiny' with the trainer's tokenizer"
        )
        assert "weight version 0; round trip" in found[good].value
        assert (
            found[dead].level == "fatal" and f"rollout server {dead} cannot be reached" in found[dead].advice
        )
        server.fingerprint = "0" * 16  # as a server of another model would say
        tokenizer = policy_engine(eval_plan(cfg))[0].tokenizer
        with pytest.raises(
            RolloutServerError, match=r"serves 'tiny' with another tokenizer .* serve the trainer's"
        ):
            RemotePolicy((good,), tokenizer, 10.0)


def test_the_report_shows_completions_sampled_on_a_server(tmp_path, one_thread):
    """`grpokit report RUN --server URL --samples 3`: a "Sample completions" section with the first 3
    held-out prompts of the run's config, their greedy completions on the server (the ones the server's
    engine gives them) and rewards, and where and with which weight version they were sampled."""
    import html
    import re

    from grpokit.cli import main
    from grpokit.config.specs import SamplingParams

    cfg = tiny_config(tmp_path, max_steps=1)
    train_grpo(cfg, reward_funcs=[ones_reward])
    with _server(cfg) as server:
        assert main(["report", cfg.output_dir, "--server", server.url, "--samples", "3"]) == 0
        page = (Path(cfg.output_dir) / "report" / "index.html").read_text()
        section = page[page.index("<h2>Sample completions</h2>") : page.index("<h2>Config</h2>")]
        assert f"from {server.url.rstrip('/')} (tiny, weight version 0)" in section
        cells = [html.unescape(c) for c in re.findall(r"<td><pre>(.*?)</pre></td>", section, re.S)]
        prompts, completions = cells[0::2], cells[1::2]
        assert len(prompts) == 3 and len(re.findall(r"</pre></td><td>[-\d.e+]+</td></tr>", section)) == 3
        greedy = SamplingParams(
            num_generations=1, max_completion_length=cfg.max_completion_length, temperature=0
        )
        assert server.engine.generate(prompts, greedy).completions == completions


def test_a_server_process_killed_mid_run_ends_the_run_in_one_line(tmp_path):
    """`grpokit serve-policy` as a process of its own, killed with SIGKILL once the run has logged 2
    steps: the run ends with one line naming the server, within request_timeout and a few seconds."""
    import os
    import re
    import signal
    import subprocess
    import sys

    import yaml

    values = dict(task="addition", model="tiny", seed=3) | TINY_RUN_VALUES
    (tmp_path / "server.yaml").write_text(yaml.safe_dump(values))  # the trainer's tiny model, as a file
    command = ["serve-policy", "tiny", str(tmp_path / "server.yaml"), "--port", "0"]
    server = subprocess.Popen(
        [sys.executable, "-m", "grpokit", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        url = re.search(r"at (http://\S+)/v1 ", server.stdout.readline()).group(1)
        cfg = tiny_config(tmp_path, max_steps=30, max_staleness=1, num_threads=1, request_timeout=5.0)
        cfg = cfg.model_copy(update={"rollout_server_urls": [url]})
        killed: list[float] = []

        def kill_after_two_steps() -> None:
            metrics = Path(cfg.output_dir) / "metrics.jsonl"
            while len(read_steps(cfg.output_dir) if metrics.exists() else []) < 2:
                time.sleep(0.05)
            os.kill(server.pid, signal.SIGKILL)
            killed.append(time.monotonic())

        threading.Thread(target=kill_after_two_steps, daemon=True).start()
        with pytest.raises(RolloutError) as raised:
            train_grpo(cfg, reward_funcs=[ones_reward])
        ended = time.monotonic()
    finally:
        server.kill()
        server.communicate(timeout=30)
    said = str(raised.value)
    assert killed and ended - killed[0] < 5.0 + 5
    assert "\n" not in said and f"rollout server {url} " in said
    assert len(read_steps(cfg.output_dir)) < 30
