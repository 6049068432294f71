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

The HTTP side is uvicorn (h11, HTTP/1.1 with keep-alive) serving a starlette app, as vLLM's server is,
for its bounds: the size of a request's headers (h11), of its body, the time a client may take to send
its headers and its body (`request_timeout`, from connecting or from the previous answer, which
`keep_alive` idle seconds extend), and the connections at once (`max_connections`). uvicorn and
starlette are imported when a server is made, never by `import grpokit`.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .scoring import as_number, call_reward, reward_name

JSON_TYPE = "application/json"
API_KEY_ENV = "GRPOKIT_API_KEY"
DEFAULT_MAX_BODY_MB = 64.0
DEFAULT_REQUEST_TIMEOUT = 30.0  # seconds for a request's headers, and again for its body
DEFAULT_MAX_CONNECTIONS = 64
# An idle keep-alive connection is closed after this many seconds: above httpx's 5 s, so the client
# closes an idle pooled connection first and never sends on one the server is closing.
DEFAULT_KEEP_ALIVE = 15.0
SHUTDOWN_GRACE = 5.0  # seconds close() lets requests in flight finish


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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


def check_api_key(api_key: str | None) -> None:
    """ValueError (never quoting the key) unless the key can be sent as `Authorization: Bearer KEY`."""
    if api_key is not None and (
        not api_key or not api_key.isascii() or not api_key.isprintable() or " " in api_key
    ):
        raise ValueError(
            f"the API key (--api-key or {API_KEY_ENV}) must be printable ASCII without spaces: it is sent "
            "as the header Authorization: Bearer KEY"
        )


def binds_loopback_only(host: str) -> bool:
    """Whether listening on `host` reaches this machine only: localhost, 127.0.0.0/8 or ::1 (0.0.0.0,
    :: and '' are every interface)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, port: int, name: str, *, keyed: bool) -> str | None:
    """The warning line for a server reachable beyond this machine (None on loopback): it runs the
    function, the user's code, for anyone who can reach the port."""
    if binds_loopback_only(host):
        return None
    where = f"--host {host or repr(host)} is not this machine's loopback: anyone who can reach port {port}"
    if keyed:
        return (
            f"{where} can call reward function {name!r} with the API key, which plain HTTP sends "
            "unencrypted; keep the port on a network you trust"
        )
    return (
        f"{where} can call reward function {name!r}, with no authentication; set {API_KEY_ENV} (or "
        "--api-key) and keep the port behind a firewall, or serve on 127.0.0.1"
    )


def _described(error: BaseException) -> str:
    """'Type: message' (a message that cannot be made into text is left out)."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - a user's exception: its __str__ may raise
        text = ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _one_line(error: BaseException) -> str:
    """'Type: message' on one line, for the log."""
    return " ".join(_described(error).split())


def _where(request: Any) -> str:
    """'METHOD /path' for the log: the path as sent (percent-encoded: never a line break), cut to 200."""
    path = request.scope.get("raw_path") or request.scope.get("path", "").encode()
    text = path.decode("latin-1")
    return f"{request.method} {text if len(text) <= 200 else text[:199] + '…'}"


class _ToLog(logging.Handler):
    """uvicorn's log records as one line each in a server's log (a traceback becomes its last line)."""

    def __init__(self, log: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = " ".join(record.getMessage().split())
            if record.exc_info and record.exc_info[1] is not None:
                line = f"{line.rstrip('.')}: {_one_line(record.exc_info[1])}"
            self.log(f"serve-reward: {line}")
        except Exception:  # noqa: BLE001 - logging must never break serving
            self.handleError(record)


def _protocol_class(log: Callable[[str], None], request_timeout: float, keep_alive: float) -> type:
    """uvicorn's h11 protocol, with three changes: its log lines go to `log` (a logger of its own, not
    uvicorn's global one), a 400 for a request that is not HTTP/1.1 is JSON, and a connection must
    complete a request's headers within `request_timeout` seconds of connecting (keep_alive more after
    an answer), which uvicorn does not bound: a client sending its headers a byte at a time is closed."""
    import h11
    from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

    logger = logging.Logger("grpokit.serve-reward", logging.WARNING)  # outside logging's tree: ours only
    logger.addHandler(_ToLog(log))
    invalid = json.dumps(
        {
            "error": "the request is not valid HTTP/1.1 (a malformed request line or header, such as a "
            "Content-Length that is not a number)"
        }
    ).encode()

    class RewardProtocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.logger = logger

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_request(request_timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_request(keep_alive + request_timeout)

        def _await_request(self, seconds: float) -> None:
            """Close the connection if no new request has begun in `seconds` (uvicorn's keep-alive timer
            stops at a request's first byte)."""
            cycle = self.cycle

            def expire() -> None:
                waiting = cycle is None or cycle.response_complete
                if self.cycle is cycle and waiting and not self.transport.is_closing():
                    self.transport.close()

            self.loop.call_later(seconds, expire)

        def send_400_response(self, msg: str) -> None:
            headers = [
                (b"content-type", JSON_TYPE.encode()),
                (b"content-length", str(len(invalid)).encode()),
                (b"connection", b"close"),
            ]
            for event in (
                h11.Response(status_code=400, headers=headers, reason=STATUS_PHRASES[400]),
                h11.Data(data=invalid),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return RewardProtocol


@dataclass(frozen=True)
class ServeLimits:
    """What one server gives its clients at most (the module docstring): `concurrency` calls of the
    function at once, `max_body_mb` MiB a request body, `request_timeout` seconds for a request's
    headers and again for its body, `max_connections` open at once, `keep_alive` idle seconds."""

    concurrency: int = 1
    max_body_mb: float = DEFAULT_MAX_BODY_MB
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    keep_alive: float = DEFAULT_KEEP_ALIVE

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(
                f"concurrency {self.concurrency} must be at least 1 (calls of the function at once)"
            )
        if not self.max_body_mb > 0:
            raise ValueError(f"max_body_mb {self.max_body_mb} must be above 0 (MiB)")
        if not self.request_timeout > 0 or not self.keep_alive > 0:
            raise ValueError(
                f"request_timeout {self.request_timeout} and keep_alive {self.keep_alive} must be above 0 s"
            )
        if self.max_connections < 1:
            raise ValueError(f"max_connections {self.max_connections} must be at least 1")


class RewardServer:
    """`fn` served on (host, port) (port 0: a free one, then `url` says which). Binding happens here
    (an OSError when the port is taken); `start()` answers on a daemon thread until `close()` (or use it
    as a context manager), and `serve_forever()` answers until Ctrl-C or `close()` from another thread.
    With `api_key`, every request needs `Authorization: Bearer <api_key>`; `limits` bounds what clients
    get (`ServeLimits`)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ServeLimits | None = None,
        api_key: str | None = None,
        log: Callable[[str], None] = _stderr,
    ) -> None:
        limits = limits or ServeLimits()
        check_api_key(api_key)
        self.fn, self.name, self.log = fn, reward_name(fn), log
        self.slots = threading.BoundedSemaphore(limits.concurrency)
        self.max_body, self.max_body_mb = int(limits.max_body_mb * 2**20), float(limits.max_body_mb)
        self.request_timeout = float(limits.request_timeout)
        self._key = api_key.encode() if api_key is not None else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family)  # SO_REUSEADDR, listening
        self.thread: threading.Thread | None = None
        try:
            self._server = self._uvicorn(limits.max_connections, limits.keep_alive)
        except BaseException:
            self.socket.close()
            raise

    def _uvicorn(self, max_connections: int, keep_alive: float) -> Any:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        app = Starlette(routes=[Route("/{path:path}", self._endpoint, methods=["GET", "POST"])])
        config = uvicorn.Config(
            app,
            http=_protocol_class(self.log, self.request_timeout, keep_alive),
            ws="none",
            lifespan="off",
            log_config=None,  # no dictConfig of the process's logging: our protocol logs, one line each
            log_level="warning",  # (uvicorn's own loggers: no "Started server process" lines)
            access_log=False,
            headers=[("server", "grpokit-serve-reward")],
            # uvicorn answers 503 once connections >= limit_concurrency, counting the new one
            limit_concurrency=max_connections + 1,
            timeout_keep_alive=keep_alive,  # type: ignore[arg-type] - a float works (loop.call_later)
            timeout_graceful_shutdown=SHUTDOWN_GRACE,  # type: ignore[arg-type]
        )
        return uvicorn.Server(config)

    @property
    def port(self) -> int:
        """The port it listens on (the one chosen when it was given 0)."""
        return int(self.socket.getsockname()[1])

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://[{host}]:{port}/" if ":" in str(host) else f"http://{host}:{port}/"

    def _run(self) -> None:
        """uvicorn on an event loop of this thread; signals stay with the main thread (uvicorn installs
        no handlers off it), and an unexpected error in a loop callback is one line in the log."""

        async def serve() -> None:
            asyncio.get_running_loop().set_exception_handler(
                lambda _, context: self.log(
                    "serve-reward: "
                    + (_one_line(context["exception"]) if "exception" in context else str(context["message"]))
                )
            )
            await self._server.serve(sockets=[self.socket])

        try:
            asyncio.run(serve())
        except Exception as error:  # noqa: BLE001 - the thread's end: say why, in one line
            self.log(f"serve-reward: stopped: {_one_line(error)}")

    def start(self) -> RewardServer:
        self.thread = threading.Thread(target=self._run, name="reward-server", daemon=True)
        self.thread.start()
        return self

    def serve_forever(self) -> None:
        """Answer on a thread and wait, in this one (where Ctrl-C and the CLI's SIGTERM land), until it
        ends; then close."""
        thread = self.thread or self.start().thread
        try:
            while thread is not None and thread.is_alive():
                thread.join(0.5)
        finally:
            self.close()

    def close(self) -> None:
        """Stop answering (when started: requests in flight get SHUTDOWN_GRACE seconds) and release the
        port. A function still running after that is left to its daemon thread."""
        thread, self.thread = self.thread, None
        if thread is not None:
            self._server.should_exit = True
            thread.join(SHUTDOWN_GRACE + 2)
        self.socket.close()

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ answering

    def answer(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """(status, JSON object) for one request body (on a worker thread: parsing a large body and the
        function's call both keep the event loop free)."""
        try:
            request = json.loads(body)
        except RecursionError:
            return 400, {"error": "the body is JSON nested too deep; send lists of plain values"}
        except ValueError as error:  # UnicodeDecodeError is one
            return 400, {"error": f"the body is not JSON: {error}"}
        problem = request_problem(request)
        if problem is not None:
            return 400, {"error": problem}
        with self.slots:
            try:
                values = call_reward(self.fn, request)
            except BaseException as error:  # noqa: BLE001 - SystemExit too: the server answers on
                self.log("".join(traceback.format_exception(error)).rstrip())
                return 500, {"error": f"reward function {self.name!r} raised {_described(error)}"}
        try:
            return 200, {"rewards": reward_values(self.name, values, len(request["completions"]))}
        except ValueError as error:
            return 500, {"error": str(error)}

    def _reply(self, request: Any, status: int, payload: dict[str, Any], *, close: bool = False) -> Any:
        """The JSON answer (one log line when it is an error); `close`: the connection ends with it, as
        when the rest of a body is left unread."""
        from starlette.responses import Response

        headers = {"connection": "close"} if close else {}
        if status == 401:
            headers["www-authenticate"] = "Bearer"
        if status >= 400:
            self.log(f"serve-reward: {status} for {_where(request)}: {' '.join(payload['error'].split())}")
        data = json.dumps(payload, allow_nan=False).encode()
        return Response(data, status_code=status, headers=headers, media_type=JSON_TYPE)

    def _refused(self, request: Any) -> str | None:
        """Why the request's credentials are refused (None: no key is set, or it carries the key)."""
        if self._key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "no API key: send the header Authorization: Bearer KEY (the server's key)"
        if not hmac.compare_digest(token.strip().encode("latin-1"), self._key):
            return "the API key is wrong (Authorization: Bearer KEY must carry the server's key)"
        return None

    async def _endpoint(self, request: Any) -> Any:
        try:
            refused = self._refused(request)
            if refused is not None:
                return self._reply(request, 401, {"error": refused}, close=True)
            if request.method != "POST":
                return self._reply(request, 200, {"reward_function": self.name})
            return await self._post(request)
        except Exception as error:  # noqa: BLE001 - never a traceback, never a request left unanswered
            line = f"serve-reward could not answer: {_one_line(error)}"
            return self._reply(request, 500, {"error": line}, close=True)

    async def _post(self, request: Any) -> Any:
        import anyio
        from starlette.requests import ClientDisconnect

        limit = f"{self.max_body_mb:g} MiB"
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > self.max_body:  # h11 has checked it is digits
            error = f"the body is {int(declared)} bytes, over this server's limit of {limit} (--max-body-mb)"
            return self._reply(request, 413, {"error": error}, close=True)
        chunks, size = [], 0
        try:
            with anyio.fail_after(self.request_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body:
                        error = f"the body is over this server's limit of {limit} (--max-body-mb)"
                        return self._reply(request, 413, {"error": error}, close=True)
                    chunks.append(chunk)
        except TimeoutError:
            error = f"the body took more than {self.request_timeout:g} s to arrive ({size} bytes came)"
            return self._reply(request, 408, {"error": error}, close=True)
        except ClientDisconnect:
            self.log(f"serve-reward: the client left during the body of {_where(request)}")
            from starlette.responses import Response

            return Response(status_code=400)  # nobody to answer: uvicorn sends nothing
        status, payload = await anyio.to_thread.run_sync(self.answer, b"".join(chunks))
        return self._reply(request, status, payload)


# ------------------------------------------------------------------------------------ grpokit serve-reward


class _Terminated(Exception):  # noqa: N818 - a signal, not an error
    """SIGTERM while serving: stop as Ctrl-C does."""


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
    import os
    import signal

    from .loading import named_reward

    command.check()
    api_key = command.api_key if command.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    check_api_key(api_key)
    fn = named_reward(command.function.strip())
    limits = ServeLimits(
        concurrency=command.concurrency,
        max_body_mb=command.max_body_mb,
        request_timeout=command.request_timeout,
        max_connections=command.max_connections,
    )
    try:
        server = RewardServer(fn, command.host, command.port, limits=limits, api_key=api_key)
    except OSError as error:
        raise ValueError(
            f"cannot listen on {command.host}:{command.port}: {error.strerror or error}; choose another "
            "--port (0: any free one) or --host"
        ) from error

    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    warning = exposure_warning(command.host, server.port, reward_name(fn), keyed=api_key is not None)
    if warning is not None:
        print(f"grpokit serve-reward: warning: {warning}", file=sys.stderr, flush=True)
    print(f"serving reward function {reward_name(fn)!r} at {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except (KeyboardInterrupt, _Terminated):
        print("stopped", flush=True)
    finally:
        server.close()
        signal.signal(signal.SIGTERM, previous)
