"""Every bad input grpokit handles, counted in one place.

Each case is tested where its code lives: the tables of one-line errors (`BAD_INPUTS`, and the
config, reward and command-line tables) run each call and check the error's class and text, and
the inputs that need a whole scenario (a damaged checkpoint, a second run into a busy directory)
have a test function of their own, named in SCENARIOS. This file adds them up by class and holds the
README to the total it states, so the count a user reads is the count the suite checks.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from grpokit.config import ConfigError
from grpokit.data import DataError
from grpokit.rewards import RewardFunctionError
from tests.config.test_config_guards import BAD_CONFIG_INPUTS
from tests.test_cli_errors import BAD_CLI_INPUTS
from tests.test_reliability import BAD_INPUTS
from tests.train.test_reward_and_update_guards import BAD_REWARD_INPUTS

README = Path(__file__).resolve().parents[1] / "README.md"

# (what the user did, test module, test function): inputs checked by a scenario of their own
SCENARIOS = [
    (
        "a truncated latest state.pt",
        "tests.train.test_checkpoint_integrity",
        "test_a_truncated_latest_state_pt_resumes_from_the_checkpoint_before",
    ),
    (
        "a flipped byte in the latest weights",
        "tests.train.test_checkpoint_integrity",
        "test_a_flipped_byte_in_the_latest_weights_resumes_from_the_checkpoint_before",
    ),
    (
        "every checkpoint damaged",
        "tests.train.test_checkpoint_integrity",
        "test_when_every_checkpoint_is_damaged_resume_fails_with_one_line",
    ),
    (
        "crafted FSDP shard files (pickle payloads)",
        "tests.train.test_checkpoint_integrity",
        "test_a_crafted_shard_file_runs_nothing_and_is_refused_in_one_line",
    ),
    (
        "a crafted state.pt",
        "tests.train.test_checkpoint_integrity",
        "test_a_crafted_state_pt_runs_nothing_and_is_refused_in_one_line",
    ),
    (
        "resume into another model shape",
        "tests.train.test_checkpoint_integrity",
        "test_resuming_into_another_model_shape_is_one_line",
    ),
    (
        "a full disk while saving",
        "tests.train.test_checkpoint_integrity",
        "test_a_full_disk_while_saving_keeps_the_earlier_checkpoints",
    ),
    (
        "a second run into a busy output_dir",
        "tests.train.test_run_directory",
        "test_two_concurrent_cli_runs_into_one_directory_one_is_refused_the_other_completes",
    ),
    (
        "an output_dir that is a file",
        "tests.train.test_run_directory",
        "test_an_output_dir_that_is_a_file_is_one_line",
    ),
    (
        "an output_dir that holds a run",
        "tests.train.test_run_directory",
        "test_an_output_dir_that_holds_a_run_is_one_line",
    ),
    (
        "an output_dir that cannot be written",
        "tests.train.test_run_directory",
        "test_an_output_dir_that_cannot_be_written_is_one_line",
    ),
    (
        "resume with options that cannot change",
        "tests.train.test_config_resume",
        "test_several_refused_changes_are_all_named_in_one_error",
    ),
    (
        "a reward that hangs through SIGTERM",
        "tests.train.test_reward_and_update_guards",
        "test_sigterm_while_a_reward_hangs_saves_the_step_before_and_exits",
    ),
]


TABLES = (BAD_INPUTS, BAD_CONFIG_INPUTS, BAD_REWARD_INPUTS, BAD_CLI_INPUTS)


def kind(expected: object) -> str:
    """The class of a table case, from the error it expects (a CLI case expects an exit code)."""
    if isinstance(expected, int):
        return "command line"
    for cls, name in ((ConfigError, "configuration"), (DataError, "data"), (RewardFunctionError, "rewards")):
        if issubclass(expected, cls):
            return name
    return "models, devices and files"


def by_class() -> dict[str, list[str]]:
    """The cases of each class of bad input (the classes of the README's reliability section)."""
    classes: dict[str, list[str]] = {}
    for table in TABLES:
        for case, _, expected, _ in table:
            classes.setdefault(kind(expected), []).append(case)
    classes["checkpoints and run directories"] = [what for what, _, _ in SCENARIOS]
    return classes


def test_every_case_has_a_unique_name():
    names = [case[0] for table in TABLES for case in table] + [s[0] for s in SCENARIOS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_every_scenario_names_a_test_that_exists():
    for what, module, function in SCENARIOS:
        assert callable(getattr(importlib.import_module(module), function, None)), (what, module, function)


def test_the_readme_states_the_count():
    total = sum(map(len, by_class().values()))
    stated = re.search(r"\*\*(\d+) bad inputs\*\*", README.read_text())
    assert stated is not None, "README: the reliability section must state '**N bad inputs**'"
    assert int(stated.group(1)) == total, {name: len(cases) for name, cases in by_class().items()}
