"""YAML files plus `key=value` overrides -> a validated config, or one clear error.

    load_config(GRPOConfig, "run.yaml", ["learning_rate=3e-4", "loss_type=grpo"])

Override values are parsed as YAML scalars (`3e-4`, `true`, `null`, `[1.0, 0.5]`).

YAML is read by `ConfigLoader`, a SafeLoader that refuses what a config never needs and what would
hang or crash the loader: duplicate keys (YAML keeps the last one silently), values nested deeper
than MAX_DEPTH, and aliases that expand to more than MAX_NODES values (a "billion laughs" document
is a few hundred bytes that expands to 9^9 strings). Every value echoed in a message is shortened
(`shown`), so that no message is longer than a line because of what the user typed.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from .errors import ConfigError, shorten, shown
from .remote_reward import redact_text

C = TypeVar("C", bound=BaseModel)

# A whole config is about a hundred keys with short lists, nested 3 deep at most (reward_funcs: a list
# of mappings of scalars); these bounds are two orders of magnitude above that and far below what
# takes a noticeable time to build, print or validate.
MAX_NODES = 10_000  # values after alias expansion
MAX_DEPTH = 32  # levels of nesting (the pure-Python composer recurses twice per level)


class _Refused(ConfigError):
    """What ConfigLoader refuses; the caller adds where the YAML came from."""


def _line(node: yaml.Node) -> str:
    return f"line {node.start_mark.line + 1}"


class ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader refusing duplicate keys, deep nesting and alias expansion past MAX_NODES."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        # bounded before the composer recurses (else RecursionError on "[" * 100000)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _Refused(f"values nested more than {MAX_DEPTH} levels deep (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *base` merges; explicit keys may override merged ones
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node)
                except TypeError:
                    continue  # an unhashable key: SafeConstructor says so
                if first is not key_node:
                    raise _Refused(
                        f"key {shorten(str(key))!r} is given twice ({_line(first)} and {_line(key_node)}); "
                        "YAML would silently keep the last one: keep one"
                    )
        return super().construct_mapping(node, deep=deep)


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a document whose aliases expand it past MAX_NODES values or MAX_DEPTH levels, or refer
    to a value that contains them (endless). Counted over the node graph, each node once (iterative
    post-order with memoised sizes), so a bomb is measured without being expanded."""
    size: dict[int, int] = {}  # id(node) -> values in its expansion
    depth: dict[int, int] = {}  # id(node) -> levels in its expansion
    expanding: set[int] = set()  # the nodes whose children are being counted (a path from root)
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = (
            [n for pair in node.value for n in pair]
            if isinstance(node, yaml.MappingNode)
            else (node.value if isinstance(node, yaml.SequenceNode) else [])
        )
        if children_done:
            expanding.discard(id(node))
            size[id(node)] = 1 + sum(size[id(c)] for c in children)
            depth[id(node)] = 1 + max((depth[id(c)] for c in children), default=0)
            if size[id(node)] > MAX_NODES:
                raise _Refused(
                    f"aliases expand the value at {_line(node)} to more than {MAX_NODES} values; a config "
                    "needs far fewer: write the values out"
                )
            if depth[id(node)] > MAX_DEPTH:
                raise _Refused(
                    f"aliases nest the value at {_line(node)} more than {MAX_DEPTH} levels deep; a config "
                    "needs far fewer: write the values out"
                )
        elif id(node) not in size:
            if id(node) in expanding:
                raise _Refused(f"an alias at or below {_line(node)} refers to a value that contains it")
            expanding.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children)


def load_yaml(text: str) -> Any:
    """`text` read by ConfigLoader (what yaml.safe_load reads, within its bounds)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - ConfigLoader is a SafeLoader


def _closest(name: str, valid: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid keys: {', '.join(sorted(valid))}"


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {shown(item)} is not key=value (for example learning_rate=3e-4).")
        try:
            value = load_yaml(raw) if raw.strip() else None
        except _Refused as error:
            raise ConfigError(f"override {shorten(key.strip())}: {error}") from None
        except yaml.YAMLError:
            value = raw
        values[key.strip()] = _number(value)
    return values


def _number(value: Any) -> Any:
    """YAML 1.1 reads `3e-4` (no dot) as a string; a user means the number."""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in ".e") else int(value)
        except ValueError:
            return value
    return value


def _read_yaml(path: str | Path) -> dict[str, Any]:
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; give the path of a YAML file.")
    if not file.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist.")
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise ConfigError(
            f"{path}: line {line} is not valid UTF-8 (byte 0x{raw[error.start]:02x} at column {column}); "
            "save the file as UTF-8."
        ) from None
    try:
        data = load_yaml(text) or {}
    except _Refused as error:
        raise ConfigError(f"{path}: {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({yaml_problem(error)}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of key: value at the top level.")
    return data


def yaml_problem(error: yaml.YAMLError) -> str:
    """What is wrong with a YAML text, in one line, by line and column: PyYAML's own message without
    the snippet of the file it quotes (which would repeat, or cut in half, a password in a url)."""
    if not isinstance(error, yaml.MarkedYAMLError):
        return " ".join(redact_text(str(error)).split())

    def at(mark: Any) -> str:
        return f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    context = f"{error.context}{at(error.context_mark)}: " if error.context else ""
    return f"{context}{error.problem or 'malformed'}{at(error.problem_mark)}"


# pydantic's errors about a number: the message then also says the field's allowed range
_NUMBER_ERRORS = {
    "finite_number",
    "greater_than",
    "greater_than_equal",
    "less_than",
    "less_than_equal",
    "float_parsing",
    "float_type",
    "int_parsing",
    "int_parsing_size",
    "int_from_float",
    "int_type",
}


def _number_text(x: Any) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def allowed_range(schema: type[BaseModel], key: str) -> str:
    """The values field `key` of `schema` takes, from its bounds: "0 < learning_rate ≤ 1", or "a
    finite number" for a float field without bounds ("" for a key that is no numeric field)."""
    field = schema.model_fields.get(key)
    if field is None:
        return ""
    low = high = ""
    for bound in field.metadata:
        for attr, sign in (("gt", "<"), ("ge", "≤"), ("lt", "<"), ("le", "≤")):
            value = getattr(bound, attr, None)
            if value is not None and attr[0] == "g":
                low = f"{_number_text(value)} {sign} "
            elif value is not None:
                high = f" {sign} {_number_text(value)}"
    if low or high:
        return f"{low}{key}{high}" + ("" if high else ", finite")
    return "a finite number" if field.annotation in (float, float | None) else ""


def _explain(error: ValidationError, schema: type[BaseModel], source: str) -> ConfigError:
    lines = []
    valid = list(schema.model_fields)
    for item in error.errors():
        key = shorten(".".join(str(p) for p in item["loc"])) or "config"
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r}{_closest(key, valid)}")
        elif key == "config":
            lines.append(item["msg"].replace("Value error, ", ""))
        else:
            message = item["msg"].replace("Value error, ", "")
            if item["type"] == "int_parsing_size":
                message = "Input should be a smaller integer"  # pydantic: "Unable to parse input string…"
            line = f"{key}: {message} (got {shown(item.get('input'))})"
            allowed = allowed_range(schema, key) if item["type"] in _NUMBER_ERRORS else ""
            lines.append(f"{line}; allowed: {allowed}" if allowed else line)
    return ConfigError(f"invalid configuration ({source}):\n  " + "\n  ".join(lines))


def load_config(
    schema: type[C],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    written: bool = False,
    unset: Collection[str] = (),
) -> C:
    """Validate `path` (optional YAML file) updated by `overrides` against `schema`. written: `path` is
    a config grpokit wrote (a checkpoint's config.yaml): options removed since are dropped, not
    refused, so that a run from before their removal still resumes. unset: options of the file left
    unset (a built-in preset's value that does not fit what the command line changed)."""
    from .trl_names import BATCH_FIELDS, REMOVED, split_batch_names, takes_batch_names, translate

    source = (
        ", ".join(filter(None, [str(path) if path else "", "command line" if overrides else ""]))
        or "defaults"
    )
    data: dict[str, Any] = {}
    # TRL names are translated per source, so that a command-line alias (bf16=true) overrides the
    # file's value of what it stands for (dtype) instead of contradicting it; TRL's batch names are
    # read together, from all sources, and override what earlier sources set for them (`batch`)
    batch: dict[str, Any] = {}
    for where, values in [
        (str(path), _read_yaml(path) if path is not None else {}),
        ("command line", parse_overrides(overrides)),
    ]:
        if written and where == str(path):
            values = {k: v for k, v in values.items() if schema.__name__ not in REMOVED.get(k, {})}
        if where == str(path):
            values = {k: v for k, v in values.items() if k not in unset}
        try:
            values = translate(schema.__name__, schema.model_fields, values, batch=False)
            trl_batch = split_batch_names(values) if takes_batch_names(schema.model_fields) else {}
        except ConfigError as error:
            raise ConfigError(f"invalid configuration ({where}):\n  {error}") from None
        if trl_batch:
            batch.update(trl_batch)
            data = {k: v for k, v in data.items() if k not in BATCH_FIELDS}
        data.update(values)
    if batch:  # translated with the merged num_generations; what later sources set for them wins
        later = {k: data.pop(k) for k in BATCH_FIELDS if k in data}
        try:
            data = translate(schema.__name__, schema.model_fields, data | batch) | later
        except ConfigError as error:
            raise ConfigError(f"invalid configuration ({source}):\n  {error}") from None
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise _explain(error, schema, source) from None


# The first line of the config.yaml a run writes into its output_dir and each checkpoint: how a run
# tells its own file from a user's config of that name, which it never replaces (train/rundir.py).
RUN_CONFIG_MARKER = (
    "# grpokit: the resolved config of this run (grpokit writes it; keep your own config elsewhere)"
)


def run_config_yaml(text: str) -> str:
    """`text` (a resolved config as YAML) as a run writes it: under RUN_CONFIG_MARKER."""
    return f"{RUN_CONFIG_MARKER}\n{text}"


def to_yaml(config: BaseModel) -> str:
    """Every resolved value, in declaration order (what `grpokit print-config` shows)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
