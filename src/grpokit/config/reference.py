"""Every option of the configs, rendered from its field alone (schema.py; what a field declares:
config/options.py): the options a command's `--help` lists (`options_help`), and the config
reference (`config_reference`: one Markdown table per config class with each option's type, default,
bounds, TRL name, resume rule and description). Nothing here is written by hand per option: a new
field appears in both as it is declared.

    python3 -m grpokit.config.reference     # the reference, as Markdown

No torch import here.
"""

from __future__ import annotations

import textwrap
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic.fields import FieldInfo

from . import trl_names
from .options import resume_of, trl_rename
from .schema import GRPOConfig, RewardConfig, SFTConfig

CONFIGS = (GRPOConfig, RewardConfig, SFTConfig)


def choices(annotation: Any) -> list[Any]:
    """The values a Literal type (inside Optional or list too) allows; [] for other types."""
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return [value for arg in get_args(annotation) for value in choices(arg)]


def flow(value: Any) -> str:
    """A value as YAML writes it on one line: null, true, [a, b], {k: v}."""
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**6)
    return text.removesuffix("...\n").strip()


def ordered(schema: Any) -> list[str]:
    """A config class's options, its own first (in declaration order), then the shared ones."""
    own = getattr(schema, "__annotations__", {})
    return sorted(schema.model_fields, key=lambda n: n not in own)


def trl_names_of(schema: Any, name: str) -> list[str]:
    """The TRL names that set option `name` of `schema`: its own name where TRL has an option of that
    name, the plain rename its field declares, and the names a rule translates into it (bf16 ->
    dtype, TRL's batch geometry -> prompts_per_step and micro_batch_size)."""
    fields = schema.model_fields
    out = [name] if name in trl_names.TRL_NAMES else []
    rename = trl_rename(fields[name])
    out += [rename] if rename is not None else []
    out += [
        alias
        for alias, (sets, _) in trl_names.ALIASES.items()
        if name in sets
        and set(sets) <= set(fields)
        and alias not in fields
        and alias not in trl_names.CONTAINERS
    ]
    if trl_names.takes_batch_names(fields) and name in trl_names.BATCH_FIELDS:
        out += list(trl_names.BATCH_NAMES)
    return out


# the options `grpokit eval` reads (its --help lists these, not the whole training config)
EVAL_OPTIONS = (
    "model", "model_revision", "trust_remote_code", "task", "dataset", "dataset_config",
    "dataset_test_split", "eval_dataset", "prompt_column", "answer_column", "answer_format",
    "system_prompt", "chat_template_kwargs", "reward_funcs", "reward_weights", "reward_timeout",
    "on_reward_error", "num_eval_prompts", "pass_at_k", "max_prompt_length", "max_completion_length",
    "temperature", "seed", "dtype", "device", "decode_loop", "tools", "environment", "max_turns",
    "request_timeout",
)  # fmt: skip


def options_help(
    schema: Any, preset: str | None = None, named: bool = False, only: tuple[str, ...] | None = None
) -> str:
    """Every option of a config class with its default and description: a command's --help epilog.
    With `preset` (the built-in preset the command runs without CONFIG, or, `named`, the one named on
    its command line: `train gsm8k --help`) each option the preset sets also shows its value, and for
    GRPO the value chosen for model: tiny when the option is unset (config/applied.py): what actually
    applies. An option TRL spells otherwise shows TRL's names. `only`: these options alone (a command
    that reads a few of the config's)."""
    from .applied import TINY, preset_values, tiny_choices

    intro = (
        f"options ({schema.__name__}; keys of CONFIG.yaml or key=value, values in YAML: null, true, [a, b]). "
        "Each option: its default (TRL's where TRL has the option), then in parentheses its choices"
        + (
            f", the {preset} preset's value (what the command runs {'so' if named else 'without CONFIG'})"
            if preset
            else ""
        )
        + (f", the value chosen for {TINY} when the option is unset" if schema is GRPOConfig else "")
        + ", TRL's names for it where they differ. `grpokit print-config [CONFIG] [k=v ...]` shows every "
        "value a train run applies and where it came from. TRL's names (bf16, per_device_train_batch_size, "
        "...) are translated or answered."
    )
    if only is not None:
        intro += " The options this command reads are listed; the others are accepted and not used."
    lines = [*textwrap.wrap(intro, 100), ""]
    sets = preset_values(preset) if preset else {}
    chosen = tiny_choices(GRPOConfig(model="tiny")) if schema is GRPOConfig else {}
    indent = " " * 6
    for name in ordered(schema):
        if only is not None and name not in only:
            continue
        field = schema.model_fields[name]
        allowed = choices(field.annotation)
        applies = (
            [f"{preset} preset: {flow(sets[name])}"] if sets.get(name, field.default) != field.default else []
        )
        applies += [f"{TINY} when unset: {flow(chosen[name])}"] if name in chosen else []
        trl = [n for n in trl_names_of(schema, name) if n != name]
        lines.append(
            f"  {name} = {flow(field.default)}"
            + (f"   ({' | '.join(map(str, allowed))})" if allowed else "")
            + (f"   ({'; '.join(applies)})" if applies else "")
            + (f"   (TRL's name{'s' * (len(trl) > 1)}: {', '.join(trl)})" if trl else "")
        )
        lines += textwrap.wrap(field.description or "", 100, initial_indent=indent, subsequent_indent=indent)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the config reference


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: int | None, list[str], 'grpo' | 'bnpo' | ..."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is Annotated:
        return type_name(args[0])
    if origin is Union or type(annotation).__name__ == "UnionType":
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


_BOUNDS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}


def _constraints(metadata: list[Any]) -> list[str]:
    out = []
    for item in metadata:
        for attr, sign in _BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{sign} {value:g}" if isinstance(value, float) else f"{sign} {value}")
        if getattr(item, "min_length", None) is not None:
            out.append(f"at least {item.min_length} item{'s' * (item.min_length != 1)}")
        if getattr(item, "pattern", None) is not None:
            out.append(f"matches {item.pattern}")
    return out


def bounds(field: FieldInfo) -> str:
    """What pydantic checks of a value beyond its type: "> 0, ≤ 1", "each ≥ -1e+06, ≤ 1e+06"."""
    own = _constraints(field.metadata)
    items = [  # a list's items (reward_weights: Annotated[float, Field(ge=..., le=...)])
        bound
        for arg in get_args(field.annotation)
        for inner in get_args(arg)
        if get_origin(inner) is Annotated
        for info in get_args(inner)[1:]
        if isinstance(info, FieldInfo)
        for bound in _constraints(info.metadata)
    ]
    return ", ".join(own + ([f"each {', '.join(items)}"] if items else []))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference_rows(schema: Any) -> list[dict[str, str]]:
    """One row per option of `schema`: name, type, default, bounds, trl, resume, description."""
    rows = []
    for name in ordered(schema):
        field = schema.model_fields[name]
        resume = resume_of(field)
        rows.append(
            {
                "name": name,
                "type": type_name(field.annotation),
                "default": flow(field.default),
                "bounds": bounds(field),
                "trl": ", ".join(trl_names_of(schema, name)),
                "resume": f"{resume.rule}: {resume.why}" if resume else "",
                "description": " ".join((field.description or "").split()),
            }
        )
    return rows


def config_reference(configs: tuple[Any, ...] = CONFIGS) -> str:
    """Every option of every config class as Markdown: one table per class."""
    out = [
        "# Configuration reference",
        "",
        "Generated from the config classes (src/grpokit/config/schema.py): every option with its type, "
        "default, the bounds it is checked against, the TRL name that sets it (its own name where TRL "
        "has the option), what a resumed run does when it differs from the checkpoint's (fixed: "
        "refused; applied: used and said; invocation: never compared), and its description.",
    ]
    for schema in configs:
        command = trl_names.COMMANDS.get(schema.__name__, "train")
        out += [
            "",
            f"## {schema.__name__} (`grpokit {command}`)",
            "",
            "| option | type | default | bounds | TRL name | on resume | description |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in reference_rows(schema):
            cells = [
                f"`{row['name']}`",
                _cell(row["type"]),
                f"`{_cell(row['default'])}`",
                _cell(row["bounds"]),
                _cell(row["trl"]),
                _cell(row["resume"]),
                _cell(row["description"]),
            ]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(config_reference(), end="")
