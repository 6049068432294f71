"""What the reward tests share: `serve`, reward servers on this machine's loopback."""

from __future__ import annotations

from typing import Any

import pytest

from grpokit.rewards import RewardServer, ServeLimits


def lengths(prompts, completions, **_):
    """A reward: each completion's length."""
    return [float(len(c)) for c in completions]


@pytest.fixture
def serve():
    """start(fn=lengths, **options) -> a RewardServer on 127.0.0.1 answering from a thread (options:
    api_key and ServeLimits' fields), closed at the end of the test; its log lines are kept in
    `start.logs`."""
    servers: list[RewardServer] = []
    logs: list[str] = []

    def start(fn: Any = lengths, **options: Any) -> RewardServer:
        key = options.pop("api_key", None)
        server = RewardServer(fn, "127.0.0.1", 0, limits=ServeLimits(**options), api_key=key, log=logs.append)
        server.start()
        servers.append(server)
        return server

    start.logs = logs  # type: ignore[attr-defined]
    yield start
    for server in servers:
        server.close()
