"""Serving a Python reward function over HTTP, answering the contract `RemoteReward` speaks (see
`rewards.remote`): `grpokit serve-reward module:function --port N`.

    POST any path   {"prompts": [...], "completions": [...], <column>: [...], ...}
      200           {"rewards": [float | null, ...]}     the function's values as finite floats
      400           {"error": "..."}                     the body is not JSON, is nested too deep, is not
                                                         lists of one length, or the request is not valid
                                                         HTTP/1.1 (a malformed Content-Length among others)
      401           {"error": "..."}                     an API key is set and the request does not carry
                                                         `Authorization: Bearer KEY` with it (GET too)
      408           {"error": "..."}                     the body took longer than `request_timeout`
      413           {"error": "..."}                     the body (declared or sent) is over `max_body_mb`:
                                                         answered without reading it
      500           {"error": "..."}                     the function raised, or did not return one finite
                                                         number (or None) per completion: the client does
                                                         not try a 500 again, as the same batch would fail
      503           (text)                               more than `max_connections` connections at once
    GET any path    {"reward_function": NAME}            (a check that the server is up)

Every error answer is one JSON line, and one line in the server's log; the only traceback the log ever
holds is that of an exception the function raised. A client that goes away mid-body is one quiet line.
Answers to 400, 401, 408 and 413 close the connection (the rest of the body is never read).

The function is called as the trainer calls it (`scoring.call_reward`: the arguments it names, or all
of them with **kwargs), on a worker thread; `concurrency` bounds how many calls run at once (default 1:
one batch at a time, as a trainer calls it in process, so the function need not be thread-safe).

The HTTP side, with its bounds, is net/server.py's (uvicorn serving a starlette app, as vLLM's server
is), shared with `grpokit serve-policy`.
"""

from __future__ import annotations

import json
import math
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..net.server import (
    API_KEY_ENV,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_REQUEST_TIMEOUT,
    JsonServer,
    ServeLimits,
    api_key_from,
    bind,
    described,
    serve_until_stopped,
    stderr_line,
)
from ..net.server import exposure_warning as _exposure
from .scoring import as_number, call_reward, reward_name

__all__ = ["API_KEY_ENV", "RewardServer", "ServeCommand", "ServeLimits", "exposure_warning", "serve_command"]


def request_problem(request: Any) -> str | None:
    """Why a decoded request body is not the contract (None: it is)."""
    if not isinstance(request, dict):
        return f"the body is a JSON {type(request).__name__}, not an object"
    for key in ("prompts", "completions"):
        if not isinstance(request.get(key), list):
            return f"the body has no {key!r} list"
    size = len(request["completions"])
    for key, values in request.items():
        if not isinstance(values, list) or len(values) != size:
            got = f"{len(values)} values" if isinstance(values, list) else f"a {type(values).__name__}"
            return f"{key!r} holds {got} for {size} completions; give every field one value per completion"
    return None


def _preview(value: Any) -> str:
    """repr(value) cut to 80 characters; a value whose repr fails (or an int past Python's digit limit)
    is named by its type."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a user's object: anything may raise
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:79] + "…"


def reward_float(name: str, row: int, value: Any) -> float | None:
    """One row's reward as a finite float (a bool counts 1.0 / 0.0, as in TRL) or None; ValueError,
    naming the function and the row, for anything else: an int too large for a float, inf, NaN, text."""
    value = as_number(value)
    if value is None:
        return None
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:
            got = f"an integer too large for a float ({value.bit_length()} bits)"
        else:
            if math.isfinite(number):
                return number
            got = repr(number)
    else:
        got = _preview(value)
    raise ValueError(
        f"reward function {name!r} returned {got} for row {row}; return a finite number, or None when the "
        "completion cannot be scored"
    )


def reward_values(name: str, values: Any, size: int) -> list[float | None]:
    """What the function returned as a list of finite floats and None (a tensor or array as its list,
    numpy scalars as numbers); ValueError, naming the function and the row, for anything else."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()  # a [B] tensor or numpy array
    if not isinstance(values, (list, tuple)) or len(values) != size:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise ValueError(f"reward function {name!r} returned {got} for {size} completions; return one each")
    return [reward_float(name, row, value) for row, value in enumerate(values)]


def exposure_warning(host: str, port: int, name: str, *, keyed: bool) -> str | None:
    """The warning line for a server reachable beyond this machine (None on loopback): it runs the
    function, the user's code, for anyone who can reach the port."""
    return _exposure(host, port, f"reward function {name!r}", keyed=keyed)


class RewardServer(JsonServer):
    """`fn` served on (host, port) (net/server.py's JsonServer: binding, start, close, bounds). With
    `api_key`, every request needs `Authorization: Bearer <api_key>`; `limits` bounds what clients get
    (`ServeLimits`; `concurrency`: calls of the function at once)."""

    name = "serve-reward"

    def __init__(
        self,
        fn: Callable[..., Any],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ServeLimits | None = None,
        api_key: str | None = None,
        log: Callable[[str], None] = stderr_line,
    ) -> None:
        self.fn, self.function_name = fn, reward_name(fn)
        self.slots = threading.BoundedSemaphore((limits or ServeLimits()).concurrency)
        super().__init__(host, port, limits=limits, api_key=api_key, log=log)

    def routes(self) -> list[Any]:
        from starlette.routing import Route

        return [Route("/{path:path}", self._endpoint, methods=["GET", "POST"])]

    def answer(self, body: bytes) -> tuple[int, Any]:
        """(status, JSON object or an error's one-line message) for one request body (on a worker thread:
        parsing a large body and the function's call both keep the event loop free)."""
        try:
            request = json.loads(body)
        except RecursionError:
            return 400, "the body is JSON nested too deep; send lists of plain values"
        except ValueError as error:  # UnicodeDecodeError is one
            return 400, f"the body is not JSON: {error}"
        problem = request_problem(request)
        if problem is not None:
            return 400, problem
        with self.slots:
            try:
                values = call_reward(self.fn, request)
            except BaseException as error:  # noqa: BLE001 - SystemExit too: the server answers on
                self.log("".join(traceback.format_exception(error)).rstrip())
                return 500, f"reward function {self.function_name!r} raised {described(error)}"
        try:
            return 200, {"rewards": reward_values(self.function_name, values, len(request["completions"]))}
        except ValueError as error:
            return 500, str(error)

    async def _endpoint(self, request: Any) -> Any:
        return await self.guarded(request, self._answer)

    async def _answer(self, request: Any) -> Any:
        import anyio

        if request.method != "POST":
            return self.reply(request, 200, {"reward_function": self.function_name})
        body = await self.body(request)
        status, payload = await anyio.to_thread.run_sync(self.answer, body)
        return self.reply(request, status, payload)


# ------------------------------------------------------------------------------------ grpokit serve-reward


@dataclass(frozen=True)
class ServeCommand:
    """What `grpokit serve-reward` serves and how: its options, which `check` refuses by their flags."""

    function: str  # FILE.py:FUNCTION, package.module:FUNCTION, package.module.FUNCTION or a built-in reward
    port: int  # 0: any free one
    host: str = "127.0.0.1"
    concurrency: int = 1
    max_body_mb: float = DEFAULT_MAX_BODY_MB
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    api_key: str | None = None  # None: the environment's GRPOKIT_API_KEY (unset: no key)

    def check(self) -> None:
        """Each option refused in one line (a ValueError) before anything is loaded or bound."""
        if "://" in self.function:
            raise ValueError(
                f"{self.function.strip()!r} is a URL: serve-reward serves a Python function (module:function "
                "or path/file.py:function); a URL already names a server: give it to training as {url: ...}"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a port (0 to 65535; 0: any free one)")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency {self.concurrency} must be at least 1")
        above_zero = (("--max-body-mb", self.max_body_mb), ("--request-timeout", self.request_timeout))
        for option, value in above_zero:
            if not value > 0:
                raise ValueError(f"{option} {value:g} must be above 0")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections {self.max_connections} must be at least 1")


def serve_command(command: ServeCommand) -> None:
    """Serve `command.function` over HTTP until Ctrl-C or SIGTERM: where it listens on stdout, and on
    stderr a warning when other machines can reach it without an API key. A port that cannot be bound
    is one line (a ValueError), as are the options `ServeCommand.check` refuses."""
    from .loading import named_reward

    command.check()
    api_key = api_key_from(command.api_key)
    fn = named_reward(command.function.strip())
    limits = ServeLimits(
        concurrency=command.concurrency,
        max_body_mb=command.max_body_mb,
        request_timeout=command.request_timeout,
        max_connections=command.max_connections,
    )
    server = bind(
        lambda: RewardServer(fn, command.host, command.port, limits=limits, api_key=api_key),
        command.host,
        command.port,
    )
    listening = f"serving reward function {reward_name(fn)!r} at {server.url} (Ctrl-C stops)"
    what = f"reward function {reward_name(fn)!r}"
    serve_until_stopped(server, command.host, what, keyed=api_key is not None, listening=listening)
