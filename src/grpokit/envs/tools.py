"""Plain Python functions as tools, and the environment that runs them.

A tool is an ordinary function; its name, signature and docstring describe it (`tool_schema` gives
the JSON schema that chat templates take as `tools=`). The policy calls one by writing a call in the
format of a `ToolCallFormat` (the table `TOOL_CALL_FORMATS`); `ToolEnvironment` runs it and answers
with the result between the format's response markers. With conversational prompts (a chat model)
the policy's turn ends at its EOS rather than at the call's closing marker, and the result, bare, is
a "tool" message of the model's chat template (`envs.chat`), which adds what markers it uses. A turn
without a call is the final answer and ends the episode. Nothing the policy writes crashes the run:

* a malformed call (no closing marker, bad syntax, unknown tool, wrong arguments) is answered with an
  error observation saying what is wrong and how a call is written;
* a tool that raises is answered with the exception's type and message;
* a tool that runs longer than `timeout` seconds is answered "timed out" and left behind (it runs on a
  daemon thread; Python cannot kill a thread, so a tool that may hang for good should bound itself).

Each case is counted: `metrics()` returns tool_calls, tool_errors, tool_timeouts, malformed_calls.

Call syntax, inside the markers, either of:
    calc("12+34")                                   Python call syntax, literal arguments
    {"name": "calc", "arguments": {"expression": "12+34"}}    JSON (Hermes / Qwen style)
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import threading
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .protocol import EnvironmentSpec


@dataclass(frozen=True)
class ToolCallFormat:
    """Where a tool call and its answer sit in the transcript."""

    call_start: str
    call_end: str  # ends the policy's turn (a stop string)
    response_start: str
    response_end: str


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    # the Hermes / Qwen chat convention, what TRL and most tool-calling models use
    "hermes": ToolCallFormat("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    # one character a marker: for the character-level models of the built-in tasks
    "brackets": ToolCallFormat("[", "]", "{", "}"),
}


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class MalformedCall(ValueError):
    """The text inside the call markers is not a call to a known tool with valid arguments."""


# ----------------------------------------------------------------------------- describing tools


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(tool: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of a function (OpenAI / chat-template style): its name, the first paragraph of
    its docstring, its parameters with their annotated types; parameters without a default are required."""
    signature = inspect.signature(tool)
    try:
        hints = typing.get_type_hints(tool)
    except Exception:  # noqa: BLE001 - unresolvable annotations: no types, still a usable schema
        hints = {}
    properties, required = {}, []
    for name, parameter in signature.parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        entry: dict[str, Any] = {}
        if hints.get(name) in _JSON_TYPES:
            entry["type"] = _JSON_TYPES[hints[name]]
        properties[name] = entry
        if parameter.default is parameter.empty:
            required.append(name)
    doc = inspect.getdoc(tool) or ""
    return {
        "type": "function",
        "function": {
            "name": tool.__name__,
            "description": doc.split("\n\n")[0].strip(),
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


# ----------------------------------------------------------------------------- parsing a call


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        short = (node.end_col_offset or 0) - node.col_offset <= 80  # quoted when short, else named
        text = repr(ast.unparse(node)) if short else f"({type(node).__name__})"
        raise MalformedCall(f"argument {text} is not a literal (a number, string, list...)") from None


MAX_CALL_CHARS = 20_000  # a longer call is refused unread (deep nesting would exhaust the parser's stack)


def parse_call(body: str) -> ToolCall:
    """The call written between the markers: JSON {"name", "arguments"} or Python call syntax."""
    body = body.strip()
    if len(body) > MAX_CALL_CHARS:
        raise MalformedCall(f"the call is {len(body)} characters long, over {MAX_CALL_CHARS}")
    try:
        return _parse_json(body) if body.startswith("{") else _parse_python(body)
    except (RecursionError, MemoryError, ValueError) as error:  # degenerate nesting, huge integers
        if isinstance(error, MalformedCall):
            raise
        raise MalformedCall(f"the call cannot be parsed ({type(error).__name__})") from None


def _parse_json(body: str) -> ToolCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as error:
        raise MalformedCall(f"invalid JSON ({error.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise MalformedCall('a JSON call needs a "name" string')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise MalformedCall('"arguments" is not a JSON object') from None
    if not isinstance(arguments, dict):
        raise MalformedCall('"arguments" must be an object')
    return ToolCall(data["name"], (), arguments)


def _parse_python(body: str) -> ToolCall:
    try:
        node = ast.parse(body, mode="eval").body
    except SyntaxError:
        raise MalformedCall("not a call: write name(arguments)") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise MalformedCall("not a call: write name(arguments)")
    kwargs = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise MalformedCall("**arguments are not allowed")
        kwargs[keyword.arg] = _literal(keyword.value)
    return ToolCall(node.func.id, tuple(_literal(a) for a in node.args), kwargs)


def _run_with_timeout(tool: Callable[..., Any], call: ToolCall, timeout: float) -> tuple[str, Any]:
    """("ok", result) | ("error", exception) | ("timeout", None), running the tool on a daemon thread."""
    outcome: list[tuple[str, Any]] = []

    def target() -> None:
        try:
            outcome.append(("ok", tool(*call.args, **call.kwargs)))
        except BaseException as error:  # noqa: BLE001 - whatever the tool raises is reported, not raised
            outcome.append(("error", error))

    worker = threading.Thread(target=target, daemon=True, name=f"tool-{call.name}")
    worker.start()
    worker.join(timeout)
    return outcome[0] if outcome else ("timeout", None)


# ----------------------------------------------------------------------------- the environment


class ToolEnvironment:
    """One episode of tool use (see the module docstring). A fresh one per episode."""

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        fmt: ToolCallFormat,
        timeout: float = 5.0,
        bare: bool = False,
    ) -> None:
        self.tools = {t.__name__: t for t in tools}
        self.fmt = fmt
        self.timeout = timeout
        self.bare = bare  # results without the response markers (a chat template's tool message wraps them)
        self.counts = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "malformed_calls": 0}

    def reset(self, row: dict[str, Any]) -> str:
        return ""

    def _answer(self, text: str) -> str:
        return text if self.bare else f"{self.fmt.response_start}{text}{self.fmt.response_end}"

    def _malformed(self, why: str) -> tuple[str, None, bool]:
        self.counts["malformed_calls"] += 1
        example = f"{self.fmt.call_start}name(arguments){self.fmt.call_end}"
        return self._answer(f"error: {why}; call as {example}"), None, False

    def step(self, text: str) -> tuple[str, float | None, bool]:
        start = text.rfind(self.fmt.call_start)
        if start < 0:
            return "", None, True  # no call: this turn is the final answer
        body = text[start + len(self.fmt.call_start) :]
        end = body.rfind(self.fmt.call_end)  # what follows the closing marker (a newline...) is ignored
        if end < 0:
            return self._malformed(f"the call is not closed with {self.fmt.call_end!r}")
        try:
            call = parse_call(body[:end])
        except MalformedCall as error:
            return self._malformed(str(error))
        tool = self.tools.get(call.name)
        if tool is None:
            return self._malformed(f"unknown tool {call.name!r}; tools: {', '.join(self.tools)}")
        try:
            inspect.signature(tool).bind(*call.args, **call.kwargs)
        except TypeError as error:
            return self._malformed(f"{call.name}: {error}")
        self.counts["tool_calls"] += 1
        status, value = _run_with_timeout(tool, call, self.timeout)
        if status == "timeout":
            self.counts["tool_timeouts"] += 1
            return self._answer(f"error: {call.name} timed out after {self.timeout:g}s"), None, False
        if status == "error":
            self.counts["tool_errors"] += 1
            return self._answer(f"error: {type(value).__name__}: {value}"), None, False
        return self._answer(str(value)), None, False

    def metrics(self) -> dict[str, float]:
        return dict(self.counts)


def turn_message(tools: Sequence[Callable[..., Any]], fmt: ToolCallFormat) -> Callable[[str], dict[str, Any]]:
    """How a policy turn reads as a chat message, as TRL gives one to reward functions: a turn that
    calls a known tool with arguments that bind is {"role": "assistant", "content": the text around
    the call, "tool_calls": [{"type": "function", "function": {"name", "arguments": {...}}}]}; any
    other turn is its text as content. (A partial of a module-level function: it pickles, for the
    rollout worker, whenever the tools do.)"""
    return functools.partial(_turn_message, {t.__name__: t for t in tools}, fmt)


def _turn_message(by_name: dict[str, Callable[..., Any]], fmt: ToolCallFormat, text: str) -> dict[str, Any]:
    start = text.rfind(fmt.call_start)
    end = text.rfind(fmt.call_end)
    plain = {"role": "assistant", "content": text}
    if start < 0 or end < start:
        return plain
    try:
        call = parse_call(text[start + len(fmt.call_start) : end])
        tool = by_name[call.name]
        arguments = dict(inspect.signature(tool).bind(*call.args, **call.kwargs).arguments)
    except (MalformedCall, KeyError, TypeError, ValueError):
        return plain
    function = {"name": call.name, "arguments": arguments}
    content = (text[:start] + text[end + len(fmt.call_end) :]).strip()
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [{"type": "function", "function": function}],
    }


def tool_environment(
    tools: Sequence[Callable[..., Any]], fmt: str = "hermes", max_turns: int = 4, timeout: float = 5.0
) -> EnvironmentSpec:
    """An `EnvironmentSpec` whose episodes call `tools`, written in the format `fmt` (TOOL_CALL_FORMATS)."""
    if fmt not in TOOL_CALL_FORMATS:
        raise ValueError(f"unknown tool_call_format {fmt!r}; valid: {', '.join(TOOL_CALL_FORMATS)}.")
    names = [getattr(t, "__name__", None) for t in tools]
    if not tools or not all(callable(t) and n for t, n in zip(tools, names, strict=True)):
        raise ValueError("tools must be a non-empty list of named functions.")
    if len(set(names)) != len(names):
        raise ValueError(f"two tools share a name: {names}.")
    if timeout <= 0:
        raise ValueError(f"tool_timeout must be > 0 seconds, got {timeout}.")
    style = TOOL_CALL_FORMATS[fmt]
    tools = list(tools)
    name = f"tools [{', '.join(map(str, names))}]"
    schemas = tuple(tool_schema(t) for t in tools)
    # with conversational prompts: the policy ends a call with its EOS, as a chat model does, and the
    # result is a "tool" message of the chat template, which writes the response markers if any
    chat = EnvironmentSpec(
        factory=functools.partial(ToolEnvironment, tools, style, timeout, bare=True),
        max_turns=max_turns,
        name=name,
        tool_schemas=schemas,
        observation_role="tool",
        turn_message=turn_message(tools, style),
    )
    return EnvironmentSpec(
        factory=functools.partial(ToolEnvironment, tools, style, timeout),  # (picklable)
        max_turns=max_turns,
        stop_strings=(style.call_end,),
        name=name,
        tool_schemas=schemas,
        answer_after=style.response_end,
        markers=(style.call_start, style.call_end, style.response_start, style.response_end, "error: "),
        observation_role="tool",
        chat_variant=chat,
    )
