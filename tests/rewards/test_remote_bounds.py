"""Remote rewards against peers that misbehave, and credentials that must not leak: a reward server's
password (USER:PASSWORD@ in the url) or token (api_key_env) is sent to it and written or printed
nowhere (metric names, metrics.jsonl, TensorBoard events, both config.yaml files, errors,
print-config, the doctor's table); an answer is bounded in size (a gzip bomb, an endless stream) and a
try in time (a server answering a byte at a time); a local server is reached directly whatever proxy
the environment sets; an https:// server on loopback with its own certificate works with `ca_bundle`
and fails at once, in one line, without it.

The peers are stdlib http.servers of this file's own on 127.0.0.1 (port 0: a free one), serving from
a thread and closed when each test ends; tests that connect to them are marked `loopback`."""

from __future__ import annotations

import base64
import datetime
import gzip
import ipaddress
import json
import shutil
import socket
import ssl
import subprocess
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from grpokit.cli import main
from grpokit.config import ConfigError, GRPOConfig, load_config
from grpokit.config.remote_reward import redact_url
from grpokit.rewards import RemoteReward, RemoteRewardError
from grpokit.rewards.remote import MAX_ANSWER_BYTES, default_name, is_loopback
from tests.helpers import read_metrics, tiny_run

loopback = pytest.mark.loopback

PASSWORD = "s3cretPW"
TOKEN = "tok-9f8e7d6c5b4a3210"
TOKEN_ENV = "GRPOKIT_TEST_REWARD_TOKEN"
BASIC = "Basic " + base64.b64encode(f"alice:{PASSWORD}".encode()).decode()
# what a run writes and prints, small and fast: the tests' tiny run, an evaluation, sample completions
# and a checkpoint at each step, TensorBoard events (each caller names the steps)
TINY = tiny_run(
    "max_steps",
    task="addition",
    micro_batch_size=16,
    eval_steps=1,
    log_completions_steps=1,
    save_steps=1,
    report_to=["tensorboard"],
)

Respond = Callable[["Handler", bytes], None]


class Peer(ThreadingHTTPServer):
    """A server on 127.0.0.1 answering each POST with `respond(handler, body)`; records each request's
    Authorization header and how many connections came. With `tls` (an SSL context), HTTPS."""

    daemon_threads = True

    def __init__(self, respond: Respond, tls: ssl.SSLContext | None = None) -> None:
        self.respond, self.tls = respond, tls
        self.authorizations: list[str | None] = []
        self.connections = 0
        super().__init__(("127.0.0.1", 0), Handler)
        self.port = self.server_address[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/score"

    def finish_request(self, request: Any, client_address: Any) -> None:
        self.connections += 1
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        try:
            wrapped = self.tls.wrap_socket(request, server_side=True)  # request's own is detached now
        except (ssl.SSLError, OSError):  # the client refused our certificate
            return
        with wrapped:
            super().finish_request(wrapped, client_address)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Peer

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.authorizations.append(self.headers.get("Authorization"))
        try:
            self.server.respond(self, body)
        except OSError:  # the client stopped reading (a bound, a deadline): expected
            self.close_connection = True

    def answer(self, status: int, data: bytes, **headers: str) -> None:
        self.send_response(status)
        for key, value in {"Content-Length": str(len(data)), **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def chunked(self, chunks: Any, wait: float = 0.0) -> None:
        """An answer of unknown length (Transfer-Encoding: chunked), one chunk after another."""
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
            time.sleep(wait)
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def peer():
    """peer(respond, tls=None) -> a Peer serving from a thread; every one is closed at the end."""
    peers: list[Peer] = []

    def start(respond: Respond, tls: ssl.SSLContext | None = None) -> Peer:
        server = Peer(respond, tls)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        peers.append(server)
        return server

    yield start
    for server in peers:
        server.shutdown()
        server.server_close()


def ones_scores(body: bytes) -> bytes:
    """The share of '1' characters of each completion (a reward a random tiny policy earns sometimes)."""
    completions = json.loads(body)["completions"]
    return json.dumps({"rewards": [c.count("1") / max(len(c), 1) for c in completions]}).encode()


def scoring(expected: str | None) -> Respond:
    """Scores when the request carries the Authorization header `expected`, else a 401."""

    def respond(handler: Handler, body: bytes) -> None:
        if handler.headers.get("Authorization") != expected:
            handler.answer(401, b'{"error": "who are you?"}')
        else:
            handler.answer(200, ones_scores(body))

    return respond


def failing(handler: Handler, body: bytes) -> None:
    """A 500 whose body repeats the Authorization header it got (a careless server's error page)."""
    handler.answer(500, f"scorer crashed; request had {handler.headers.get('Authorization')}".encode())


def leaks(data: bytes | str) -> list[str]:
    """Which credential of this file's (as written, or as basic auth sends it) is in `data`."""
    text = data if isinstance(data, bytes) else data.encode()
    forms = {"password": PASSWORD, "basic auth": BASIC.split()[1], "token": TOKEN}
    return [name for name, form in forms.items() if form.encode() in text]


def files_leaking(root: Path) -> dict[str, list[str]]:
    """Every file under `root` (read as bytes: TensorBoard events, checkpoints, all) that holds one."""
    return {
        str(p.relative_to(root)): found
        for p in root.rglob("*")
        if p.is_file()
        if (found := leaks(p.read_bytes()))
    }


# ----------------------------------------------------------------------------- credentials


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://alice:s3cretPW@127.0.0.1:18010/ok", "http://alice:***@127.0.0.1:18010/ok"),
        ("https://alice:p%40ss@host/x?a=1", "https://alice:***@host/x?a=1"),
        ("http://alice@host/", "http://alice@host/"),  # a user alone is no secret
        (
            "http://h/s?token=abc&n=2&API_KEY=k&X-Api-Key=z&sig=q",
            "http://h/s?token=***&n=2&API_KEY=***&X-Api-Key=***&sig=***",
        ),
        (
            "http://h/s?client_secret=c&access_token=t&monkey=1&keys=2",
            "http://h/s?client_secret=***&access_token=***&monkey=1&keys=2",
        ),
        ("http://h:8000/score", "http://h:8000/score"),
        ("http://u:pw@[::1/", "http://u:***@[::1/"),  # not parseable, still hidden
    ],
)
def test_redact_url_hides_passwords_and_secret_parameters(url, shown):
    assert redact_url(url) == shown
    assert redact_url(shown) == shown  # what config.yaml holds redacts to itself: a resume compares it


def test_a_default_name_has_no_user_nor_password():
    assert default_name("http://alice:s3cretPW@127.0.0.1:18010/ok/") == "remote:127.0.0.1:18010/ok"
    assert default_name("https://[::1]:8443/score?token=abc") == "remote:[::1]:8443/score"
    remote = RemoteReward("http://alice:s3cretPW@127.0.0.1:18010/ok?sig=XYZW1234")
    assert PASSWORD not in repr(remote) and "XYZW1234" not in repr(remote)
    assert (
        repr(remote)
        == "RemoteReward('http://alice:***@127.0.0.1:18010/ok?sig=***', name='remote:127.0.0.1:18010/ok')"
    )
    with pytest.raises(ValueError) as caught:
        RemoteReward("http://alice:s3cretPW@127.0.0.1:18010/ok", timeout=0)
    assert str(caught.value).startswith("RemoteReward('http://alice:***@127.0.0.1:18010/ok'): timeout 0 must")


def _cli(capsys: Any, *argv: str) -> tuple[int, str]:
    """`grpokit ARGV` in this process: its exit code and everything it printed (stdout and stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


@loopback
@pytest.mark.slow
def test_a_password_in_the_url_is_written_and_printed_nowhere(tmp_path, peer, capfd, monkeypatch):
    """The acceptance test: a real CLI run (TensorBoard on, a checkpoint each step) scored by a server
    that takes only alice's password; the run's directory, every checkpoint, the events and everything
    printed hold no trace of it, the metrics name the server remote:HOST:PORT/PATH, and config.yaml
    holds the url redacted; a resume of that run compares its config.yaml as equal and goes on. A
    server that fails prints the error line, without it; so do print-config and the doctor."""
    monkeypatch.setenv("COLUMNS", "250")  # the doctor's table on one line a row
    server = peer(scoring(BASIC))
    url = f"http://alice:{PASSWORD}@127.0.0.1:{server.port}/ok"
    entry = f"reward_funcs=[{{url: '{url}'}}]"
    out = tmp_path / "run"
    code, printed = _cli(capfd, "train", f"output_dir={out}", "max_steps=2", *TINY, entry)
    assert code == 0, printed
    assert server.authorizations and set(server.authorizations) == {BASIC}  # the password was sent
    rows = read_metrics(out)
    name = f"remote:127.0.0.1:{server.port}/ok"
    assert all(f"rewards/{name}/mean" in row for row in rows if "loss" in row) and len(rows) == 5
    assert f"url: http://alice:***@127.0.0.1:{server.port}/ok" in (out / "config.yaml").read_text()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert list(out.rglob("events.out.tfevents.*"))  # TensorBoard wrote, and is read below too
    assert leaks(printed) == [] and files_leaking(out) == {}

    code, printed = _cli(capfd, "train", f"output_dir={out}", "max_steps=3", "resume=true", *TINY, entry)
    assert code == 0, printed
    assert "checkpoint-3" in {p.name for p in out.glob("checkpoint-*")}
    assert leaks(printed) == [] and files_leaking(out) == {}

    broken = peer(failing)
    bad_url = f"http://alice:{PASSWORD}@127.0.0.1:{broken.port}/ok"
    failed = tmp_path / "failed"
    code, printed = _cli(
        capfd,
        "train",
        f"output_dir={failed}",
        "max_steps=1",
        *TINY,
        f"reward_funcs=[{{url: '{bad_url}', retries: 0}}]",
    )
    assert code == 2
    assert (
        f"POST http://alice:***@127.0.0.1:{broken.port}/ok answered HTTP 500 Internal Server Error" in printed
    )
    assert "scorer crashed; request had Basic" in printed  # the server's line, its credential hidden
    assert leaks(printed) == [] and files_leaking(failed) == {}

    code, printed = _cli(capfd, "print-config", *TINY, entry)
    assert code == 0 and f"url: http://alice:***@127.0.0.1:{server.port}/ok" in printed
    assert leaks(printed) == []
    code, printed = _cli(capfd, "doctor", f"output_dir={tmp_path / 'doctor'}", *TINY, entry)
    assert name in printed and leaks(printed) == [], printed
    code, printed = _cli(
        capfd,
        "doctor",
        f"output_dir={tmp_path / 'doctor'}",
        *TINY,
        f"reward_funcs=[{{url: '{bad_url}', retries: 0}}]",
    )
    assert leaks(printed) == [], printed


@loopback
def test_api_key_env_sends_a_bearer_token_that_is_shown_nowhere(peer, monkeypatch, capsys):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    server = peer(scoring(f"Bearer {TOKEN}"))
    remote = RemoteReward(server.url, api_key_env=TOKEN_ENV)
    assert remote(["a", "b"], ["11", "1x"]) == [1.0, 0.5]
    assert server.authorizations == [f"Bearer {TOKEN}"]
    assert leaks(repr(remote)) == []
    broken = peer(failing)
    with pytest.raises(RemoteRewardError) as caught:
        RemoteReward(broken.url, api_key_env=TOKEN_ENV, retries=0)(["a"], ["1"])
    assert (
        "answered HTTP 500 Internal Server Error after 1 try: scorer crashed; request had Bearer ***;"
        in str(caught.value)
    )
    assert leaks(str(caught.value)) == []
    entry = f"reward_funcs=[{{url: '{server.url}', api_key_env: {TOKEN_ENV}}}]"
    assert main(["print-config", *TINY, entry]) == 0
    printed = capsys.readouterr().out
    assert f"api_key_env: {TOKEN_ENV}" in printed and leaks(printed) == []


@pytest.mark.parametrize(
    ("options", "environment", "said"),
    [
        (
            f"api_key_env: {TOKEN_ENV}",
            {},
            f"api_key_env names the environment variable {TOKEN_ENV}, which is unset; set it",
        ),
        (
            f"api_key_env: {TOKEN_ENV}",
            {TOKEN_ENV: " "},
            f"the environment variable {TOKEN_ENV}, which is empty;",
        ),
        (
            f"api_key_env: {TOKEN_ENV}",
            {TOKEN_ENV: "two\nlines"},
            f"the environment variable {TOKEN_ENV} (api_key_env) holds a space, a line break",
        ),
        ("api_key_env: ''", {}, "api_key_env '' must name an environment variable"),
        (
            "ca_bundle: no/such.pem",
            {},
            "ca_bundle 'no/such.pem' is not a file (no such file); give the path of a PEM file",
        ),
        ("ca_bundle: not_pem.txt", {}, "ca_bundle 'not_pem.txt' cannot be read as PEM certificates"),
    ],
)
def test_api_key_env_and_ca_bundle_are_checked_when_the_config_loads(
    tmp_path, monkeypatch, options, environment, said
):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    for key, value in environment.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "not_pem.txt").write_text("hello\n")
    with pytest.raises(ConfigError) as caught:
        load_config(GRPOConfig, None, [f"reward_funcs=[{{url: 'http://127.0.0.1:8000/', {options}}}]"])
    line = str(caught.value).splitlines()[-1]
    assert line.strip().startswith("reward_funcs entry {") and said in line, line
    assert "two" not in line  # the variable's value is never repeated


def test_a_password_and_api_key_env_together_are_refused(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(ConfigError) as caught:
        load_config(
            GRPOConfig, None, [f"reward_funcs=[{{url: 'http://a:{PASSWORD}@h/', api_key_env: {TOKEN_ENV}}}]"]
        )
    line = str(caught.value).splitlines()[-1]
    assert "both a user in the url and api_key_env" in line and leaks(line) == []
    assert "'url': 'http://a:***@h/'" in line


def test_a_config_error_about_a_url_entry_does_not_repeat_its_password():
    """Whatever is wrong with the entry (an option, an extra key, the port, or a mistyped entry that
    YAML cannot read and is taken for a python reference), the line shows the url redacted."""
    for entry in [
        f"{{url: 'http://a:{PASSWORD}@h:1/', timeout: 0}}",
        f"{{url: 'http://a:{PASSWORD}@h:1/', batch_size: 4}}",
        f"{{url: 'http://a:{PASSWORD}@h:1/', retries: x}}",
        f"{{url: 'http://a:{PASSWORD}@h:99999/'}}",
        f"{{url: 'http://a:{PASSWORD}@h:1/'",  # unclosed
    ]:
        with pytest.raises(ConfigError) as caught:
            load_config(GRPOConfig, None, [f"reward_funcs=[{entry}]"])
        assert leaks(str(caught.value)) == [] and "http://a:***@h:" in str(caught.value), str(caught.value)


# ----------------------------------------------------------------------------- bounds


def gzip_bomb(inflated: int) -> bytes:
    """A gzip stream of `inflated` zero bytes (about a thousandth of that, compressed)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: a gzip header and trailer
    block = bytes(2**20)
    return b"".join([*(packer.compress(block) for _ in range(inflated // len(block))), packer.flush()])


@pytest.mark.slow  # (waits out timeouts or builds a large payload, 1-2 s: the full suite runs it)
@loopback
def test_an_answer_past_16_mib_is_one_line_and_not_tried_again(peer):
    """A gzip answer of 256 KiB that inflates to 256 MiB, and an answer that goes on (chunked: 64 MiB,
    a server that would never stop): the client stops reading past MAX_ANSWER_BYTES, and holds no
    more than a bounded amount meanwhile."""
    bomb = gzip_bomb(256 * 2**20)
    assert len(bomb) < 2**20
    zipped = peer(lambda handler, _: handler.answer(200, bomb, **{"Content-Encoding": "gzip"}))
    endless = peer(lambda handler, _: handler.chunked(bytes(2**16) for _ in range(2**10)))
    for server in (zipped, endless):
        tracemalloc.start()
        try:
            with pytest.raises(RemoteRewardError) as caught:
                RemoteReward(server.url, retries=3, backoff=0.01, name="big")(["a"], ["1"])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert str(caught.value).startswith(
            f"reward function 'big': POST {server.url} answered more than 16 MiB (not tried again); "
        )
        assert len(server.authorizations) == 1  # not tried again
        assert peak < 4 * MAX_ANSWER_BYTES, peak  # 256 MiB unbounded


@loopback
def test_a_compressed_answer_within_the_bound_is_read(peer):
    scores = b'{"rewards": [0.25, null]}'
    for encoding, data in [("gzip", gzip.compress(scores)), ("deflate", zlib.compress(scores))]:
        server = peer(
            lambda handler, _, e=encoding, d=data: handler.answer(200, d, **{"Content-Encoding": e})
        )
        assert RemoteReward(server.url)(["a", "b"], ["1", "2"]) == [0.25, None]
    weird = peer(lambda handler, _: handler.answer(200, scores, **{"Content-Encoding": "br"}))
    with pytest.raises(
        RemoteRewardError,
        match=r"answered Content-Encoding 'br', which was not asked for \(not tried again\)",
    ):
        RemoteReward(weird.url)(["a", "b"], ["1", "2"])


@pytest.mark.slow  # (waits out timeouts or builds a large payload, 1-2 s: the full suite runs it)
@loopback
def test_a_server_answering_a_byte_at_a_time_is_cut_off_at_the_timeout(peer):
    """Each wait is short (a byte every 50 ms), the whole answer would take 100 s: each try ends at
    the entry's timeout, is tried again like any timeout, and the line says so."""
    slow = peer(lambda handler, _: handler.chunked((b" " for _ in range(2000)), wait=0.05))
    began = time.monotonic()
    with pytest.raises(RemoteRewardError) as caught:
        RemoteReward(slow.url, timeout=0.5, retries=1, backoff=0.05, name="slow")(["a"], ["1"])
    took = time.monotonic() - began
    assert str(caught.value).startswith(
        f"reward function 'slow': POST {slow.url} did not finish answering within 0.5 s, after 2 tries; "
    )
    assert len(slow.authorizations) == 2
    assert 1.0 <= took < 1.8, took  # two tries of 0.5 s and a backoff


# ----------------------------------------------------------------------------- proxies


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "LOCALHOST",
        "localhost.",
        "foo.localhost",
        "127.0.0.1",
        "127.1.2.3",
        "::1",
        "0.0.0.0",
        "::",
        "::ffff:127.0.0.1",
        "::ffff:0.0.0.0",
        "127.1",  # the shorthand IPv4 forms a connect takes too
        "2130706433",
        "0x7f000001",
    ],
)
def test_every_address_of_this_machine_is_loopback(host):
    assert is_loopback(host)


@pytest.mark.parametrize(
    "host",
    [
        "10.0.0.1",
        "::ffff:10.0.0.1",
        "notlocalhost",
        "localhost.example.com",
        "fe80::1",
        "2001:db8::1",
        "10.1",
        "1",
    ],
)
def test_other_hosts_are_not_loopback(host):
    assert not is_loopback(host)


@loopback
@pytest.mark.parametrize("host", ["0.0.0.0", "[::ffff:127.0.0.1]", "LOCALHOST"])
def test_a_local_server_is_reached_directly_whatever_the_proxy(peer, monkeypatch, host):
    """With every proxy variable at a port nothing listens on, a server on this machine named by the
    unspecified address, IPv4-mapped loopback or LOCALHOST is still scored (through the proxy, the
    connect would be refused)."""
    if host.startswith("[") and not socket.has_ipv6:
        pytest.skip("no IPv6 sockets here")
    with socket.socket() as dead:
        dead.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{dead.getsockname()[1]}"
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
            monkeypatch.setenv(name, proxy)
        for name in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(name, raising=False)
        server = peer(scoring(None))
        assert RemoteReward(f"http://{host}:{server.port}/score", retries=0)(["a"], ["1"]) == [1.0]


# ----------------------------------------------------------------------------- https


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key (cert.pem, key.pem in `directory`): made with
    the `cryptography` package, else the openssl command; the test is skipped without either."""
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    try:
        import cryptography  # noqa: F401
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is here")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", str(key_path), "-out", str(cert_path), "-days", "1", "-subj", "/CN=grpokit test",
             "-addext", "subjectAltName=IP:127.0.0.1", "-addext", "basicConstraints=critical,CA:TRUE"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        return cert_path, key_path
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "grpokit test reward server")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


@loopback
def test_https_with_its_own_certificate_fails_at_once_without_ca_bundle_and_scores_with_it(
    tmp_path, peer, monkeypatch
):
    cert, key = self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server = peer(scoring(None), tls=tls)
    for name in ("SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)
    began = time.monotonic()
    with pytest.raises(RemoteRewardError) as caught:
        RemoteReward(server.url, retries=3, backoff=1.0, name="tls")(["a"], ["1"])
    assert time.monotonic() - began < 1.0 and server.connections == 1  # not tried again
    assert str(caught.value) == (
        f"reward function 'tls': POST {server.url} failed: the server's certificate is not trusted "
        "(self-signed certificate) (not tried again); give the entry's ca_bundle: PATH, a PEM file with "
        "the certificate of the CA that signed it (a self-signed server's own certificate), or set "
        "SSL_CERT_FILE to one"
    )
    assert RemoteReward(server.url, ca_bundle=str(cert))(["a", "b"], ["1", "x"]) == [1.0, 0.0]
    cfg = load_config(GRPOConfig, None, [f"reward_funcs=[{{url: '{server.url}', ca_bundle: {cert}}}]"])
    from grpokit.config.plan import RewardSpec
    from grpokit.train.inputs import configured_rewards

    (configured,) = configured_rewards(RewardSpec(funcs=tuple(cfg.reward_funcs)), task=None)
    assert configured(["a"], ["11"]) == [1.0]
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the environment's setting applies on loopback too
    assert RemoteReward(server.url)(["a"], ["1"]) == [1.0]
