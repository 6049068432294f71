"""A reward function named by reference in a config, as TRL users name theirs:

    reward_funcs:
      - python: my_rewards.py:sorted_digits          # a .py file (relative to the working directory)
      - python: my_package.rewards:sorted_digits     # an importable module, then the function
      - python: my_package.rewards.sorted_digits     # TRL's dotted form

The function follows grpokit's (and TRL's) convention f(prompts, completions, **columns). Every
failure is one line naming the reference and what to change; a module that calls sys.exit while it is
imported (a script whose top level runs) is one of them, never a silent exit of the command.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FORMS = "'FILE.py:FUNCTION', 'package.module:FUNCTION' or 'package.module.FUNCTION'"


class RewardReferenceError(ValueError):
    """A `{python: ...}` reward reference that does not lead to a callable."""


def split_reference(reference: str, label: str | None = None) -> tuple[str, str]:
    """'my_rewards.py:f' -> ('my_rewards.py', 'f'); 'pkg.mod:f' and 'pkg.mod.f' -> ('pkg.mod', 'f')."""
    label = label or _label(reference)
    text = str(reference).strip()
    where, sep, name = text.rpartition(":")
    if not sep and not text.endswith(".py"):
        where, sep, name = text.rpartition(".")
    if not sep or not where or not name.isidentifier():
        raise RewardReferenceError(f"{label}: not a reference to a function; write {FORMS}.")
    return where, name


FILE_MODULE = "grpokit_reward_"  # the prefix of the module a reward file is loaded as


def loaded_files() -> dict[str, str]:
    """module name -> path of every reward file loaded in this process (`python: file.py:f`): what
    another process must load the same way before it can unpickle functions defined in them."""
    return {
        name: str(module.__file__)
        for name, module in list(sys.modules.items())
        if name.startswith(FILE_MODULE) and getattr(module, "__file__", None)
    }


def load_files(files: dict[str, str]) -> None:
    """Load reward files under the module names another process gave them (`loaded_files`)."""
    for name, path in files.items():
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)


def _load_file(label: str, where: str) -> Any:
    path = Path(where).expanduser()
    if not path.is_file():
        raise RewardReferenceError(
            f"{label}: file {where!r} does not exist (relative paths are read "
            f"from the working directory {str(Path.cwd())!r}); give the path of the .py file."
        )
    resolved = path.resolve()
    # one module per file, named after its path, so the same file loaded twice is the same module
    module_name = f"{FILE_MODULE}{resolved.stem}_{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise RewardReferenceError(f"{label}: {where!r} is not a Python file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except BaseException as error:  # a half-run module is never found again, whatever stopped it
        del sys.modules[module_name]
        if not isinstance(error, Exception):  # SystemExit (`_no_exit` says it), KeyboardInterrupt
            raise
        raise RewardReferenceError(
            f"{label}: running {where} raised {type(error).__name__}: "
            f"{error}; fix the file (--debug shows the traceback)."
        ) from error
    return module


def _import_module(label: str, where: str) -> Any:
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as error:
        if error.name and where.startswith(error.name):
            raise RewardReferenceError(
                f"{label}: no module named {error.name!r}; install the "
                f"package, add its folder to PYTHONPATH, or give a file as {FORMS.split(',')[0]}."
            ) from error
        raise RewardReferenceError(
            f"{label}: importing {where} raised ModuleNotFoundError: {error}; install what it needs."
        ) from error
    except Exception as error:  # noqa: BLE001
        raise RewardReferenceError(
            f"{label}: importing {where} raised {type(error).__name__}: "
            f"{error}; fix the module (--debug shows the traceback)."
        ) from error


@contextmanager
def _no_exit(label: str, where: str) -> Iterator[None]:
    """A user's module that calls sys.exit (or exit(), quit()) while grpokit imports it or looks its
    function up: one line naming it and the fix. Left alone, the SystemExit would end `train`, `doctor`
    or `serve-reward` with its code, 0 mostly: a training that never ran recorded as a success."""
    try:
        yield
    except SystemExit as exiting:
        code = "" if exiting.code is None else repr(exiting.code)
        raise RewardReferenceError(
            f"{label}: importing {where} called sys.exit({code}): a module grpokit imports must not exit; "
            "move the script part under `if __name__ == '__main__':`."
        ) from None


def _label(reference: str) -> str:
    return f"reward_funcs {{python: {reference!r}}}"


def named_reward(
    name: str, task_reward: Callable[..., Any] | None = None, max_completion_length: int | None = None
) -> Callable[..., Any]:
    """A reward function given by name, as TRL users give theirs in Python (reward_funcs=["exact_answer"])
    and the config's bare entries: a built-in reward's name ("task": `task_reward`, the built-in task's
    own; overlong_penalty and length_penalty: made for `max_completion_length`), a reward server's
    http(s):// address (`RemoteReward`), else a reference to a function (FILE.py:f, pkg.mod:f,
    pkg.mod.f); any other name is one line listing the built-in rewards."""
    from ..config.schema import unknown_reward
    from .builtin import BUILTIN_REWARDS, LENGTH_REWARDS
    from .remote import RemoteReward

    text = str(name).strip()
    if text in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[text]
    if text in LENGTH_REWARDS:
        if max_completion_length is None:
            raise RewardReferenceError(
                f"reward function {text!r} is made for a run's max_completion_length, which is not known "
                f"here; call grpokit.rewards.{text}(max_completion_length, ...) yourself"
            )
        return LENGTH_REWARDS[text](max_completion_length)
    if text.startswith(("http://", "https://")):
        return RemoteReward(text)
    if text == "task":
        if task_reward is None:
            raise RewardReferenceError(
                "reward function 'task' is the built-in task's reward, and no built-in task is set; "
                "name another reward, or set task."
            )
        return task_reward
    if ":" not in text and "." not in text:
        raise RewardReferenceError(unknown_reward(text) + ".")
    return load_reward_reference(text, label=f"reward function {text!r}")


def load_reward_reference(
    reference: str,
    label: str | None = None,
    signature: str = "f(prompts, completions, **columns) -> list[float | None]",
) -> Callable[..., Any]:
    """The callable a `{python: ...}` reward entry names (see the module docstring for the forms); other
    references (a tool, an environment) say what they are with `label` and what they call `signature`."""
    label = label or _label(reference)
    where, name = split_reference(reference, label)
    with _no_exit(label, where):  # importing runs the module's top level; a module __getattr__ runs too
        return _resolve(label, where, name, signature)


def _resolve(label: str, where: str, name: str, signature: str) -> Callable[..., Any]:
    """The callable `name` of the module or file `where` (load_reward_reference's work)."""
    module = _load_file(label, where) if where.endswith(".py") else _import_module(label, where)
    if not hasattr(module, name):
        defined = [k for k, v in vars(module).items() if callable(v) and not k.startswith("_")]
        close = difflib.get_close_matches(name, defined, n=1)
        listed = ", ".join(sorted(defined)) or "none"
        hint = f"did you mean {close[0]!r}?" if close else f"it defines: {listed}."
        raise RewardReferenceError(f"{label}: {where} has no function {name!r}; {hint}")
    function = getattr(module, name)
    if not callable(function):
        raise RewardReferenceError(
            f"{label}: {where}:{name} is a {type(function).__name__}, not a "
            f"function; name a function {signature}."
        )
    return function
