"""Tools and environments (grpokit/envs): call parsing, every failure an observation and a count,
schemas from signatures, the environment contract checked with errors that name the culprit."""

from __future__ import annotations

import time

import pytest

from grpokit.envs import (
    TOOL_CALL_FORMATS,
    EnvironmentFailure,
    MalformedCall,
    ToolCall,
    calc,
    parse_call,
    reset_episode,
    step_episode,
    tool_environment,
    tool_schema,
)


def test_parse_call_reads_python_and_json_forms():
    assert parse_call('calc("12+34")') == ToolCall("calc", ("12+34",), {})
    assert parse_call(" lookup(3, key='a', flags=[1, 2]) ") == ToolCall(
        "lookup", (3,), {"key": "a", "flags": [1, 2]}
    )
    assert parse_call('{"name": "calc", "arguments": {"expression": "2*3"}}') == ToolCall(
        "calc", (), {"expression": "2*3"}
    )
    # some models write the arguments as a JSON string
    assert parse_call('{"name": "calc", "arguments": "{\\"expression\\": \\"1\\"}"}').kwargs == {
        "expression": "1"
    }


@pytest.mark.parametrize(
    "body, why",
    [
        ("calc(1+2)", "not a literal"),
        ("calc(x)", "not a literal"),
        ("calc", "not a call"),
        ("os.system('ls')", "not a call"),
        ("calc(**{'a': 1})", "not allowed"),
        ('{"name": 3}', '"name"'),
        ('{"name": "calc", "arguments": [1]}', "must be an object"),
        ('{"name": "calc"', "invalid JSON"),
        ("calc(", "not a call"),
    ],
)
def test_parse_call_refuses_what_is_not_a_call(body, why):
    with pytest.raises(MalformedCall, match=why):
        parse_call(body)


def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "late"


def broken(x: int) -> int:
    """Always fails."""
    raise KeyError("no such record")


def _env(timeout: float = 5.0):
    spec = tool_environment([calc, slow, broken], "brackets", max_turns=3, timeout=timeout)
    env = spec.factory()
    assert env.reset({"prompt": "x"}) == ""
    return spec, env


def test_tool_calls_answer_with_results_and_every_failure_is_an_observation():
    spec, env = _env(timeout=0.2)
    assert spec.stop_strings == ("]",)
    assert env.step('[calc("48213+90577")]') == ("{138790}", None, False)
    assert env.step('the answer: [calc("7/2")]') == ("{7/2}", None, False)  # text before the call is fine
    obs, reward, done = env.step('[calc("1+")]')  # the tool raises: its message, not a crash
    assert obs.startswith("{error: ValueError: cannot evaluate '1+'") and not done
    assert env.step("[broken(1)]")[0] == "{error: KeyError: 'no such record'}"
    began = time.perf_counter()
    assert (
        env.step("[slow(2)]")[0] == "{error: slow timed out after 0.2s}"
    )  # a hang: reported, not waited for
    assert time.perf_counter() - began < 1.5
    for malformed, said in [
        ("[calc(1+2)]", "not a literal"),
        ("[nope(1)]", "unknown tool 'nope'; tools: calc, slow, broken"),
        ('[calc("1"', "not closed with ']'"),
        ("[calc(1, 2)]", "too many positional arguments"),
    ]:
        obs, reward, done = env.step(malformed)
        assert said in obs and "call as [name(arguments)]" in obs and not done
    assert env.step("138790") == ("", None, True)  # no call: the final answer ends the episode
    assert env.metrics() == {"tool_calls": 5, "tool_errors": 2, "tool_timeouts": 1, "malformed_calls": 4}


def test_fresh_environments_share_no_counts():
    spec, first = _env()
    first.step("[nope()]")
    assert spec.factory().metrics()["malformed_calls"] == 0


def test_hermes_format():
    fmt = TOOL_CALL_FORMATS["hermes"]
    env = tool_environment([calc], "hermes").factory()
    call = f'{fmt.call_start}{{"name": "calc", "arguments": {{"expression": "2+2"}}}}{fmt.call_end}'
    assert env.step(call)[0] == "<tool_response>4</tool_response>"


def test_tool_schema_from_signature_and_docstring():
    def search(query: str, limit: int = 5, exact: bool = False) -> list:
        """Search the index.

        Args:
            query: what to look for.
        """

    schema = tool_schema(search)["function"]
    assert schema["name"] == "search" and schema["description"] == "Search the index."
    assert schema["parameters"]["properties"] == {
        "query": {"type": "string"},
        "limit": {"type": "integer"},
        "exact": {"type": "boolean"},
    }
    assert schema["parameters"]["required"] == ["query"]
    assert tool_schema(calc)["function"]["parameters"]["required"] == ["expression"]


def test_tool_environment_refuses_bad_set_ups():
    with pytest.raises(ValueError, match="unknown tool_call_format 'xml'"):
        tool_environment([calc], "xml")
    with pytest.raises(ValueError, match="share a name"):
        tool_environment([calc, calc])
    with pytest.raises(ValueError, match="non-empty list"):
        tool_environment([])
    with pytest.raises(ValueError, match="tool_timeout"):
        tool_environment([calc], timeout=0)


class Seeded:
    def reset(self, row, seed):
        self.seed = seed
        return f"{row['prompt']}:{seed}"

    def step(self, text):
        return "ok", 1, 0


def test_reset_passes_the_seed_when_taken_and_step_is_checked():
    env = Seeded()
    assert reset_episode(env, {"prompt": "p"}, 7, "Seeded") == "p:7"
    assert step_episode(env, "x", "Seeded") == ("ok", 1.0, False)


class Bad:
    def __init__(self, answer):
        self.answer = answer

    def reset(self, row):
        return self.answer

    def step(self, text):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize(
    "answer, said",
    [
        ("just text", "must return (observation, reward or None, done)"),
        ((3, None, False), "observation must be a string"),
        (("x", "much", False), "reward must be a number or None"),
        (RuntimeError("boom"), "Bad.step raised RuntimeError: boom"),
    ],
)
def test_a_broken_environment_is_named(answer, said):
    with pytest.raises(EnvironmentFailure, match=said.replace("(", r"\(").replace(")", r"\)")):
        step_episode(Bad(answer), "x", "Bad")


def test_a_reset_that_returns_no_text_is_named():
    with pytest.raises(EnvironmentFailure, match="reset must return a string"):
        reset_episode(Bad(3), {}, 0, "Bad")
    assert reset_episode(Bad(None), {}, 0, "Bad") == ""
    with pytest.raises(EnvironmentFailure, match="lacks reset"):
        reset_episode(object(), {}, 0, "Thing")


def test_chat_prompts_carry_the_tools_schemas():
    """A conversational prompt renders through the chat template with the tools' JSON schemas, as a
    tool-calling model expects them; a text prompt stays as it is."""
    from grpokit.data import render_prompt
    from grpokit.models import char_tokenizer

    tok = char_tokenizer("abcdefghijklmnopqrstuvwxyz:;| ")
    tok.chat_template = (
        "{% if tools %}tools:{% for t in tools %}"
        "{{ t.function.name }}|{{ t.function.parameters.required[0] }};{% endfor %}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    schemas = tool_environment([calc], "hermes").tool_schemas
    conversation = [{"role": "user", "content": "add"}]
    assert render_prompt(conversation, tok, schemas) == "tools:calc|expression;add"
    assert render_prompt(conversation, tok) == "add"
    assert render_prompt("plain", tok, schemas) == "plain"


def test_the_envs_layer_imports_only_the_standard_library():
    """Environments know nothing of models or training: no torch, no other grpokit layer."""
    import ast
    import sys
    from pathlib import Path

    import grpokit.envs

    for path in Path(grpokit.envs.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] in sys.stdlib_module_names, (path.name, node.module)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 1, (path.name, node.module)  # within envs only
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] in sys.stdlib_module_names, (path.name, alias.name)


def test_degenerate_calls_are_malformed_not_crashes():
    """What a degenerate policy writes (deep nesting, huge literals, endless calls) is an observation."""
    _, env = _env()
    for call in [
        "[calc(" + "+".join(["1"] * 400) + ")]",
        "[calc(" + "-" * 400 + "1)]",
        '[{"name": "calc", "arguments": {"expression": ' + "1" * 5000 + "}}]",
        '[{"name": "calc", "arguments": {"e": ' + "[" * 1000 + "}}]",
        "[calc(" + '"1",' * 6000 + ")]",
    ]:
        observation, _, done = env.step(call)
        assert observation.startswith("{error: ") and not done
    assert env.metrics()["malformed_calls"] == 5 and env.metrics()["tool_calls"] == 0
    # a closing marker merged with what follows it (a BPE token "]\n"): still a call
    assert env.step('[calc("1+2")]\n') == ("{3}", None, False)
