"""A JSON-over-HTTP server with bounds, the HTTP side of `grpokit serve-reward` (rewards/serving.py)
and `grpokit serve-policy` (serve/policy.py): each subclass says what its routes answer.

The HTTP side is uvicorn (h11, HTTP/1.1 with keep-alive) serving a starlette app, as vLLM's server is,
for its bounds: the size of a request's headers (h11), of its body (`max_body_mb`: 413, answered
without reading it), the time a client may take to send its headers and its body (`request_timeout`,
from connecting or from the previous answer, which `keep_alive` idle seconds extend: 408, or the
connection closed), and the connections at once (`max_connections`: 503). With an API key every
request needs `Authorization: Bearer KEY` (401). Every error answer is one JSON object and one line in
the server's log; answers to 400, 401, 408 and 413 for a body left unread close the connection.
uvicorn and starlette are imported when a server is made, never by `import grpokit`.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

JSON_TYPE = "application/json"
API_KEY_ENV = "GRPOKIT_API_KEY"
DEFAULT_MAX_BODY_MB = 64.0
DEFAULT_REQUEST_TIMEOUT = 30.0  # seconds for a request's headers, and again for its body
DEFAULT_MAX_CONNECTIONS = 64
# An idle keep-alive connection is closed after this many seconds: above httpx's 5 s, so the client
# closes an idle pooled connection first and never sends on one the server is closing.
DEFAULT_KEEP_ALIVE = 15.0
DEFAULT_MAX_BATCH_ROWS = 512  # a policy server: completions one decode may hold (n × prompts, batched)
SHUTDOWN_GRACE = 5.0  # seconds close() lets requests in flight finish


def server_base_url(url: str) -> str:
    """A server's URL as its routes are joined to it: no trailing '/', nor a trailing '/v1' (the URL
    `grpokit serve-policy` prints ends in /v1, as OpenAI clients take it). The one place a server URL
    is normalised."""
    return url.rstrip("/").removesuffix("/v1").rstrip("/")


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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


def exposure_warning(host: str, port: int, what: str, *, keyed: bool) -> str | None:
    """The warning line for a server reachable beyond this machine (None on loopback): it runs `what`
    (the user's code, or a policy) for anyone who can reach the port."""
    if binds_loopback_only(host):
        return None
    where = f"--host {host or repr(host)} is not this machine's loopback: anyone who can reach port {port}"
    if keyed:
        return (
            f"{where} can call {what} with the API key, which plain HTTP sends unencrypted; keep the port "
            "on a network you trust"
        )
    return (
        f"{where} can call {what}, with no authentication; set {API_KEY_ENV} (or --api-key) and keep "
        "the port behind a firewall, or serve on 127.0.0.1"
    )


def described(error: BaseException) -> str:
    """'Type: message' (a message that cannot be made into text is left out)."""
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - a user's exception: its __str__ may raise
        text = ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def one_line(error: BaseException) -> str:
    """'Type: message' on one line, for the log."""
    return " ".join(described(error).split())


def where(request: Any) -> str:
    """'METHOD /path' for the log: the path as sent (percent-encoded: never a line break), cut to 200."""
    path = request.scope.get("raw_path") or request.scope.get("path", "").encode()
    text = path.decode("latin-1")
    return f"{request.method} {text if len(text) <= 200 else text[:199] + '…'}"


class _ToLog(logging.Handler):
    """uvicorn's log records as one line each in a server's log (a traceback becomes its last line)."""

    def __init__(self, log: Callable[[str], None], prefix: str) -> None:
        super().__init__(logging.WARNING)
        self.log, self.prefix = log, prefix

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = " ".join(record.getMessage().split())
            if record.exc_info and record.exc_info[1] is not None:
                line = f"{line.rstrip('.')}: {one_line(record.exc_info[1])}"
            self.log(f"{self.prefix}: {line}")
        except Exception:  # noqa: BLE001 - logging must never break serving
            self.handleError(record)


def _protocol_class(
    log: Callable[[str], None], prefix: str, request_timeout: float, keep_alive: float
) -> type:
    """uvicorn's h11 protocol, with three changes: its log lines go to `log` (a logger of its own, not
    uvicorn's global one), a 400 for a request that is not HTTP/1.1 is JSON, and a connection must
    complete a request's headers within `request_timeout` seconds of connecting (keep_alive more after
    an answer), which uvicorn does not bound: a client sending its headers a byte at a time is closed."""
    import h11
    from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

    logger = logging.Logger(f"grpokit.{prefix}", logging.WARNING)  # outside logging's tree: ours only
    logger.addHandler(_ToLog(log, prefix))
    invalid = json.dumps(
        {
            "error": "the request is not valid HTTP/1.1 (a malformed request line or header, such as a "
            "Content-Length that is not a number)"
        }
    ).encode()

    class BoundedProtocol(H11Protocol):
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

    return BoundedProtocol


@dataclass(frozen=True)
class ServeLimits:
    """What one server gives its clients at most (the module docstring): `concurrency` calls at once
    (of a reward function; a policy server batches instead), `max_body_mb` MiB a request body,
    `request_timeout` seconds for a request's headers and again for its body, `max_connections` open at
    once, `keep_alive` idle seconds; `max_batch_rows` completions one decode of a policy server holds."""

    concurrency: int = 1
    max_body_mb: float = DEFAULT_MAX_BODY_MB
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    keep_alive: float = DEFAULT_KEEP_ALIVE
    max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS

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
        if self.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows {self.max_batch_rows} must be at least 1")


class BodyRefused(Exception):  # noqa: N818 - an answer, raised to leave the body unread
    """A request body refused before it was read whole: (status, message); the connection closes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class JsonServer:
    """A server on (host, port) (port 0: a free one, then `url` says which). Binding happens here (an
    OSError when the port is taken); `start()` answers on a daemon thread until `close()` (or use it as
    a context manager), and `serve_forever()` answers until Ctrl-C or `close()` from another thread.
    Subclasses give `routes()` (starlette Routes whose endpoints may use `body`, `reply` and `refused`),
    `error_payload` (how an error reads) and `name` (the log's prefix, the server header)."""

    name = "grpokit-server"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ServeLimits | None = None,
        api_key: str | None = None,
        log: Callable[[str], None] = stderr_line,
    ) -> None:
        limits = limits or ServeLimits()
        check_api_key(api_key)
        self.log, self.limits = log, limits
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

    def routes(self) -> list[Any]:
        raise NotImplementedError

    def error_payload(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        """The JSON object of an error answer (`message`: one line; `param`: the request's field at fault,
        where known)."""
        return {"error": message}

    def _uvicorn(self, max_connections: int, keep_alive: float) -> Any:
        import uvicorn
        from starlette.applications import Starlette

        config = uvicorn.Config(
            Starlette(routes=self.routes()),
            http=_protocol_class(self.log, self.name, self.request_timeout, keep_alive),
            ws="none",
            lifespan="off",
            log_config=None,  # no dictConfig of the process's logging: our protocol logs, one line each
            log_level="warning",  # (uvicorn's own loggers: no "Started server process" lines)
            access_log=False,
            headers=[("server", f"grpokit-{self.name}")],
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
                    f"{self.name}: "
                    + (one_line(context["exception"]) if "exception" in context else str(context["message"]))
                )
            )
            await self._server.serve(sockets=[self.socket])

        try:
            asyncio.run(serve())
        except Exception as error:  # noqa: BLE001 - the thread's end: say why, in one line
            self.log(f"{self.name}: stopped: {one_line(error)}")

    def start(self) -> JsonServer:
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
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
        port. Work still running after that is left to its daemon thread."""
        thread, self.thread = self.thread, None
        if thread is not None:
            self._server.should_exit = True
            thread.join(SHUTDOWN_GRACE + 2)
        self.socket.close()

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ answering

    def reply(
        self, request: Any, status: int, payload: Any, *, close: bool = False, param: str | None = None
    ) -> Any:
        """The JSON answer; an error's `payload` is its one-line message (`error_payload` shapes it, with
        `param`, and it is one log line); `close`: the connection ends with it, as when the rest of a
        body is left unread."""
        from starlette.responses import Response

        headers = {"connection": "close"} if close else {}
        if status == 401:
            headers["www-authenticate"] = "Bearer"
        if status >= 400:
            self.log(f"{self.name}: {status} for {where(request)}: {' '.join(str(payload).split())}")
            payload = self.error_payload(status, str(payload), param)
        data = json.dumps(payload, allow_nan=False).encode()
        return Response(data, status_code=status, headers=headers, media_type=JSON_TYPE)

    def refused(self, request: Any) -> Any:
        """The 401 answer when the request's credentials are refused (None: no key is set, or it
        carries the key)."""
        if self._key is None:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            why = "no API key: send the header Authorization: Bearer KEY (the server's key)"
        elif not hmac.compare_digest(token.strip().encode("latin-1"), self._key):
            why = "the API key is wrong (Authorization: Bearer KEY must carry the server's key)"
        else:
            return None
        return self.reply(request, 401, why, close=True)

    async def body(self, request: Any) -> bytes:
        """The request's body, within `max_body_mb` and `request_timeout` (else BodyRefused: 413 or
        408). A client gone mid-body raises starlette's ClientDisconnect."""
        import anyio

        limit = f"{self.max_body_mb:g} MiB"
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > self.max_body:  # h11 has checked it is digits
            raise BodyRefused(
                413, f"the body is {int(declared)} bytes, over this server's limit of {limit} (--max-body-mb)"
            )
        chunks, size = [], 0
        try:
            with anyio.fail_after(self.request_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body:
                        raise BodyRefused(
                            413, f"the body is over this server's limit of {limit} (--max-body-mb)"
                        )
                    chunks.append(chunk)
        except TimeoutError:
            raise BodyRefused(
                408, f"the body took more than {self.request_timeout:g} s to arrive ({size} bytes came)"
            ) from None
        return b"".join(chunks)

    async def guarded(self, request: Any, answer: Callable[[Any], Any]) -> Any:
        """`await answer(request)`, after the API key; a refused body, a client gone mid-body and any
        error become one answer (never a traceback, never a request left unanswered)."""
        from starlette.requests import ClientDisconnect
        from starlette.responses import Response

        try:
            refused = self.refused(request)
            if refused is not None:
                return refused
            return await answer(request)
        except BodyRefused as error:
            return self.reply(request, error.status, error.message, close=True)
        except ClientDisconnect:
            self.log(f"{self.name}: the client left during the body of {where(request)}")
            return Response(status_code=400)  # nobody to answer: uvicorn sends nothing
        except Exception as error:  # noqa: BLE001 - never a traceback, never a request left unanswered
            return self.reply(request, 500, f"{self.name} could not answer: {one_line(error)}", close=True)


# ------------------------------------------------------------------------------------ the commands


class _Terminated(Exception):  # noqa: N818 - a signal, not an error
    """SIGTERM while serving: stop as Ctrl-C does."""


def api_key_from(given: str | None) -> str | None:
    """--api-key, else the environment's GRPOKIT_API_KEY (unset or empty: no key), checked."""
    import os

    key = given if given is not None else (os.environ.get(API_KEY_ENV) or None)
    check_api_key(key)
    return key


def bind(make: Callable[[], Any], host: str, port: int) -> Any:
    """`make()` (a server, which binds its port), a port that cannot be bound said in one line."""
    try:
        return make()
    except OSError as error:
        raise ValueError(
            f"cannot listen on {host}:{port}: {error.strerror or error}; choose another --port (0: any free "
            "one) or --host"
        ) from error


def serve_until_stopped(server: JsonServer, host: str, what: str, *, keyed: bool, listening: str) -> None:
    """A command's server until Ctrl-C or SIGTERM: on stderr a warning when other machines can reach
    it (it runs `what` for them), on stdout `listening`, then "stopped"; the port released."""
    import signal

    def terminated(signum: int, frame: Any) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    warning = exposure_warning(host, server.port, what, keyed=keyed)
    if warning is not None:
        print(f"grpokit {server.name}: warning: {warning}", file=sys.stderr, flush=True)
    print(listening, flush=True)
    try:
        server.serve_forever()
    except (KeyboardInterrupt, _Terminated):
        print("stopped", flush=True)
    finally:
        server.close()
        signal.signal(signal.SIGTERM, previous)
