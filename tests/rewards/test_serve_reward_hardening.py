"""`grpokit serve-reward` against clients that misbehave: bodies too large, malformed or nested too
deep, clients that leave mid-body or send nothing, too many connections, functions that return what
JSON or a float cannot carry, requests without the API key, a non-loopback host and a URL given as
the function. The servers run on 127.0.0.1 in threads of this process; the raw-socket cases speak
HTTP/1.1 by hand, as a broken client would. Every case checks the answer (status and JSON error), the
server's log (one line, never a traceback) and, where it matters, that the server answers afterwards."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest

import grpokit.rewards.serving
from grpokit.rewards import RemoteReward, RemoteRewardError, RewardServer
from grpokit.rewards.serving import exposure_warning

loopback = pytest.mark.loopback
TOKEN = "s3cret-Token-81f2"


def scores(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def exchange(server: RewardServer, data: bytes, *, wait: float = 5.0) -> tuple[float, bytes]:
    """(seconds until the server closed or `wait` passed, what it sent) for raw bytes sent at once."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as sock:
        began = time.monotonic()
        sock.sendall(data)
        return read_all(sock, began, wait)


def read_all(sock: socket.socket, began: float, wait: float) -> tuple[float, bytes]:
    got = b""
    sock.settimeout(wait)
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return time.monotonic() - began, got


def answer(raw: bytes) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of one raw HTTP/1.1 answer."""
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def post(body: bytes, *headers: str) -> bytes:
    lines = ["POST /score HTTP/1.1", "Host: 127.0.0.1", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


GOOD = json.dumps({"prompts": ["p", "q"], "completions": ["abc", "de"]}).encode()


def answers_a_good_request(server: RewardServer) -> bool:
    _, raw = exchange(server, post(GOOD, f"Content-Length: {len(GOOD)}", "Connection: close"))
    return answer(raw) == (200, {"rewards": [3.0, 2.0]})


def no_traceback(logs: list[str], captured: Any) -> None:
    """Nothing in the server's log is a traceback, and nothing went to this process's stderr (uvicorn's
    and asyncio's loggers print there when they are not kept to the server's log)."""
    err = captured.readouterr().err
    assert not any("Traceback" in line or "\n" in line for line in logs) and err == "", (logs, err)


# ----------------------------------------------------------------------------- bodies


@loopback
def test_a_content_length_of_1e11_is_413_answered_at_once_without_reading(serve, capfd):
    server = serve()
    took, raw = exchange(server, post(b"", "Content-Length: 100000000000"))
    status, body = answer(raw)
    assert status == 413 and took < 1.0  # answered before any body came, and the connection closed
    assert body == {
        "error": "the body is 100000000000 bytes, over this server's limit of 64 MiB (--max-body-mb)"
    }
    assert b"connection: close" in raw.lower()
    assert serve.logs == [f"serve-reward: 413 for POST /score: {body['error']}"]
    no_traceback(serve.logs, capfd)
    assert answers_a_good_request(server)


@loopback
def test_a_chunked_body_over_the_limit_is_413(serve):
    server = serve(max_body_mb=0.001)  # 1048 bytes
    chunk = b"x" * 4096
    raw_body = b"%x\r\n" % len(chunk) + chunk + b"\r\n0\r\n\r\n"
    _, raw = exchange(server, post(raw_body, "Transfer-Encoding: chunked"))
    assert answer(raw) == (
        413,
        {"error": "the body is over this server's limit of 0.001 MiB (--max-body-mb)"},
    )


@loopback
@pytest.mark.parametrize("length", ["\u0663".encode(), b"1e11", b"-5", b"12, 13"])
def test_a_malformed_content_length_is_a_json_400(serve, capfd, length):
    """A non-ASCII digit (int() would read U+0663 as 3), an exponent, a sign, a list: 400, one line."""
    server = serve()
    took, raw = exchange(server, post(b"abc", "Content-Length: PLACE").replace(b"PLACE", length))
    status, body = answer(raw)
    assert status == 400 and body["error"].startswith("the request is not valid HTTP/1.1") and took < 1.0
    assert serve.logs == ["serve-reward: Invalid HTTP request received."]
    no_traceback(serve.logs, capfd)
    assert answers_a_good_request(server)


@loopback
def test_a_body_nested_100000_deep_is_400(serve, capfd):
    server = serve()
    nested = b"[" * 100_000 + b"]" * 100_000
    _, raw = exchange(server, post(nested, f"Content-Length: {len(nested)}", "Connection: close"))
    assert answer(raw) == (400, {"error": "the body is JSON nested too deep; send lists of plain values"})
    no_traceback(serve.logs, capfd)
    assert answers_a_good_request(server)


# ----------------------------------------------------------------------------- slow and vanishing clients


@loopback
def test_clients_leaving_mid_body_are_one_quiet_line_each_and_the_server_answers_on(serve, capfd):
    server = serve()
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(post(b'{"prompts": ["p"], "compl', "Content-Length: 1000"))
    deadline = time.monotonic() + 5
    while len(serve.logs) < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert serve.logs == ["serve-reward: the client left during the body of POST /score"] * 20
    no_traceback(serve.logs, capfd)
    assert answers_a_good_request(server)


@loopback
def test_a_client_that_sends_headers_and_no_body_gets_408_within_the_bound(serve):
    server = serve(request_timeout=0.5)
    took, raw = exchange(server, post(b"", "Content-Length: 100"))
    assert answer(raw) == (408, {"error": "the body took more than 0.5 s to arrive (0 bytes came)"})
    assert 0.45 <= took < 1.5
    assert answers_a_good_request(server)


@pytest.mark.slow  # (waits out timeouts or builds a large payload, 1-2 s: the full suite runs it)
@loopback
def test_idle_and_trickling_clients_are_closed_within_the_bound(serve):
    """A connection that sends nothing, and one that sends its headers a byte at a time (each byte
    resets uvicorn's own keep-alive timer), are both closed `request_timeout` after connecting."""
    server = serve(request_timeout=0.5)
    took, raw = exchange(server, b"")
    assert raw == b"" and 0.45 <= took < 1.5
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        began, closed = time.monotonic(), False
        for byte in post(b"", "Content-Length: 2", *[f"X-Pad-{i}: {i}" for i in range(50)]):
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            sock.settimeout(0.05)
            try:
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
        assert closed and time.monotonic() - began < 1.5
    assert answers_a_good_request(server)


@loopback
def test_connections_past_max_connections_are_503(serve):
    server = serve(max_connections=1)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as held:
        held.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert held.recv(4096).startswith(b"HTTP/1.1 200 ")  # the one connection allowed
        _, raw = exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 503 ")
    deadline = time.monotonic() + 5
    while not answers_a_good_request(server):  # once the held one is gone, the next is served
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert "serve-reward: Exceeded concurrency limit." in serve.logs


# ----------------------------------------------------------------------------- what the function returns


@loopback
@pytest.mark.parametrize(
    ("value", "said"),
    [
        (10**5000, "returned an integer too large for a float (16610 bits) for row 1"),
        (float("inf"), "returned inf for row 1"),
        ("0.5", "returned '0.5' for row 1"),
    ],
    ids=["10**5000", "inf", "text"],
)
def test_a_reward_that_is_not_a_finite_float_is_a_500_and_the_function_runs_once(serve, capfd, value, said):
    calls = []

    def odd(prompts, completions, **_):
        calls.append(len(completions))
        return [1, value]

    server = serve(odd)
    with pytest.raises(RemoteRewardError) as caught:
        RemoteReward(server.url, retries=3, backoff=0.01, name="odd")(["p", "q"], ["a", "b"])
    assert "answered HTTP 500 Internal Server Error (not tried again): " in str(caught.value)
    assert f"reward function 'odd' {said}; return a finite number, or None" in str(caught.value)
    assert calls == [2]  # the client did not post the batch again
    error = (
        f"reward function 'odd' {said}; return a finite number, or None when the completion cannot be scored"
    )
    assert serve.logs == [f"serve-reward: 500 for POST /: {error}"]
    no_traceback(serve.logs, capfd)


@loopback
def test_bools_and_ints_are_answered_as_floats(serve):
    server = serve(lambda prompts, completions, **_: [True, 3])
    assert RemoteReward(server.url)(["p", "q"], ["a", "b"]) == [1.0, 3.0]


@loopback
def test_an_error_outside_the_function_is_a_500_json_line_not_a_traceback(serve, capfd):
    """What the function returned breaks while being read (a tolist() that raises): one line, and the
    server answers on."""

    class Broken:
        def tolist(self):
            raise RuntimeError("no list\nhere")

    calls = []

    def breaks_once(prompts, completions, **_):
        calls.append(1)
        return Broken() if len(calls) == 1 else scores(prompts, completions)

    server = serve(breaks_once)
    _, raw = exchange(server, post(GOOD, f"Content-Length: {len(GOOD)}"))
    assert answer(raw) == (500, {"error": "serve-reward could not answer: RuntimeError: no list here"})
    assert serve.logs == [
        "serve-reward: 500 for POST /score: serve-reward could not answer: RuntimeError: no list here"
    ]
    no_traceback(serve.logs, capfd)
    assert answers_a_good_request(server)


# ----------------------------------------------------------------------------- the API key


@loopback
def test_with_an_api_key_every_request_needs_the_bearer_token(serve, capfd):
    import httpx2

    server = serve(api_key=TOKEN)
    with httpx2.Client(trust_env=False) as client:
        missing = client.post(server.url, content=GOOD)
        wrong = client.post(server.url, content=GOOD, headers={"Authorization": "Bearer " + TOKEN[:-1]})
        basic = client.post(server.url, content=GOOD, headers={"Authorization": "Basic " + TOKEN})
        up = client.get(server.url)
        right = client.post(server.url, content=GOOD, headers={"Authorization": f"Bearer {TOKEN}"})
        right_up = client.get(server.url, headers={"Authorization": f"Bearer {TOKEN}"})
    for refused in (missing, wrong, basic, up):
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert missing.json() == {
        "error": "no API key: send the header Authorization: Bearer KEY (the server's key)"
    }
    assert wrong.json() == {
        "error": "the API key is wrong (Authorization: Bearer KEY must carry the server's key)"
    }
    assert right.status_code == 200 and right.json() == {"rewards": [3.0, 2.0]}
    assert right_up.json() == {"reward_function": "lengths"}
    assert len(serve.logs) == 4 and all(line.startswith("serve-reward: 401 for ") for line in serve.logs)
    printed = capfd.readouterr()
    assert TOKEN not in "\n".join(serve.logs) + printed.out + printed.err
    assert TOKEN[:-1] not in "\n".join(serve.logs)


@pytest.mark.parametrize("key", ["", "two words", "caf\u00e9", "line\nbreak"])
def test_an_api_key_that_cannot_be_a_header_is_refused_without_quoting_it(key):
    with pytest.raises(ValueError, match="must be printable ASCII without spaces") as caught:
        RewardServer(scores, api_key=key)
    assert not key or key not in str(caught.value)


# ----------------------------------------------------------------------------- the command line


def test_a_url_given_as_the_function_is_refused_in_one_line(capsys):
    from grpokit.cli import main

    assert main(["serve-reward", "http://127.0.0.1:1/", "--port", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "grpokit serve-reward: error: 'http://127.0.0.1:1/' is a URL: serve-reward serves a Python function "
        "(module:function or path/file.py:function); a URL already names a server: give it to training as "
        "{url: ...}",
        "(run with --debug for the traceback)",
    ]


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.0.1", "::1", "localhost"])
def test_loopback_hosts_are_not_warned_about(host):
    assert exposure_warning(host, 8000, "f", keyed=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "", "::", "192.168.1.5", "scorer.example"])
def test_other_hosts_are_warned_about(host):
    open_line = exposure_warning(host, 8000, "f", keyed=False)
    keyed_line = exposure_warning(host, 8000, "f", keyed=True)
    assert open_line is not None and keyed_line is not None and "\n" not in open_line + keyed_line
    assert "anyone who can reach port 8000 can call reward function 'f', with no authentication" in open_line
    assert "set GRPOKIT_API_KEY (or --api-key)" in open_line
    assert "with the API key, which plain HTTP sends unencrypted" in keyed_line


@pytest.mark.parametrize("keyed", [False, True])
def test_the_cli_warns_about_a_non_loopback_host_and_takes_the_key_from_the_environment(
    capsys, monkeypatch, keyed
):
    """`--host 0.0.0.0 --port 0`: the warning on stderr before serving, the key from GRPOKIT_API_KEY
    passed on and never printed. (The server given the options binds 127.0.0.1 here, and stops at once
    as at Ctrl-C.)"""
    from grpokit.cli import main

    given: dict[str, Any] = {}

    class StopsAtOnce(RewardServer):
        def __init__(self, fn: Any, host: str, port: int, **options: Any) -> None:
            given.update(options, host=host)
            super().__init__(fn, "127.0.0.1", port, log=lambda line: None, **options)

        def serve_forever(self) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(grpokit.rewards.serving, "RewardServer", StopsAtOnce)  # what serve_command makes
    if keyed:
        monkeypatch.setenv("GRPOKIT_API_KEY", TOKEN)
    else:
        monkeypatch.delenv("GRPOKIT_API_KEY", raising=False)
    assert main(["serve-reward", "exact_answer", "--host", "0.0.0.0", "--port", "0"]) == 0
    out, err = capsys.readouterr()
    assert given["host"] == "0.0.0.0" and given["api_key"] == (TOKEN if keyed else None)
    warning = err.splitlines()
    assert len(warning) == 1 and warning[0].startswith(
        "grpokit serve-reward: warning: --host 0.0.0.0 is not this machine's loopback: anyone who can reach "
        "port "
    )
    assert ("with the API key" in warning[0]) == keyed and ("no authentication" in warning[0]) != keyed
    assert out.splitlines()[-1] == "stopped" and TOKEN not in out + err


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--max-body-mb", "0"], "--max-body-mb 0 must be above 0"),
        (["--request-timeout", "-1"], "--request-timeout -1 must be above 0"),
        (["--max-connections", "0"], "--max-connections 0 must be at least 1"),
        (["--api-key", "has space"], "the API key (--api-key or GRPOKIT_API_KEY) must be printable ASCII"),
    ],
)
def test_bad_serving_options_are_one_line(capsys, option, said):
    from grpokit.cli import main

    assert main(["serve-reward", "exact_answer", "--port", "0", *option]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("grpokit serve-reward: error: ") and said in err[0], err
    assert "has space" not in err[0]
