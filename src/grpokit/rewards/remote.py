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
object is safe to call from several threads: a multi-process run's ranks, or your own pool). A request
may take `timeout` seconds to connect, to send and for each wait on the answer; connection errors,
timeouts and 5xx answers are tried again up to `retries` times, after `backoff`, 2·`backoff`, 4·`backoff`
... seconds; a 4xx answer (the request is wrong: trying again cannot help) and a 3xx (redirects are not
followed) are not. The environment's proxy settings (HTTP_PROXY, HTTPS_PROXY, NO_PROXY) and
certificate settings apply to other hosts, as for huggingface_hub; an address on this machine's
loopback (127.0.0.0/8, ::1, localhost) is always reached directly.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from ..config.remote_reward import DEFAULT_RETRIES, DEFAULT_TIMEOUT, check_remote_reward
from .scoring import RewardFunctionError

BODY_LINE_CHARS = 200  # the most characters of a server's answer that an error repeats


class RemoteRewardError(RewardFunctionError):
    """A reward server could not be reached in time, answered an error status, or answered something
    that is not one reward per completion."""


def is_loopback(host: str) -> bool:
    """Whether `host` (a URL's hostname) is this machine's loopback: localhost, 127.0.0.0/8 or ::1."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    """remote:HOST:PORT/PATH, the name a RemoteReward's metrics carry when it is given none."""
    parts = urlsplit(url)
    return f"remote:{parts.netloc}{parts.path.rstrip('/')}"


class RemoteReward:
    """A reward function computed by a server at `url` (the module docstring has the contract, the
    retries and the connection pool). `name` names it in metrics and errors (default
    remote:HOST:PORT/PATH). Usable wherever a reward function is: `reward_funcs=[RemoteReward(url)]`,
    or `{url: ...}` in a config."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        name: str | None = None,
        backoff: float = 0.5,
    ) -> None:
        check_remote_reward(f"RemoteReward({url!r})", url, timeout, retries, name)
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or not 0 <= backoff <= 60:
            raise ValueError(
                f"RemoteReward({url!r}): backoff {backoff!r} must be a number of seconds in [0, 60]"
            )
        self.url = url.strip()
        self.timeout, self.retries, self.backoff = float(timeout), retries, float(backoff)
        self.__name__ = name.strip() if name else default_name(self.url)
        self._client: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, name={self.__name__!r})"

    def client(self) -> Any:
        """The httpx2 client (made at the first call, then shared by every thread)."""
        with self._lock:
            if self._client is None:
                import httpx2

                self._client = httpx2.Client(
                    timeout=self.timeout,
                    trust_env=not is_loopback(urlsplit(self.url).hostname or ""),
                    follow_redirects=False,
                    headers={"content-type": "application/json", "accept": "application/json"},
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

    def _error(self, what: str, advice: str) -> RemoteRewardError:
        return RemoteRewardError(f"reward function {self.__name__!r}: POST {self.url} {what}; {advice}")

    def _post(self, body: bytes) -> Any:
        """The 2xx answer to `body`, after up to `retries` more tries on connection errors, timeouts and
        5xx answers other than 500 (the server's function raised: the same batch would fail again)."""
        import httpx2

        tries = self.retries + 1
        counted = f"{tries} tries" if tries > 1 else "1 try"
        for attempt in range(tries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                response = self.client().post(self.url, content=body)
            except httpx2.TransportError as error:  # refused, reset, timed out, not HTTP
                failure = f"failed ({type(error).__name__}: {str(error) or 'no detail'})"
                if attempt + 1 == tries:
                    raise self._error(
                        f"{failure} after {counted} (timeout {self.timeout:g} s each)",
                        "check that the server is running and reachable, or raise the entry's timeout",
                    ) from error
                continue
            status = f"answered HTTP {response.status_code} {response.reason_phrase}".rstrip()
            if response.status_code < 300:
                return response
            if response.status_code < 500:
                raise self._error(
                    f"{status} (not tried again): {first_line(response.text)}",
                    "redirects are not followed: give the final address"
                    if response.status_code < 400
                    else "the server refused the request: check the URL and what the server expects",
                )
            # 500: the server's own code failed on this very batch, and would again: not tried again.
            # 502, 503, 504 and the rest: a gateway, an overloaded or restarting server: tried again
            last = attempt + 1 == tries
            if response.status_code == 500 or last:
                tried = f"after {counted}" if last else "(not tried again)"
                raise self._error(
                    f"{status} {tried}: {first_line(response.text)}",
                    "fix the server (its log has the details), or set on_reward_error=unscorable",
                )
        raise AssertionError("unreachable")  # pragma: no cover - the last try returns or raises

    def _rewards(self, response: Any, size: int) -> list[float | None]:
        """One number or None per completion from a 2xx answer, else one line saying what came."""
        line = first_line(response.text)
        try:
            data = json.loads(response.text)
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
