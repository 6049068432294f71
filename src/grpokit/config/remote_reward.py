"""The options of a remote reward (a `{url: ...}` entry of reward_funcs, or `rewards.RemoteReward`),
checked in one place so that the config and the Python API refuse the same values with the same line,
and `redact_url`, which every place that writes or prints a reward server's URL goes through (metric
names, errors, config.yaml, print-config, the doctor): a password in the URL, or a query parameter
that looks like a secret, is shown as ***. No network and no HTTP client here: only the values (and
the environment variable and certificate file an entry names, read to refuse them at config time).
"""

from __future__ import annotations

import base64
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from .errors import shown

if TYPE_CHECKING:
    import ssl

# the keys a {url: ...} entry takes besides url (they are RemoteReward's keyword arguments)
REMOTE_OPTIONS = ("timeout", "retries", "name", "api_key_env", "ca_bundle")
DEFAULT_TIMEOUT = 60.0  # seconds: one whole try (connecting, sending and the whole answer)
DEFAULT_RETRIES = 3  # tries after the first, on connection errors, timeouts and 5xx answers
MAX_TIMEOUT = 86_400.0  # a day: anything longer is a mistake (reward_timeout bounds a batch anyway)
MAX_RETRIES = 100


REDACTED = "***"
# query parameters whose values are shown as *** (their names compared case-insensitively, "-" as "_"):
# these names, or a name ending in "_" and one of them (client_secret, refresh_token, x_api_key)
SECRET_PARAMETERS = frozenset(
    {"token", "key", "api_key", "apikey", "access_token", "secret", "password", "sig", "signature"}
)


def _secret_parameter(name: str) -> bool:
    name = unquote(name).strip().lower().replace("-", "_")
    return name in SECRET_PARAMETERS or any(name.endswith("_" + secret) for secret in SECRET_PARAMETERS)


def url_secrets(url: str) -> list[str]:
    """The credentials `url` carries (its userinfo password, also as basic auth sends it, and the
    values of secret-looking query parameters), as written and percent-decoded: what no message may
    repeat (a server's error page may echo the request)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = []
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        user, _, password = userinfo.partition(":")
        found.append(password)
        found.append(base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode())
    for pair in parts.query.split("&"):
        name, equals, value = pair.partition("=")
        if equals and value and _secret_parameter(name):
            found.append(value)
    return sorted({s for raw in found if raw for s in (raw, unquote(raw)) if s}, key=len, reverse=True)


def redact_url(url: str) -> str:
    """`url` with its userinfo password and the values of secret-looking query parameters (token, key,
    api_key, sig, ...: SECRET_PARAMETERS) replaced by ***, the rest as written; what grpokit writes or
    prints of a reward server's address (the request itself still carries the real ones). A text that
    is not a URL comes back as it is (an error about it shows it: it holds no parsed credentials)."""
    if not isinstance(url, str):
        return url
    try:
        parts = urlsplit(url)
    except ValueError:  # an unbalanced [ in the host: no userinfo to find; hide what follows // and :
        head, slashes, rest = url.partition("//")
        userinfo, at, host = rest.rpartition("@")
        if at and ":" in userinfo:
            return f"{head}{slashes}{userinfo.partition(':')[0]}:{REDACTED}@{host}"
        return url
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.partition(':')[0]}:{REDACTED}@{host}"
    query = "&".join(
        f"{name}={REDACTED}" if equals and value and _secret_parameter(name) else pair
        for pair in parts.query.split("&")
        for name, equals, value in [pair.partition("=")]
    )
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


def redact_text(text: Any) -> Any:
    """`text` with every URL in it redacted (`redact_url`): a reward_funcs value that is not a url
    entry (a mistyped one read as a python reference) still shows no password."""
    return _URL_IN_TEXT.sub(lambda found: redact_url(found.group()), text) if isinstance(text, str) else text


def redacted_entries(entries: Any) -> Any:
    """reward_funcs entries with every URL in their strings redacted (`redact_url`): what
    config.yaml, `grpokit print-config` and the metrics' reporters get, what a resume compares (both
    sides redacted alike, so a run whose URL holds a password resumes), and what an error repeats."""
    if not isinstance(entries, (list, tuple)):
        return redact_text(entries)
    return [_redacted_entry(entry) for entry in entries]


def _redacted_entry(entry: Any) -> Any:
    if not isinstance(entry, dict):
        return redact_text(entry)
    return {key: (redact_url if key == "url" else redact_text)(value) for key, value in entry.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def url_problem(url: Any) -> str | None:
    """Why `url` is not an http:// or https:// address of a host (None: it is one)."""
    if not isinstance(url, str) or not url.strip():
        return f"url {shown(url)} is not an address"
    said = shown(redact_url(url))
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # raises on a port that is not a number in 0..65535
    except ValueError as error:
        return f"url {said} is not an address ({error})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"url {said} is not an http:// or https:// address with a host"
    if port == 0 or any(c.isspace() for c in url.strip()):
        return f"url {said} is not an address (port 0, or a space in it)"
    return None


def bearer_token(label: str, api_key_env: Any) -> str:
    """The token in the environment variable `api_key_env` names (sent as `Authorization: Bearer
    TOKEN`); ValueError, one line starting with `label` and naming the variable (never its value), for a
    name that is not one, a variable unset or empty, or a value a header cannot carry."""
    if not isinstance(api_key_env, str) or not api_key_env.strip() or "=" in api_key_env:
        raise ValueError(
            f"{label}: api_key_env {shown(api_key_env)} must name an environment variable that holds the "
            "server's token (api_key_env: REWARD_TOKEN)"
        )
    name = api_key_env.strip()
    token = os.environ.get(name, "").strip()
    if not token:
        raise ValueError(
            f"{label}: api_key_env names the environment variable {name}, which is "
            f"{'empty' if name in os.environ else 'unset'}; set it to the server's token "
            f"(export {name}=...) before starting, or remove api_key_env"
        )
    if not all(" " < c <= "~" for c in token):
        raise ValueError(
            f"{label}: the environment variable {name} (api_key_env) holds a space, a line break or a "
            "character outside printable ASCII, which an Authorization header cannot carry; set it to "
            "the token alone"
        )
    return token


def ca_context(label: str, ca_bundle: Any) -> ssl.SSLContext:
    """An SSL context trusting the certificates in the PEM file `ca_bundle` (a private CA, or a
    server's self-signed certificate); ValueError, one line starting with `label`, for a path that is
    not a readable file of PEM certificates."""
    if not isinstance(ca_bundle, str) or not ca_bundle.strip():
        raise ValueError(f"{label}: ca_bundle {shown(ca_bundle)} must be the path of a PEM file")
    import ssl  # here: a config without ca_bundle never loads it

    path = Path(ca_bundle.strip()).expanduser()
    if not path.is_file():
        what = "a directory" if path.is_dir() else "no such file"
        raise ValueError(
            f"{label}: ca_bundle {shown(ca_bundle)} is not a file ({what}); "
            "give the path of a PEM file holding the certificate of the CA that signed the server's "
            "certificate (or the server's own, when self-signed)"
        )
    try:
        return ssl.create_default_context(cafile=str(path))
    except (ssl.SSLError, OSError, ValueError) as error:
        raise ValueError(
            f"{label}: ca_bundle {shown(ca_bundle)} cannot be read as PEM certificates "
            f"({type(error).__name__}: {str(error) or 'no detail'}); give a file of "
            "-----BEGIN CERTIFICATE----- blocks"
        ) from None


def check_remote_reward(
    label: str,
    url: Any,
    timeout: Any = DEFAULT_TIMEOUT,
    retries: Any = DEFAULT_RETRIES,
    name: Any = None,
    api_key_env: Any = None,
    ca_bundle: Any = None,
) -> None:
    """ValueError, one line starting with `label` (the entry, or the call), for an option a remote
    reward cannot use: a url that is not http(s)://HOST[:PORT][/PATH], a timeout that is not a
    number in (0, MAX_TIMEOUT] seconds, retries that are not an integer in [0, MAX_RETRIES], a name
    that is not a non-empty string, an api_key_env whose variable is unset or empty (`bearer_token`),
    or with a password in the url too (two credentials: which one is meant?), a ca_bundle that is not
    a PEM file (`ca_context`)."""
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
    if api_key_env is not None:
        bearer_token(label, api_key_env)
        if "@" in urlsplit(url.strip()).netloc:
            raise ValueError(
                f"{label}: both a user in the url and api_key_env: give the server one credential, "
                "the token of api_key_env (remove USER:PASSWORD@ from the url) or the password"
            )
    if ca_bundle is not None:
        ca_context(label, ca_bundle)
