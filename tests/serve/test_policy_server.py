"""`grpokit serve-policy`: the policy behind OpenAI's completions API (serve/policy.py), on this
machine's loopback, over the test-made Qwen2 chat model (tests/hub_cache.py)."""

from __future__ import annotations

import concurrent.futures
import socket
import time

import httpx2 as httpx
import pytest
import torch

from grpokit.config.specs import SamplingParams
from grpokit.models import tokenizer_fingerprint
from grpokit.net.server import ServeLimits
from grpokit.serve.policy import PolicyServer
from tests.hub_cache import QWEN

pytestmark = pytest.mark.loopback
NAME = "tiny-qwen"
PROMPT = [9, 14, 21, 30, 7]  # token ids (the tiny BPE vocabulary has them)


@pytest.fixture(scope="module")
def server(engine):
    logs: list[str] = []
    limits = ServeLimits(max_connections=256, request_timeout=2.0, keep_alive=1.0, max_batch_rows=64)
    with PolicyServer(engine, NAME, limits=limits, log=logs.append) as running:
        running.logs = logs
        yield running


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url.rstrip("/"), timeout=60) as c:
        yield c


def in_process(engine, prompts, **sampling):
    """What the engine draws for `prompts` itself: [(token ids, log-probs)] per row."""
    rollout = engine.generate(prompts, SamplingParams(**sampling))
    rows = []
    for r in range(rollout.completion_ids.shape[0]):
        mask = rollout.completion_mask[r]
        rows.append((rollout.completion_ids[r][mask].tolist(), rollout.sampling_logps[r][mask].tolist()))
    return rows, rollout


def test_a_completion_is_openais_schema_field_by_field_and_the_engines_draw(client, engine):
    body = {
        "model": NAME,
        "prompt": PROMPT,
        "n": 3,
        "max_tokens": 6,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 11,
        "logprobs": 0,
        "return_token_ids": True,
    }
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    got = answer.json()
    assert set(got) == {"id", "object", "created", "model", "choices", "usage"} | {
        "weight_version",
        "weight_sender",
        "tokenizer_fingerprint",
    }  # (grpokit's: what it sampled with)
    assert (got["weight_version"], got["weight_sender"]) == (0, None)  # the weights it started with
    assert got["tokenizer_fingerprint"] == tokenizer_fingerprint(engine.tokenizer)
    assert got["id"].startswith("cmpl-") and got["object"] == "text_completion" and got["model"] == NAME
    assert isinstance(got["created"], int) and abs(got["created"] - time.time()) < 60
    expected, rollout = in_process(
        engine,
        [PROMPT],
        num_generations=3,
        max_completion_length=6,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        seed=11,
    )
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    eos = set(engine.decoder.eos_token_ids)
    for choice, (ids, logps), text in zip(got["choices"], expected, rollout.completions, strict=True):
        assert set(choice) == {"index", "text", "logprobs", "finish_reason", "prompt_token_ids", "token_ids"}
        assert choice["prompt_token_ids"] == PROMPT
        assert choice["token_ids"] == ids and choice["text"] == text  # the same seed: the same draw
        assert choice["logprobs"]["token_logprobs"] == logps  # the sampler's own, bit for bit
        assert all(lp <= 0 for lp in logps)
        assert choice["logprobs"]["tokens"] == [engine.tokenizer.decode([t]) for t in ids]
        assert choice["logprobs"]["top_logprobs"] is None
        offsets = choice["logprobs"]["text_offset"]
        assert offsets[0] == 0 and all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
        ended = ids[-1] in eos
        assert choice["finish_reason"] == ("stop" if ended else "length")
        assert ended or len(ids) == 6
    completion_tokens = sum(len(ids) for ids, _ in expected)
    assert got["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": completion_tokens,
        "total_tokens": len(PROMPT) + completion_tokens,
    }
    # (another temperature, the same seed: other log-probs, those of the distribution drawn from)
    hotter = client.post("/v1/completions", json=body | {"temperature": 1.3}).json()
    assert (
        hotter["choices"][0]["logprobs"]["token_logprobs"] != got["choices"][0]["logprobs"]["token_logprobs"]
    )


def test_text_prompts_and_several_prompts_come_prompt_by_prompt(client, engine):
    texts = ["12+3=", "7+8="]
    ids = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    body = {"prompt": texts, "n": 2, "max_tokens": 4, "seed": 5, "return_token_ids": True}
    got = client.post("/v1/completions", json=body).json()
    expected, _ = in_process(engine, texts, num_generations=2, max_completion_length=4, seed=5)
    assert [c["prompt_token_ids"] for c in got["choices"]] == [
        ids[0],
        ids[0],
        ids[1],
        ids[1],
    ]  # index p·n + j
    assert [c["token_ids"] for c in got["choices"]] == [e[0] for e in expected]
    assert got["choices"][0]["logprobs"] is None  # not asked
    assert got["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    # the same prompts as token ids: the same answer
    by_ids = client.post("/v1/completions", json=body | {"prompt": ids}).json()
    assert [c["token_ids"] for c in by_ids["choices"]] == [e[0] for e in expected]


def test_chat_goes_through_the_chat_template_as_training_renders_it(client, engine):
    from grpokit.data import render_prompt

    messages = [{"role": "user", "content": "What is 2+3?"}]
    body = {"model": NAME, "messages": messages, "max_tokens": 5, "seed": 3, "logprobs": True}
    got = client.post("/v1/chat/completions", json=body).json()
    assert got["id"].startswith("chatcmpl-") and got["object"] == "chat.completion"
    ids = engine.tokenizer(render_prompt(messages, engine.tokenizer), add_special_tokens=False)["input_ids"]
    [(expected_ids, logps)], _ = in_process(engine, [ids], num_generations=1, max_completion_length=5, seed=3)
    choice = got["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == engine.tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert [t["logprob"] for t in choice["logprobs"]["content"]] == logps
    assert got["usage"]["prompt_tokens"] == len(ids)


def test_the_model_list_health_and_weight_version(client):
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [NAME]
    assert models["data"][0]["object"] == "model"
    assert client.get("/weight_version").json() == {"version": 0, "sender": None}


def test_eight_concurrent_clients_get_their_own_answers_batched(client, server, engine, monkeypatch):
    """8 clients at once, greedy, prompts of one length: each gets its own prompt's completion (the
    one the engine gives that prompt alone). The first decode is held until every other request is
    queued behind it: those are then one decode."""
    import threading

    prompts = [[5 + i, 17, 23 + i, 8] for i in range(8)]
    greedy = dict(max_completion_length=5, temperature=0.0, num_generations=1)
    alone = [in_process(engine, [p], **greedy)[0][0][0] for p in prompts]
    gate, generate, held = threading.Event(), engine.generate, []

    def held_first(prompts, *args, **kwargs):  # each decode waits for the gate; the first's size is kept
        held.append(len(prompts))
        gate.wait(30)
        return generate(prompts, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", held_first)
    before = server.decodes

    def ask(prompt):
        body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "return_token_ids": True}
        return client.post("/v1/completions", json=body).json()["choices"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        asked = [pool.submit(ask, p) for p in prompts]
        deadline = time.monotonic() + 30
        while not (held and server.jobs.qsize() == 8 - held[0]) and time.monotonic() < deadline:
            time.sleep(0.01)  # every request in: in the held decode, or queued behind it
        gate.set()
        answers = [a.result() for a in asked]
    for prompt, choices, ids in zip(prompts, answers, alone, strict=True):
        assert len(choices) == 1 and choices[0]["prompt_token_ids"] == prompt
        assert choices[0]["token_ids"] == ids
    assert server.decodes - before == (1 if held[0] == 8 else 2)  # the queued ones in one decode


def _error(answer, status, param=None):
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param and "\n" not in error["message"]
    return error["message"]


@pytest.mark.parametrize(
    ("body", "status", "param", "said"),
    [
        ({"prompt": PROMPT, "n": 0}, 400, "n", "n must be from 1 to 256, got 0"),
        ({"prompt": PROMPT, "max_tokens": -1}, 400, "max_tokens", "max_tokens must be from 1 to"),
        ({"prompt": PROMPT, "model": "gpt-5"}, 404, "model", 'the model "gpt-5" does not exist'),
        ({"prompt": PROMPT, "temperature": "hot"}, 400, "temperature", "temperature must be a number"),
        ({"prompt": PROMPT, "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
        ({"prompt": [10**9]}, 400, "prompt", "token id 1000000000 is not in the vocabulary"),
        ({"prompt": []}, 400, "prompt", "prompt must be a non-empty text"),
        ({"prompt": PROMPT, "stream": True}, 400, "stream", "stream is not supported"),
        ({"prompt": PROMPT, "logprobs": 5}, 400, "logprobs", "logprobs must be 0 (each sampled token"),
        ({"prompt": PROMPT, "n": 65}, 400, "n", "over this server's --max-batch-rows 64"),
        ({"prompt": PROMPT, "max_tokens": 10**6}, 400, "max_tokens", "max_tokens must be from 1 to"),
    ],
)
def test_bad_requests_are_openai_errors_in_one_line(client, server, body, status, param, said):
    assert said in _error(client.post("/v1/completions", json=body), status, param)
    assert any(f"{status} for POST /v1/completions" in line for line in server.logs)


def test_malformed_json_and_a_100_mb_body_are_refused_and_a_good_client_is_served(client, server):
    _error(client.post("/v1/completions", content=b'{"prompt": [1,'), 400)
    _error(client.post("/v1/completions", content=b"[1, 2]"), 400)
    huge = 100 * 2**20
    with socket.create_connection((server.socket.getsockname()[0], server.port), timeout=10) as raw:
        raw.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {huge}\r\n\r\n".encode())
        received = b""
        while chunk := raw.recv(4096):  # to the end: the server closes after its answer
            received += chunk
        head = received.decode()
    assert head.startswith("HTTP/1.1 413") and "over this server's limit of 64 MiB" in head
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


@pytest.mark.slow  # (waits out timeouts or builds a large payload, 1-2 s: the full suite runs it)
def test_200_idle_connections_are_cut_while_a_good_client_is_served(client, server):
    host, port = server.socket.getsockname()[:2]
    idle = [socket.create_connection((host, port), timeout=10) for _ in range(200)]
    try:
        began = time.monotonic()
        assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
        assert time.monotonic() - began < 10
        for connection in idle:  # closed by the server within request_timeout (2 s): end of file
            assert connection.recv(1) == b""
        assert time.monotonic() - began < 2.0 + 5
    finally:
        for connection in idle:
            connection.close()


def test_update_weights_loads_the_trainers_file_and_says_the_version(client, server, engine, tmp_path):
    from safetensors.torch import save_model

    original = {k: v.clone() for k, v in engine.module.state_dict().items()}
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    before = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
    try:
        with torch.no_grad():
            for p in engine.module.parameters():
                p.mul_(-1.0)
            save_model(engine.module, str(tmp_path / "weights-v3.safetensors"))
            engine.module.load_state_dict(original)
        answer = client.post(
            "/update_weights", json={"path": str(tmp_path / "weights-v3.safetensors"), "version": 3}
        )
        held = {"version": 3, "sender": None}
        assert answer.json() == held and client.get("/weight_version").json() == held
        flipped = dict(engine.module.state_dict())
        assert all(torch.equal(flipped[k], -original[k]) for k in original if original[k].is_floating_point())
        after = client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]
        assert after != before
        _error(
            client.post("/update_weights", json={"path": str(tmp_path / "absent.safetensors"), "version": 4}),
            400,
            "path",
        )
        (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
        said = _error(
            client.post("/update_weights", json={"path": str(tmp_path / "bad.safetensors"), "version": 4}),
            400,
            "path",
        )
        assert said.startswith("cannot load") and client.get("/weight_version").json() == held
    finally:
        engine.module.load_state_dict(original)


def test_with_an_api_key_every_route_needs_it(engine):
    with PolicyServer(engine, NAME, api_key="s3cret", log=lambda _: None) as keyed:
        base = keyed.url.rstrip("/")
        assert httpx.get(f"{base}/health").status_code == 401
        answer = httpx.post(
            f"{base}/v1/completions", json={"prompt": PROMPT}, headers={"Authorization": "Bearer no"}
        )
        assert answer.status_code == 401 and "s3cret" not in answer.text
        good = httpx.get(f"{base}/health", headers={"Authorization": "Bearer s3cret"})
        assert good.json() == {"status": "ok"}


@pytest.mark.slow  # a process importing torch and transformers
def test_the_cli_serves_a_hub_model_and_warns_off_loopback(hub_offline, tmp_path):
    """`grpokit serve-policy MODEL --port 0`: one line saying where, and answers there; SIGTERM stops it."""
    import os
    import re
    import signal
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-m", "grpokit", "serve-policy", QWEN, "--port", "0", "--host", "0.0.0.0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy(),
    )  # fmt: skip
    try:
        line = process.stdout.readline()
        where = re.search(r"at (http://\S+)/v1 ", line)
        assert where, (line, process.stderr.read() if process.poll() is not None else "")
        url = where.group(1).replace("0.0.0.0", "127.0.0.1")
        got = httpx.post(
            f"{url}/v1/completions", json={"model": QWEN, "prompt": "1+1=", "max_tokens": 3}, timeout=60
        )
        assert got.status_code == 200 and len(got.json()["choices"]) == 1
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0
    assert "grpokit serve-policy: warning: --host 0.0.0.0 is not this machine's loopback" in err
    assert "can call the policy 'tiny-org/qwen2-chat', with no authentication" in err


def test_bad_options_are_one_line(capsys):
    from grpokit.cli import main

    assert main(["serve-policy", "tiny", "--port", "70000"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[0]
        .endswith("--port 70000 is not a port (0 to 65535; 0: any free one)")
    )
