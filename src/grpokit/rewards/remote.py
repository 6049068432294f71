"""A reward function that a server computes: `RemoteReward(url)` is f(prompts, completions, **columns)
-> list[float | None], TRL's convention, scored by one HTTP POST per batch.

The contract (what `grpokit serve-reward` answers, and what any server of yours must):

    POST url   {"prompts": [...], "completions": [...], "completion_ids": [[...], ...], <column>: [...], ...}
    200        {"rewards": [float | null, ...]}          one per completion, in order; null = unscorable

Every list holds one value per completion. Prompts and completions are what the scorer passes (text,
or TRL's message lists with conversational prompts); a dataset column whose values JSON cannot carry
(an object, NaN) is not sent. Any other answer is a `RemoteRewardError`, one line naming the reward,
the URL, the status and the first line of the body.

The client is httpx2's (the HTTP client huggingface_hub already brings), one per RemoteReward: its
connection pool keeps connections open between batches and lets several threads score at once (the
object is safe to call from several threads: a multi-process run's ranks, or your own pool). One try
may take `timeout` seconds in all: connecting, sending and the whole answer (a server that answers a
byte at a time is cut off there too), and an answer may hold MAX_ANSWER_BYTES once decoded (a gzip
answer is inflated as it arrives, up to that). Connection errors, timeouts and 5xx answers are tried
again up to `retries` times, after `backoff`, 2·`backoff`, 4·`backoff` ... seconds; a 4xx answer (the
request is wrong: trying again cannot help), a 3xx (redirects are not followed), an answer past the
size bound and a certificate the client does not trust are not.

Credentials: USER:PASSWORD@ in the url is sent as basic auth, `api_key_env` names an environment
variable whose token is sent as `Authorization: Bearer TOKEN`; neither is ever written or printed
(metric names, errors and config.yaml show the url through `redact_url`: the password, and query
parameters such as token= or sig=, as ***). An https:// server's certificate is checked against
`ca_bundle` (a PEM file: a private CA, or a self-signed server's own certificate) when given, else
against SSL_CERT_FILE / SSL_CERT_DIR when set, else the system's certificates. The environment's
proxy settings (HTTP_PROXY, HTTPS_PROXY, NO_PROXY) apply to other hosts, as for huggingface_hub; an
address on this machine (localhost and *.localhost, 127.0.0.0/8, ::1, 0.0.0.0, ::, ::ffff:127.x.x.x)
is always reached directly.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import socket
import ssl
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from ..config.remote_reward import (
    DEFAULT_RETRIES,
    DEFAULT_TIMEOUT,
    bearer_token,
    ca_context,
    check_remote_reward,
    redact_url,
    url_secrets,
)
from .scoring import RewardFunctionError

BODY_LINE_CHARS = 200  # the most characters of a server's answer that an error repeats
MAX_ANSWER_BYTES = 16 * 2**20  # an answer's body, decoded: ample for one number per completion
SCRUBBED_CHARS = 4  # a credential this long or longer is hidden in what a server or the network says
ACCEPTED_ENCODINGS = "gzip, deflate"  # what the client inflates itself, within MAX_ANSWER_BYTES


class RemoteRewardError(RewardFunctionError):
    """A reward server could not be reached in time, answered an error status, or answered something
    that is not one reward per completion."""


class _TooSlow(Exception):
    """A try went past the entry's timeout (on the caller's side: the try's thread is told to stop)."""


class _BadAnswer(Exception):
    """An answer not read to its end: past MAX_ANSWER_BYTES, or in an encoding that does not decode.
    Its message is the line's "answered ..." part; not tried again."""


def is_loopback(host: str) -> bool:
    """Whether `host` (a URL's hostname) is this machine: localhost or a name under .localhost
    (RFC 6761), a loopback address (127.0.0.0/8, ::1, ::ffff:127.0.0.0/104) or an unspecified one
    (0.0.0.0, ::, which a connect reaches this machine at)."""
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:  # the shorthand IPv4 forms a connect also takes: 127.1, 2130706433, 0x7f000001
            address = ipaddress.ip_address(socket.inet_aton(host))
        except (OSError, ValueError):
            return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:a.b.c.d is the IPv4 address a.b.c.d
    return any(a is not None and (a.is_loopback or a.is_unspecified) for a in (address, mapped))


def untrusted_certificate(error: BaseException | None) -> str | None:
    """Why a TLS handshake did not trust the server's certificate, when that is what `error` (or an
    error it was raised from) is; None for any other failure."""
    chain: list[BaseException] = []
    while error is not None and all(error is not e for e in chain):
        chain.append(error)
        error = error.__cause__ or error.__context__
    for cause in chain:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return cause.verify_message or str(cause)
    return "certificate verify failed" if any("CERTIFICATE_VERIFY_FAILED" in str(e) for e in chain) else None


def read_answer(chunks: Any, encoding: str, cancelled: threading.Event) -> bytes:
    """The body from `chunks` (the raw bytes as they arrive) decoded from `encoding` (identity, gzip,
    deflate), stopping with _BadAnswer past MAX_ANSWER_BYTES: however small the compressed body, no
    more than that is ever inflated. Returns early (what came) once `cancelled` is set."""
    codings = [c.strip().lower() for c in encoding.split(",") if c.strip().lower() not in ("", "identity")]
    if len(codings) > 1 or (codings and codings[0] not in ("gzip", "x-gzip", "deflate")):
        raise _BadAnswer(
            f"answered Content-Encoding {encoding.strip()!r}, which was not asked for (not tried again)"
        )
    inflate = zlib.decompressobj(zlib.MAX_WBITS | 32) if codings else None  # a gzip or zlib stream
    answer = bytearray()
    try:
        for raw in chunks:
            while raw and not cancelled.is_set():
                room = MAX_ANSWER_BYTES + 1 - len(answer)  # at least 1 (0 would mean no bound)
                answer += inflate.decompress(raw, room) if inflate else raw
                raw = inflate.unconsumed_tail if inflate else b""
                if len(answer) > MAX_ANSWER_BYTES:
                    raise _BadAnswer(f"answered more than {MAX_ANSWER_BYTES // 2**20} MiB (not tried again)")
            if cancelled.is_set():
                return bytes(answer)
        if inflate:
            answer += inflate.flush(MAX_ANSWER_BYTES + 1 - len(answer))
    except zlib.error as error:
        said = f"Content-Encoding {encoding.strip()!r}"
        raise _BadAnswer(f"answered a body its {said} does not decode ({error}) (not tried again)") from None
    if len(answer) > MAX_ANSWER_BYTES:
        raise _BadAnswer(f"answered more than {MAX_ANSWER_BYTES // 2**20} MiB (not tried again)")
    return bytes(answer)


def first_line(text: str) -> str:
    """The first non-empty line of a server's answer, cut to BODY_LINE_CHARS (an empty body said so)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "(empty body)"
    line = lines[0]
    return line if len(line) <= BODY_LINE_CHARS else line[: BODY_LINE_CHARS - 1] + "…"


def request_body(prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, Any]) -> bytes:
    """The JSON request: prompts, completions and every column JSON can carry (strict JSON: no NaN)."""
    parts = []
    for key, values in {"prompts": list(prompts), "completions": list(completions), **columns}.items():
        try:
            if not isinstance(values, (list, tuple)):
                raise TypeError(f"a {type(values).__name__}, not a list")
            encoded = json.dumps(values, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError) as error:
            if key in ("prompts", "completions"):
                raise RewardFunctionError(
                    f"the {key} cannot be sent to a reward server as JSON ({error}); give text or messages."
                ) from error
            continue  # a column JSON cannot carry (an object, NaN, not a list): not sent
        parts.append(f"{json.dumps(key)}: {encoded}")
    return ("{" + ", ".join(parts) + "}").encode()


def default_name(url: str) -> str:
    """remote:HOST:PORT/PATH, the name a RemoteReward's metrics carry when it is given none (no user
    or password: a name is written everywhere)."""
    parts = urlsplit(url)
    return f"remote:{parts.netloc.rpartition('@')[2]}{parts.path.rstrip('/')}"


def _label(url: str) -> str:
    """How errors about a RemoteReward's options begin: RemoteReward('URL'), the url redacted."""
    return f"RemoteReward({redact_url(url)!r})"


# What a pickled RemoteReward carries: its options (the url holds what credentials it names itself)
_OPTIONS = ("url", "timeout", "retries", "backoff", "__name__", "api_key_env", "ca_bundle")


class RemoteReward:
    """A reward function computed by a server at `url` (the module docstring has the contract, the
    bounds, the retries and the connection pool). `name` names it in metrics and errors (default
    remote:HOST:PORT/PATH). `api_key_env`: an environment variable holding a token, sent as
    `Authorization: Bearer TOKEN` (unset or empty: ValueError at once). `ca_bundle`: a PEM file of the
    certificates an https:// server's is checked against. Usable wherever a reward function is:
    `reward_funcs=[RemoteReward(url)]`, or `{url: ...}` in a config."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        name: str | None = None,
        backoff: float = 0.5,
        api_key_env: str | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        label = _label(url)
        check_remote_reward(label, url, timeout, retries, name, api_key_env, ca_bundle)
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 0 <= backoff <= 60:
            raise ValueError(f"{label}: backoff {backoff!r} must be a number of seconds in [0, 60]")
        self.url = url.strip()
        self.timeout, self.retries, self.backoff = float(timeout), retries, float(backoff)
        self.__name__ = name.strip() if name else default_name(self.url)
        self.api_key_env, self.ca_bundle = api_key_env, ca_bundle
        self._connect()

    def _connect(self) -> None:
        """What the client is made from, beyond the options: the token read from `api_key_env`'s
        variable, the certificates of `ca_bundle`, the credentials hidden in errors, the lock; no
        client yet (`client` makes it at the first call)."""
        label = _label(self.url)
        self._token = bearer_token(label, self.api_key_env) if self.api_key_env is not None else None
        self._verify = ca_context(label, self.ca_bundle) if self.ca_bundle is not None else None
        secrets = [*url_secrets(self.url), *([self._token] if self._token else [])]
        self._secrets = [s for s in secrets if len(s) >= SCRUBBED_CHARS]
        self._client: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """The options alone (max_staleness sends reward functions to the rollout worker by pickling):
        not the client, its lock or the certificates' SSL context, and never the token, which the other
        side reads again from `api_key_env`'s variable (`__setstate__`)."""
        return {key: self.__dict__[key] for key in _OPTIONS}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """The options, then a fresh `_connect` in this process: the token from its environment (one
        line naming the variable when it is unset here), the certificates read again, a new lock."""
        self.__dict__.update(state)
        self._connect()

    def __repr__(self) -> str:
        return f"RemoteReward({redact_url(self.url)!r}, name={self.__name__!r})"

    def client(self) -> Any:
        """The httpx2 client (made at the first call, then shared by every thread). A server on this
        machine is reached directly (no proxy), and checked against the environment's certificate
        settings all the same."""
        with self._lock:
            if self._client is None:
                import httpx2

                headers = {
                    "content-type": "application/json",
                    "accept": "application/json",
                    "accept-encoding": ACCEPTED_ENCODINGS,
                }
                if self._token:
                    headers["authorization"] = f"Bearer {self._token}"
                local = is_loopback(urlsplit(self.url).hostname or "")
                verify = self._verify
                if verify is None and local and self.url.lower().startswith("https:"):
                    verify = httpx2.create_ssl_context(trust_env=True)  # SSL_CERT_FILE, as for others
                self._client = httpx2.Client(
                    timeout=self.timeout,
                    trust_env=not local,
                    follow_redirects=False,
                    headers=headers,
                    verify=True if verify is None else verify,
                )
            return self._client

    def close(self) -> None:
        """Close the connections (a later call opens new ones)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> RemoteReward:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def __del__(self) -> None:
        """A RemoteReward that a run made from its config and dropped closes its connections here."""
        with contextlib.suppress(Exception):  # at interpreter exit the modules may be gone already
            self.close()

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any
    ) -> list[float | None]:
        body = request_body(prompts, completions, columns)
        return self._rewards(self._post(body), len(completions))

    def _scrubbed(self, text: str) -> str:
        """`text` (what the network or the server said) with every credential this reward sends as ***."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _error(self, what: str, advice: str) -> RemoteRewardError:
        return RemoteRewardError(
            f"reward function {self.__name__!r}: POST {redact_url(self.url)} {self._scrubbed(what)}; {advice}"
        )

    def _try(self, body: bytes) -> tuple[int, str, bytes]:
        """One request and its whole answer (status, reason, body) within `timeout` seconds, or
        _TooSlow. It runs on a thread of its own, so that no wait (connecting, a server that never
        answers, or one that answers a byte at a time) holds the caller past the deadline; that
        thread stops at its next chunk, or at httpx's own timeout of a wait."""
        outcome: dict[str, Any] = {}
        cancelled = threading.Event()

        def exchange() -> None:
            try:
                with self.client().stream("POST", self.url, content=body) as response:
                    encoding = response.headers.get("content-encoding", "")
                    answer = read_answer(response.iter_raw(), encoding, cancelled)
                    outcome["answer"] = (response.status_code, response.reason_phrase, answer)
            except BaseException as error:  # handed to the caller as it is
                outcome["error"] = error

        worker = threading.Thread(target=exchange, name=f"{self.__name__} POST", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            cancelled.set()
            raise _TooSlow
        if "error" in outcome:
            raise outcome["error"]
        return outcome["answer"]

    def _post(self, body: bytes) -> bytes:
        """The 2xx answer's body to `body`, after up to `retries` more tries on connection errors,
        timeouts and 5xx answers other than 500 (the server's function raised: the same batch would
        fail again)."""
        import httpx2

        tries = self.retries + 1
        for attempt in range(tries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            last = attempt + 1 == tries
            try:
                status, reason, answer = self._try(body)
            except (_TooSlow, _BadAnswer, httpx2.TransportError) as error:
                failure, again = self._failure(error, tries)
                if last or not again:
                    raise failure from None
                continue
            if status < 300:
                return answer
            refusal = self._refusal(status, reason, answer, tries, last)
            if refusal is not None:
                raise refusal
        raise AssertionError("unreachable")  # pragma: no cover - the last try returns or raises

    def _failure(self, error: BaseException, tries: int) -> tuple[RemoteRewardError, bool]:
        """The line for a try that got no whole answer, and whether another try may help."""
        import httpx2

        counted = f"{tries} tries" if tries > 1 else "1 try"
        if isinstance(error, _BadAnswer):  # past the size bound, or undecodable: the same again
            return self._error(str(error), CONTRACT), False
        if isinstance(error, (_TooSlow, httpx2.TimeoutException)):
            return self._error(
                f"did not finish answering within {self.timeout:g} s, after {counted}",
                "check that the server is running and keeps up, or raise the entry's timeout (it bounds "
                "each whole try: connecting, sending and the whole answer)",
            ), True
        reason = untrusted_certificate(error)
        if reason is not None:  # a handshake that failed once fails again: not tried again
            return self._error(
                f"failed: the server's certificate is not trusted ({reason}) (not tried again)",
                "give the entry's ca_bundle: PATH, a PEM file with the certificate of the CA that signed "
                "it (a self-signed server's own certificate), or set SSL_CERT_FILE to one",
            ), False
        failure = f"failed ({type(error).__name__}: {str(error) or 'no detail'})"
        return self._error(
            f"{failure} after {counted} (timeout {self.timeout:g} s each)",
            "check that the server is running and reachable, or raise the entry's timeout",
        ), True

    def _refusal(self, status: int, reason: str, answer: bytes, tries: int, last: bool) -> Any:
        """The line for an answer of status 3xx to 5xx, or None where another try may help (a 5xx other
        than 500, before the last try)."""
        status_line = f"answered HTTP {status} {reason}".rstrip()
        line = first_line(answer.decode("utf-8", "replace"))
        if status < 500:
            return self._error(
                f"{status_line} (not tried again): {line}",
                "redirects are not followed: give the final address"
                if status < 400
                else "the server refused the request: check the URL and what the server expects",
            )
        # 500: the server's own code failed on this very batch, and would again: not tried again.
        # 502, 503, 504 and the rest: a gateway, an overloaded or restarting server: tried again
        if status != 500 and not last:
            return None
        tried = (f"after {tries} tries" if tries > 1 else "after 1 try") if last else "(not tried again)"
        return self._error(
            f"{status_line} {tried}: {line}",
            "fix the server (its log has the details), or set on_reward_error=unscorable",
        )

    def _rewards(self, answer: bytes, size: int) -> list[float | None]:
        """One number or None per completion from a 2xx answer's body, else one line saying what came."""
        line = first_line(answer.decode("utf-8", "replace"))
        try:
            data = json.loads(answer)
        except ValueError:
            raise self._error(f"answered a body that is not JSON: {line}", CONTRACT) from None
        rewards = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(rewards, list):
            raise self._error(f"answered no 'rewards' list: {line}", CONTRACT)
        if len(rewards) != size:
            raise self._error(f"answered {len(rewards)} rewards for {size} completions", CONTRACT)
        for row, value in enumerate(rewards):
            if value is not None and (
                not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value))
            ):
                raise self._error(f"answered {value!r} for row {row}, not a number or null", CONTRACT)
        return rewards


CONTRACT = 'the server must answer {"rewards": [float | null, ...]}, one per completion, in order'
