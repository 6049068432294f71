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

README = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"  # (the README's section moved here)

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
        "tests.config.test_config_resume",
        "test_several_refused_changes_are_all_named_in_one_error",
    ),
    (
        "resume=true where no checkpoint can be resumed (state.pt and manifest.json gone)",
        "tests.train.test_nothing_lost",
        "test_resume_where_no_checkpoint_can_be_resumed_is_refused_and_touches_nothing",
    ),
    (
        "a checkpoint (or a folder inside one) given as output_dir",
        "tests.train.test_nothing_lost",
        "test_a_checkpoint_given_as_output_dir_is_refused_and_the_run_resumes_from_it",
    ),
    (
        "a saved model given as output_dir",
        "tests.train.test_nothing_lost",
        "test_a_saved_model_given_as_output_dir_is_refused",
    ),
    (
        "output_dir=. beside the user's own config.yaml",
        "tests.train.test_nothing_lost",
        "test_a_users_config_yaml_in_output_dir_is_never_replaced",
    ),
    (
        "overwrite=true beside the user's checkpoint-best/ and report notes",
        "tests.train.test_nothing_lost",
        "test_overwrite_deletes_only_what_grpokit_wrote",
    ),
    (
        "a second Ctrl-C while a checkpoint is written",
        "tests.train.test_nothing_lost",
        "test_a_second_ctrl_c_while_a_checkpoint_is_written_is_one_line_and_resume_continues",
    ),
    (
        "resume: a curriculum pool value of 7, a data position of 10^12, a state.pt step of 1e9",
        "tests.train.test_nothing_lost",
        "test_every_field_of_state_pt_with_a_value_no_run_writes_is_one_line",
    ),
    (
        "resume: any field of state.pt of the wrong type, shape or range",
        "tests.train.test_nothing_lost",
        "test_a_resume_refuses_each_edited_field_in_one_line_and_leaves_the_run_unchanged",
    ),
    (
        "resume: any field of metrics.jsonl, alerts.jsonl, manifest.json or config.yaml of the wrong kind",
        "tests.train.test_nothing_lost",
        "test_every_field_of_the_other_files_a_resume_reads_edited_is_one_line_and_changes_nothing",
    ),
    (
        "resume: a non-UTF-8 byte in metrics.jsonl or alerts.jsonl, an alert with a string step",
        "tests.train.test_nothing_lost",
        "test_a_damaged_metrics_or_alerts_line_stops_a_resume_in_one_line_before_anything_changes",
    ),
    (
        "a reward that hangs through SIGTERM",
        "tests.train.test_reward_and_update_guards",
        "test_sigterm_while_a_reward_hangs_saves_the_step_before_and_exits",
    ),
    (
        "serve-reward: --host 0.0.0.0 (served to anyone, no warning)",
        "tests.rewards.test_serve_reward_hardening",
        "test_the_cli_warns_about_a_non_loopback_host_and_takes_the_key_from_the_environment",
    ),
    (
        "serve-reward: a request without the API key",
        "tests.rewards.test_serve_reward_hardening",
        "test_with_an_api_key_every_request_needs_the_bearer_token",
    ),
    (
        "serve-reward: a Content-Length of 1e11",
        "tests.rewards.test_serve_reward_hardening",
        "test_a_content_length_of_1e11_is_413_answered_at_once_without_reading",
    ),
    (
        "serve-reward: a chunked body over --max-body-mb",
        "tests.rewards.test_serve_reward_hardening",
        "test_a_chunked_body_over_the_limit_is_413",
    ),
    (
        "serve-reward: a non-ASCII Content-Length",
        "tests.rewards.test_serve_reward_hardening",
        "test_a_malformed_content_length_is_a_json_400",
    ),
    (
        "serve-reward: a body nested 100,000 deep",
        "tests.rewards.test_serve_reward_hardening",
        "test_a_body_nested_100000_deep_is_400",
    ),
    (
        "serve-reward: clients leaving mid-body",
        "tests.rewards.test_serve_reward_hardening",
        "test_clients_leaving_mid_body_are_one_quiet_line_each_and_the_server_answers_on",
    ),
    (
        "serve-reward: a client that sends headers and no body",
        "tests.rewards.test_serve_reward_hardening",
        "test_a_client_that_sends_headers_and_no_body_gets_408_within_the_bound",
    ),
    (
        "serve-reward: idle and trickling connections",
        "tests.rewards.test_serve_reward_hardening",
        "test_idle_and_trickling_clients_are_closed_within_the_bound",
    ),
    (
        "serve-reward: more connections than --max-connections",
        "tests.rewards.test_serve_reward_hardening",
        "test_connections_past_max_connections_are_503",
    ),
    (
        "serve-reward: a reward of 10**5000 (or inf, or text)",
        "tests.rewards.test_serve_reward_hardening",
        "test_a_reward_that_is_not_a_finite_float_is_a_500_and_the_function_runs_once",
    ),
    (
        "serve-reward: an error outside the function",
        "tests.rewards.test_serve_reward_hardening",
        "test_an_error_outside_the_function_is_a_500_json_line_not_a_traceback",
    ),
    (
        "serve-reward: a URL as the function to serve",
        "tests.rewards.test_serve_reward_hardening",
        "test_a_url_given_as_the_function_is_refused_in_one_line",
    ),
    (
        "remote reward: a password in the url (written nowhere, printed nowhere)",
        "tests.rewards.test_remote_bounds",
        "test_a_password_in_the_url_is_written_and_printed_nowhere",
    ),
    (
        "remote reward: an answer past 16 MiB (a gzip bomb, an endless stream)",
        "tests.rewards.test_remote_bounds",
        "test_an_answer_past_16_mib_is_one_line_and_not_tried_again",
    ),
    (
        "remote reward: a server answering a byte at a time past the timeout",
        "tests.rewards.test_remote_bounds",
        "test_a_server_answering_a_byte_at_a_time_is_cut_off_at_the_timeout",
    ),
    (
        "remote reward: proxy variables set, the server at 0.0.0.0, [::ffff:127.0.0.1] or LOCALHOST",
        "tests.rewards.test_remote_bounds",
        "test_a_local_server_is_reached_directly_whatever_the_proxy",
    ),
    (
        "remote reward: an https server whose certificate is not trusted",
        "tests.rewards.test_remote_bounds",
        "test_https_with_its_own_certificate_fails_at_once_without_ca_bundle_and_scores_with_it",
    ),
    (
        "remote reward: api_key_env unset or empty, ca_bundle missing or not PEM",
        "tests.rewards.test_remote_bounds",
        "test_api_key_env_and_ca_bundle_are_checked_when_the_config_loads",
    ),
    (
        "report: a metrics row that is not an object",
        "tests.test_run_files",
        "test_report_a_metrics_row_that_is_not_an_object",
    ),
    (
        "report: a metrics row without a step",
        "tests.test_run_files",
        "test_report_a_metrics_row_without_a_step",
    ),
    (
        "report: a metrics step that is not a whole number (HTML in it)",
        "tests.test_run_files",
        "test_report_a_step_that_is_not_a_whole_number",
    ),
    (
        "report: a metric value that is not a number",
        "tests.test_run_files",
        "test_report_a_metric_value_that_is_not_a_number",
    ),
    (
        "report: a metrics line that is not UTF-8",
        "tests.test_run_files",
        "test_report_a_metrics_line_that_is_not_utf8",
    ),
    (
        "report: a metrics line nested 100,000 deep",
        "tests.test_run_files",
        "test_report_a_metrics_line_nested_past_the_recursion_limit",
    ),
    (
        "report: a metrics line with an integer of 5,000 digits",
        "tests.test_run_files",
        "test_report_a_metrics_line_with_an_integer_of_thousands_of_digits",
    ),
    (
        "report: metric values of ±1e308",
        "tests.test_run_files",
        "test_report_metric_values_too_large_to_plot",
    ),
    (
        "report: an alert without a name",
        "tests.test_run_files",
        "test_report_an_alert_without_a_name",
    ),
    (
        "report: an alert value that is not a number",
        "tests.test_run_files",
        "test_report_an_alert_value_that_is_not_a_number",
    ),
    (
        "report: an alert name matplotlib reads as math ($\\foo$)",
        "tests.test_run_files",
        "test_report_an_alert_name_matplotlib_would_read_as_math",
    ),
    (
        "report: a warm-start row without its step",
        "tests.test_run_files",
        "test_report_a_warm_start_row_without_its_step",
    ),
    (
        "report: reward_diagnostics.json that is a list",
        "tests.test_run_files",
        "test_report_reward_diagnostics_that_are_a_list",
    ),
    (
        "report: reward_diagnostics.json with a field of the wrong type",
        "tests.test_run_files",
        "test_report_reward_diagnostics_with_a_field_of_the_wrong_type",
    ),
    (
        "report: reward_diagnostics.json with HTML as its step",
        "tests.test_run_files",
        "test_report_reward_diagnostics_with_a_step_that_is_html",
    ),
    (
        "report: reward_diagnostics.json that is not UTF-8",
        "tests.test_run_files",
        "test_report_reward_diagnostics_that_are_not_utf8",
    ),
    (
        "report: a config.yaml that is not UTF-8",
        "tests.test_run_files",
        "test_report_a_config_that_is_not_utf8",
    ),
    (
        "rewards: a reward, tool or environment module that calls sys.exit at import",
        "tests.test_bad_inputs_models_data",
        "test_a_module_that_exits_at_import_is_one_line",
    ),
    (
        "data: a chat template that rejects the messages",
        "tests.test_bad_inputs_models_data",
        "test_a_chat_template_that_rejects_the_messages_is_one_line",
    ),
    (
        "models: a policy or teacher whose embedding has fewer rows than its tokenizer has ids",
        "tests.test_bad_inputs_models_data",
        "test_a_model_whose_embedding_misses_token_ids_is_one_line",
    ),
    (
        "data: a dataset directory with a loading script",
        "tests.test_bad_inputs_models_data",
        "test_a_dataset_directory_with_a_loading_script_is_one_line",
    ),
    (
        "models: an older LoRA checkpoint whose adapter_model.bin names code",
        "tests.test_bad_inputs_models_data",
        "test_a_pickled_lora_adapter_that_names_code_runs_nothing_and_is_one_line",
    ),
    (
        "models: num_generations or max_completion_length far beyond the memory",
        "tests.test_bad_inputs_models_data",
        "test_num_generations_beyond_memory_is_refused_before_the_run_directory_and_the_fix_runs",
    ),
    (
        "rewards: two reward functions of one name",
        "tests.test_bad_inputs_models_data",
        "test_two_reward_functions_of_one_name_keep_their_own_metrics",
    ),
    (
        "rewards: a reward function that edits its arguments in place",
        "tests.test_bad_inputs_models_data",
        "test_a_reward_that_edits_its_arguments_in_place_changes_nothing_the_next_one_sees",
    ),
    (
        "async: a crafted batch in flight in state.pt (a payload that runs code), manifest matched",
        "tests.train.test_async_untrusted",
        "test_a_crafted_batch_in_flight_runs_no_code_on_resume",
    ),
    (
        "async: a batch in flight that is garbage bytes",
        "tests.train.test_async_untrusted",
        "test_a_damaged_batch_in_flight_is_one_line_and_nothing_changes",
    ),
    (
        "async: a batch in flight that is a string",
        "tests.train.test_async_untrusted",
        "test_a_damaged_batch_in_flight_is_one_line_and_nothing_changes",
    ),
    (
        "async: a batch in flight that is an empty list",
        "tests.train.test_async_untrusted",
        "test_a_damaged_batch_in_flight_is_one_line_and_nothing_changes",
    ),
    (
        "async: a batch in flight that is a wrong step",
        "tests.train.test_async_untrusted",
        "test_a_damaged_batch_in_flight_is_one_line_and_nothing_changes",
    ),
    (
        "async: a batch in flight that is a wrong weight version",
        "tests.train.test_async_untrusted",
        "test_a_damaged_batch_in_flight_is_one_line_and_nothing_changes",
    ),
    (
        "async: a batch in flight that is ids past the vocabulary or negative",
        "tests.train.test_async_untrusted",
        "test_a_damaged_batch_in_flight_is_one_line_and_nothing_changes",
    ),
    (
        "async: a batch in flight that is a mask of another dtype",
        "tests.train.test_async_untrusted",
        "test_a_damaged_batch_in_flight_is_one_line_and_nothing_changes",
    ),
    (
        "async: a batch in flight that is fewer rows than the run's",
        "tests.train.test_async_untrusted",
        "test_a_damaged_batch_in_flight_is_one_line_and_nothing_changes",
    ),
    (
        "async: a batch in flight that is a sampler position past the data",
        "tests.train.test_async_untrusted",
        "test_a_damaged_batch_in_flight_is_one_line_and_nothing_changes",
    ),
    (
        "async: a worker failing outside its scoring thread (said at its real step)",
        "tests.train.test_async_untrusted",
        "test_a_worker_failing_outside_its_scoring_thread_names_its_step",
    ),
    (
        "async: Ctrl-C while a rollout worker starts",
        "tests.train.test_async_faults",
        "test_a_ctrl_c_while_a_worker_starts_is_held_not_a_traceback",
    ),
    (
        "async: a full disk while publishing weights",
        "tests.train.test_async_faults",
        "test_a_full_disk_while_publishing_weights_names_the_file_and_the_free_space",
    ),
    (
        "async: output_dir/.rollout that is a symbolic link",
        "tests.train.test_async_faults",
        "test_a_rollout_directory_grpokit_did_not_make_is_refused_and_left_alone",
    ),
    (
        "async: output_dir/.rollout that is a file",
        "tests.train.test_async_faults",
        "test_a_rollout_directory_grpokit_did_not_make_is_refused_and_left_alone",
    ),
    (
        "async: output_dir/.rollout that is holding a user's file",
        "tests.train.test_async_faults",
        "test_a_rollout_directory_grpokit_did_not_make_is_refused_and_left_alone",
    ),
    (
        "async: the trainer killed with SIGKILL while a reward hangs in the worker",
        "tests.train.test_async_faults",
        "test_no_worker_outlives_a_trainer_killed_while_a_reward_hangs",
    ),
    (
        "async: a run that failed in its first step, then the corrected command",
        "tests.train.test_async_faults_b",
        "test_a_run_that_failed_in_step_1_is_started_again_by_the_corrected_command",
    ),
    (
        "async: a {url: ...} reward with max_staleness",
        "tests.train.test_async_faults_b",
        "test_a_url_reward_scores_in_the_rollout_worker_as_in_the_trainer",
    ),
    (
        "async: a stale batch under the decoupled objective (no false logp_mismatch)",
        "tests.train.test_async_faults_b",
        "test_a_stale_run_under_the_decoupled_objective_raises_no_logp_mismatch",
    ),
    (
        "policy servers: a rollout server restarted behind its URL",
        "tests.serve.test_server_answers_checked",
        "test_a_server_restarted_behind_its_url_is_sent_the_weights_again",
    ),
    (
        "policy servers: a restarted server whose weights file is gone",
        "tests.serve.test_server_answers_checked",
        "test_a_restarted_server_whose_weights_file_is_gone_ends_the_run_naming_both_versions",
    ),
    (
        "policy servers: two runs sharing one rollout server",
        "tests.serve.test_server_answers_checked",
        "test_two_runs_sharing_a_server_are_told_apart_even_at_the_same_version",
    ),
    (
        "policy servers: a server restarted with another tokenizer",
        "tests.serve.test_server_answers_checked",
        "test_a_server_restarted_with_another_tokenizer_is_refused_on_its_next_answer",
    ),
    (
        "policy servers: the /v1 URL serve-policy prints, in rollout_server_urls",
        "tests.serve.test_server_answers_checked",
        "test_the_v1_url_serve_policy_prints_is_the_server",
    ),
    (
        "policy servers: an answer with token ids past the vocabulary",
        "tests.serve.test_server_answers_checked",
        "test_an_edited_answer_is_refused_in_one_line_naming_the_server_the_row_and_the_fault",
    ),
    (
        "policy servers: an answer with negative token ids",
        "tests.serve.test_server_answers_checked",
        "test_an_edited_answer_is_refused_in_one_line_naming_the_server_the_row_and_the_fault",
    ),
    (
        "policy servers: an answer with float token ids",
        "tests.serve.test_server_answers_checked",
        "test_an_edited_answer_is_refused_in_one_line_naming_the_server_the_row_and_the_fault",
    ),
    (
        "policy servers: an answer with log-probs of another length",
        "tests.serve.test_server_answers_checked",
        "test_an_edited_answer_is_refused_in_one_line_naming_the_server_the_row_and_the_fault",
    ),
    (
        "policy servers: an answer with positive log-probs",
        "tests.serve.test_server_answers_checked",
        "test_an_edited_answer_is_refused_in_one_line_naming_the_server_the_row_and_the_fault",
    ),
    (
        "policy servers: an answer with NaN log-probs",
        "tests.serve.test_server_answers_checked",
        "test_an_edited_answer_is_refused_in_one_line_naming_the_server_the_row_and_the_fault",
    ),
    (
        "policy servers: an answer with a completion longer than max_tokens",
        "tests.serve.test_server_answers_checked",
        "test_an_edited_answer_is_refused_in_one_line_naming_the_server_the_row_and_the_fault",
    ),
    (
        "policy servers: an answer with text that the ids do not decode to",
        "tests.serve.test_server_answers_checked",
        "test_an_edited_answer_is_refused_in_one_line_naming_the_server_the_row_and_the_fault",
    ),
    (
        "policy servers: /update_weights with a tensor of another shape (nothing changed)",
        "tests.serve.test_server_answers_checked",
        "test_a_refused_update_changes_no_weight",
    ),
    (
        "policy servers: /update_weights with an extra or a missing tensor (nothing changed)",
        "tests.serve.test_server_answers_checked",
        "test_a_refused_update_changes_no_weight",
    ),
    (
        "policy servers: /update_weights with int8 weights (nothing changed)",
        "tests.serve.test_server_answers_checked",
        "test_a_refused_update_changes_no_weight",
    ),
    (
        "policy servers: /update_weights with a NaN weight (nothing changed)",
        "tests.serve.test_server_answers_checked",
        "test_a_refused_update_changes_no_weight",
    ),
    (
        "policy servers: a text prompt far past the model's context",
        "tests.serve.test_server_answers_checked",
        "test_a_text_prompt_too_long_for_the_model_is_refused_before_it_is_tokenized",
    ),
    (
        "policy servers: chat content as a list of parts",
        "tests.serve.test_server_answers_checked",
        "test_chat_content_as_a_list_of_text_parts_is_its_texts_joined",
    ),
    (
        "policy servers: echo, suffix or best_of",
        "tests.serve.test_server_answers_checked",
        "test_openai_options_it_does_not_implement_are_refused_not_ignored",
    ),
    (
        "policy servers: eval or report --server with the server down",
        "tests.serve.test_server_commands",
        "test_a_server_that_is_down_is_one_line_and_exit_code_2",
    ),
    (
        "policy servers: eval or report --server on a server of another tokenizer",
        "tests.serve.test_server_commands",
        "test_a_server_with_another_tokenizer_is_one_line_and_exit_code_2",
    ),
    (
        "policy servers: eval --server with the /v1 URL",
        "tests.serve.test_server_commands",
        "test_eval_takes_the_v1_url_serve_policy_prints",
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


# a scenario's class, by how its description starts (else: checkpoints and run directories)
SCENARIO_CLASSES = {
    "serve-reward:": "servers and remote rewards",
    "policy servers:": "policy servers",
    "async:": "asynchronous runs",
    "remote reward:": "servers and remote rewards",
    "report:": "report",
    "rewards:": "rewards",
    "data:": "data",
    "models:": "models, devices and files",
}


def scenario_class(what: str) -> str:
    return next(
        (name for prefix, name in SCENARIO_CLASSES.items() if what.startswith(prefix)),
        "checkpoints and run directories",
    )


def by_class() -> dict[str, list[str]]:
    """The cases of each class of bad input (the classes of the README's reliability section)."""
    classes: dict[str, list[str]] = {}
    for table in TABLES:
        for case, _, expected, _ in table:
            classes.setdefault(kind(expected), []).append(case)
    for what, _, _ in SCENARIOS:
        classes.setdefault(scenario_class(what), []).append(what)
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
    assert stated is not None, "docs/reliability.md must state '**N bad inputs**'"
    assert int(stated.group(1)) == total, {name: len(cases) for name, cases in by_class().items()}
