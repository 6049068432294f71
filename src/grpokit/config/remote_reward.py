"""The options of a remote reward (a `{url: ...}` entry of reward_funcs, or `rewards.RemoteReward`),
checked in one place so that the config and the Python API refuse the same values with the same line.
No network and no HTTP client here: only the values."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit

from .errors import shown

# the keys a {url: ...} entry takes besides url (they are RemoteReward's keyword arguments)
REMOTE_OPTIONS = ("timeout", "retries", "name")
DEFAULT_TIMEOUT = 60.0  # seconds: connecting, sending, and each wait for the answer
DEFAULT_RETRIES = 3  # tries after the first, on connection errors, timeouts and 5xx answers
MAX_TIMEOUT = 86_400.0  # a day: anything longer is a mistake (reward_timeout bounds a batch anyway)
MAX_RETRIES = 100


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def url_problem(url: Any) -> str | None:
    """Why `url` is not an http:// or https:// address of a host (None: it is one)."""
    if not isinstance(url, str) or not url.strip():
        return f"url {shown(url)} is not an address"
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # raises on a port that is not a number in 0..65535
    except ValueError as error:
        return f"url {shown(url)} is not an address ({error})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"url {shown(url)} is not an http:// or https:// address with a host"
    if port == 0 or any(c.isspace() for c in url.strip()):
        return f"url {shown(url)} is not an address (port 0, or a space in it)"
    return None


def check_remote_reward(
    label: str,
    url: Any,
    timeout: Any = DEFAULT_TIMEOUT,
    retries: Any = DEFAULT_RETRIES,
    name: Any = None,
) -> None:
    """ValueError, one line starting with `label` (the entry, or the call), for an option a remote
    reward cannot use: a url that is not http(s)://HOST[:PORT][/PATH], a timeout that is not a
    number in (0, MAX_TIMEOUT] seconds, retries that are not an integer in [0, MAX_RETRIES], a name
    that is not a non-empty string."""
    problem = url_problem(url)
    if problem is not None:
        raise ValueError(
            f"{label}: {problem}; write http://HOST:PORT/PATH (a server answering the reward contract, "
            "such as `grpokit serve-reward module:function --port PORT`)"
        )
    if not _is_number(timeout) or not math.isfinite(timeout) or not 0 < timeout <= MAX_TIMEOUT:
        raise ValueError(
            f"{label}: timeout {shown(timeout)} must be a number of seconds above 0 and at most "
            f"{MAX_TIMEOUT:g} (default {DEFAULT_TIMEOUT:g})"
        )
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= MAX_RETRIES:
        raise ValueError(
            f"{label}: retries {shown(retries)} must be an integer from 0 to {MAX_RETRIES} "
            f"(default {DEFAULT_RETRIES}: tries after the first)"
        )
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"{label}: name {shown(name)} must be a non-empty string")
