"""Serving a Python reward function over HTTP, answering the contract `RemoteReward` speaks (see
`rewards.remote`): `grpokit serve-reward module:function --port N`.

    POST any path   {"prompts": [...], "completions": [...], <column>: [...], ...}
      200           {"rewards": [float | null, ...]}     the function's values, as it returned them
      400           {"error": "..."}                     the body is not JSON, or not lists of one length
      500           {"error": "..."}                     the function raised, or did not return one number
                                                         or None per completion
    GET any path    {"reward_function": NAME}            (a check that the server is up)

The function is called as the trainer calls it (`scoring.call_reward`: the arguments it names, or all
of them with **kwargs). The standard library's ThreadingHTTPServer reads each connection on a thread
of its own, HTTP/1.1 with keep-alive; `concurrency` bounds how many calls of the function run at once
(default 1: one batch at a time, as a trainer calls it in process, so the function need not be
thread-safe).
"""

from __future__ import annotations

import json
import math
import socket
import socketserver
import sys
import threading
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .scoring import as_number, call_reward, reward_name

JSON_TYPE = "application/json"


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


def reward_values(name: str, values: Any, size: int) -> list[Any]:
    """What the function returned as a JSON-able list (a tensor or array as its list, numpy scalars
    as numbers); ValueError, naming the function and the row, for anything else."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()  # a [B] tensor or numpy array
    if not isinstance(values, (list, tuple)) or len(values) != size:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        raise ValueError(f"reward function {name!r} returned {got} for {size} completions; return one each")
    out = []
    for row, value in enumerate(values):
        value = as_number(value)
        if value is not None and (
            not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value))
        ):
            raise ValueError(
                f"reward function {name!r} returned {value!r} for row {row}; return a finite number, or "
                "None when the completion cannot be scored"
            )
        out.append(value)
    return out


class RewardServer(ThreadingHTTPServer):
    """`fn` served on (host, port) (port 0: a free one, then `url` says which). Binding happens here
    (an OSError when the port is taken); `serve_forever()` answers until `shutdown()`, and
    `start()` does so on a daemon thread (with `close()` after, or as a context manager)."""

    daemon_threads = True  # a connection left open never keeps the process from exiting

    def __init__(
        self,
        fn: Callable[..., Any],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        concurrency: int = 1,
        log: Callable[[str], None] = _stderr,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency {concurrency} must be at least 1 (calls of the function at once)")
        self.fn, self.name, self.log = fn, reward_name(fn), log
        self.slots = threading.BoundedSemaphore(concurrency)
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.thread: threading.Thread | None = None
        super().__init__((host, port), RewardRequestHandler)

    def server_bind(self) -> None:
        """Bind, without HTTPServer's reverse DNS look-up of the host (socket.getfqdn), which can
        stall on a machine without a resolver."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://[{host}]:{port}/" if ":" in str(host) else f"http://{host}:{port}/"

    def start(self) -> RewardServer:
        self.thread = threading.Thread(
            target=self.serve_forever, args=(0.1,), name="reward-server", daemon=True
        )  # (looks for shutdown() every 0.1 s)
        self.thread.start()
        return self

    def close(self) -> None:
        """Stop answering (when started) and release the port."""
        if self.thread is not None:
            self.shutdown()
            self.thread.join()
            self.thread = None
        self.server_close()

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.close()

    def answer(self, body: bytes) -> tuple[int, dict[str, Any]]:
        """(status, JSON object) for one request body."""
        try:
            request = json.loads(body)
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
                return 500, {"error": f"reward function {self.name!r} raised {type(error).__name__}: {error}"}
        try:
            return 200, {"rewards": reward_values(self.name, values, len(request["completions"]))}
        except ValueError as error:
            return 500, {"error": str(error)}


class RewardRequestHandler(BaseHTTPRequestHandler):
    """One connection: JSON in, JSON out, HTTP/1.1 (keep-alive: a client's pool reuses it)."""

    protocol_version = "HTTP/1.1"
    server_version = "grpokit-serve-reward"
    server: RewardServer

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", JSON_TYPE)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        if status >= 400:
            self.server.log(f"serve-reward: {status} for {self.command} {self.path}: {payload['error']}")

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True  # the body's end is unknown: the connection cannot be reused
            self._send(411, {"error": "the request needs a Content-Length"})
            return
        self._send(*self.server.answer(self.rfile.read(int(length))))

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._send(200, {"reward_function": self.server.name})

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        """Answers are logged by `_send` (errors only): a training run posts every step."""

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        self.server.log(f"serve-reward: {format % args}")
