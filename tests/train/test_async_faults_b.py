"""Faults around asynchronous runs (and their synchronous twins) that a probe found:

* a run that fails in its first step leaves only its opening (config.yaml, the starting evaluation):
  the corrected command starts again there, with or without resume=true, while a directory that holds
  a checkpoint or a logged step is refused exactly as before (rundir.only_an_opening);
* a `{url: ...}` reward goes to the rollout worker by pickling: its options travel, its HTTP client,
  lock and token do not (the token is read again from api_key_env's variable);
* the logp_mismatch alert does not read batches that older weights sampled while sampling_correction
  corrects them (the decoupled objective), and never advises a correction that is already on."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import pytest

from grpokit.rewards import RemoteReward, RewardServer, ServeLimits
from grpokit.rewards.scoring import RewardFunctionError
from grpokit.train.alerts import AlertWatch
from grpokit.train.checkpoint import list_checkpoints
from grpokit.train.grpo import train_grpo
from grpokit.train.rundir import EarlierRunError, claim_output_dir, interrupted_line
from tests.helpers import read_alerts, read_metrics, read_steps
from tests.train.helpers import ones_reward, tiny_config

OPENING_SAID = "holds only the opening of a run that finished no step"
TRAINING_BATCH = 16  # the tiny run's 4 prompts x 4 completions (its starting evaluation scores 4)


def fails_in_training(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """Scores the starting evaluation, raises on every training batch: a run that fails in step 1 (in
    the rollout worker, with max_staleness). A RewardFunctionError: its line is the whole account."""
    if len(completions) == TRAINING_BATCH:
        raise RewardFunctionError("the judge is down")
    return ones_reward(prompts, completions)


def fails_from_step_2(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    """ones_reward for the starting evaluation and step 1's batch, then raises (one process only)."""
    fails_from_step_2.batches = getattr(fails_from_step_2, "batches", 0) + (
        len(completions) == TRAINING_BATCH
    )
    if fails_from_step_2.batches >= 2:
        raise RewardFunctionError("the judge is down")
    return ones_reward(prompts, completions)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


# ----------------------------------------------------------------------------- a failed first step


@pytest.mark.slow  # two runs (the async ones with a worker process)
@pytest.mark.parametrize(
    "staleness, resume",
    [(None, False), (1, False), (None, True)],
    ids=["sync", "async", "sync-resume"],
)
def test_a_run_that_failed_in_step_1_is_started_again_by_the_corrected_command(
    tmp_path, caplog, staleness, resume
):
    """The failed run leaves config.yaml and its starting evaluation (step 0) and no checkpoint; the
    corrected command into the same output_dir (no flag, or resume=true) replaces that opening, says so
    in one line and trains: one step-0 row (the failed run's is gone, not mixed in), then its steps."""
    cfg = tiny_config(tmp_path, on_reward_error="raise", max_staleness=staleness, num_threads=1)
    with pytest.raises(Exception, match="RewardFunctionError|the judge is down"):
        train_grpo(cfg, reward_funcs=[fails_in_training])
    out = Path(cfg.output_dir)
    assert [row["step"] for row in read_metrics(out)] == [0] and list_checkpoints(out) == []
    failed_opening = read_metrics(out)[0]["time"]
    caplog.set_level(logging.WARNING, logger="grpokit")
    train_grpo(cfg.model_copy(update={"resume": resume}), reward_funcs=[ones_reward])
    said = [r.getMessage() for r in caplog.records if OPENING_SAID in r.getMessage()]
    assert len(said) == 1 and str(out) in said[0] and "this run replaces it" in said[0], said
    assert ("resume=true has nothing to continue" in said[0]) == resume
    rows = read_metrics(out)
    assert [row["step"] for row in rows].count(0) == 1 and rows[0]["time"] != failed_opening
    assert [row["step"] for row in read_steps(out)] == [1, 2]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]


@pytest.mark.slow  # two runs
def test_a_run_with_a_checkpoint_is_still_refused_and_resumes(tmp_path, capsys):
    """Step 1 saved checkpoint-1, step 2 failed: the command again without a flag is refused as before
    (the directory byte for byte as it was), and resume=true continues from checkpoint-1."""
    fails_from_step_2.batches = 0
    cfg = tiny_config(tmp_path, on_reward_error="raise", save_steps=1, num_threads=1)
    with pytest.raises(RewardFunctionError, match="the judge is down"):
        train_grpo(cfg, reward_funcs=[fails_from_step_2])
    out = Path(cfg.output_dir)
    before = _snapshot(out)
    with pytest.raises(EarlierRunError) as refused:
        train_grpo(cfg, reward_funcs=[ones_reward])
    assert "already holds a run (checkpoint-1, metrics.jsonl" in str(refused.value)
    assert "continue it with resume=true" in str(refused.value)
    assert _snapshot(out) == before and OPENING_SAID not in capsys.readouterr().err
    train_grpo(cfg.model_copy(update={"resume": True}), reward_funcs=[ones_reward])
    assert [row["step"] for row in read_steps(out)] == [1, 2]


def _opening(out: Path) -> None:
    """What a run that failed in step 1 leaves: its config.yaml, the starting evaluation, TensorBoard."""
    from grpokit.config.load import run_config_yaml

    out.mkdir(parents=True)
    (out / "config.yaml").write_text(run_config_yaml("max_steps: 2\n"))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "time": 1.0, "eval/reward": 0.5}) + "\n")
    (out / "tensorboard").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1").write_bytes(b"step 0")


def _append(path: Path, line: str) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(line + "\n")


def _checkpoint(out: Path) -> None:
    (out / "checkpoint-1").mkdir()
    (out / "checkpoint-1" / "state.pt").write_bytes(b"a saved state")


PROTECTED = {  # what, added to an opening, makes the directory a run's (or one that cannot be told)
    "a checkpoint": _checkpoint,
    "a logged step": lambda out: _append(out / "metrics.jsonl", '{"step": 1, "loss": 0.5}'),
    "an alert after step 0": lambda out: _append(out / "alerts.jsonl", '{"step": 2, "name": "kl"}'),
    "a damaged row": lambda out: _append(out / "metrics.jsonl", '{"step": 0, "ti'),
    "a step that is not the whole number 0": lambda out: _append(out / "metrics.jsonl", '{"step": 0.0}'),
    "a final model": lambda out: (out / "final").mkdir(),
    "a reward model's diagnostics": lambda out: (out / "reward_diagnostics.json").write_text("{}"),
}


@pytest.mark.parametrize("what", list(PROTECTED))
@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_an_opening_with_anything_of_a_finished_step_is_refused_as_before(tmp_path, what, resume):
    out = tmp_path / "run"
    _opening(out)
    PROTECTED[what](out)
    before = _snapshot(out)
    if resume and what == "a checkpoint":  # resumed from it, as before: neither refused nor replaced
        assert claim_output_dir(out, resume=True, overwrite=False) is False
    else:
        with pytest.raises(EarlierRunError, match="holds a run"):
            claim_output_dir(out, resume=resume, overwrite=False)
    assert claim_output_dir(out, resume=False, overwrite=True) is True  # overwrite=true still replaces it
    assert _snapshot(out) == before  # (claiming deletes nothing: the caller does, once input is valid)


def test_an_opening_alone_is_replaced_and_a_ctrl_c_there_says_run_it_again(tmp_path, caplog):
    out = tmp_path / "run"
    _opening(out)
    (out / "alerts.jsonl").write_text('{"step": 0, "name": "reward_hacking"}\n')  # step 0's are the opening's
    caplog.set_level(logging.WARNING, logger="grpokit")
    for resume in (None, False, True):  # grpokit sft (no resume), train, train resume=true
        assert claim_output_dir(out, resume=resume, overwrite=False) is True
    assert sum(OPENING_SAID in r.getMessage() for r in caplog.records) == 3
    assert (
        interrupted_line(out) == "interrupted (Ctrl-C) before anything was saved: run the same command again"
    )
    PROTECTED["a logged step"](out)
    assert "start again with" in interrupted_line(out) and "overwrite=true" in interrupted_line(out)


# ----------------------------------------------------------------------------- a {url: ...} reward


TOKEN_ENV, TOKEN = "GRPOKIT_TEST_REWARD_TOKEN", "tok-3f9a1c77e2"


@pytest.fixture
def reward_server():
    """A RewardServer scoring ones_reward on 127.0.0.1 (a free port), requiring the bearer TOKEN."""
    server = RewardServer(
        ones_reward, "127.0.0.1", 0, limits=ServeLimits(), api_key=TOKEN, log=lambda _: None
    )
    server.start()
    yield server
    server.close()


@pytest.mark.loopback
def test_a_remote_reward_pickles_without_its_client_or_token(reward_server, monkeypatch):
    """What the rollout worker receives: the options, not the client or its lock (which do not pickle
    once it has scored) nor the token, read again from api_key_env's variable on unpickling; a variable
    unset there is the same one line as at start."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    remote = RemoteReward(
        reward_server.url + "score", api_key_env=TOKEN_ENV, timeout=7, retries=1, name="ones"
    )
    assert remote(["a", "b"], ["11", "1x"]) == [1.0, 0.5]  # the client and its connections exist now
    packed = pickle.dumps(remote)
    assert TOKEN.encode() not in packed
    again = pickle.loads(packed)
    assert (again.url, again.timeout, again.retries, again.__name__) == (remote.url, 7.0, 1, "ones")
    assert again(["a", "b"], ["11", "1x"]) == [1.0, 0.5]  # sent the token it read: the server requires it
    monkeypatch.setenv(TOKEN_ENV, "another-token")
    with pytest.raises(RewardFunctionError, match="answered HTTP 401"):
        pickle.loads(packed)(["a"], ["1"])  # the token of the environment it is unpickled in
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(
        ValueError, match=f"api_key_env names the environment variable {TOKEN_ENV}, which is unset"
    ):
        pickle.loads(packed)


def _rewards(output_dir: str) -> list[tuple[float, float]]:
    """Each step's logged rewards: the mean and the spread."""
    return [(row["reward"], row["reward_std"]) for row in read_steps(output_dir)]


@pytest.mark.loopback
@pytest.mark.slow  # three runs, two with a worker process
def test_a_url_reward_scores_in_the_rollout_worker_as_in_the_trainer(tmp_path, reward_server, monkeypatch):
    """A {url: ...} entry with max_staleness=1 (refused before: the worker gets rewards by pickling)
    trains, and scores what the same function given directly scores, step by step, exactly; its step 1
    (sampled with the starting weights, as the synchronous run's) earns the synchronous run's rewards."""
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    entry = {"url": reward_server.url + "score", "name": "ones", "api_key_env": TOKEN_ENV, "timeout": 30}
    settings = dict(max_steps=3, num_threads=1)
    sync = tiny_config(tmp_path / "sync", reward_funcs=[entry], **settings)
    train_grpo(sync)
    remote = tiny_config(tmp_path / "remote", reward_funcs=[entry], max_staleness=1, **settings)
    train_grpo(remote)
    direct = tiny_config(tmp_path / "direct", max_staleness=1, **settings)
    train_grpo(direct, reward_funcs=[ones_reward])
    served = _rewards(remote.output_dir)
    assert len(served) == 3 and all(std > 0 for _, std in served)  # scored by the server: spread
    assert served == _rewards(direct.output_dir)
    assert served[0] == _rewards(sync.output_dir)[0]
    assert [row["async/staleness"] for row in read_steps(remote.output_dir)] == [0.0, 1.0, 1.0]


# ----------------------------------------------------------------------------- logp_mismatch


@pytest.mark.slow  # a worker process
def test_a_stale_run_under_the_decoupled_objective_raises_no_logp_mismatch(tmp_path):
    """max_staleness=1 with reward spread, sampling_correction left to its choice (token_truncate): the
    stale batches' log-probs differ from the trainer's by more than the threshold (what the policy
    learned in a step), which the correction is for: no alert."""
    cfg = tiny_config(tmp_path, max_steps=3, max_staleness=1, learning_rate=0.03, num_threads=1)
    train_grpo(cfg, reward_funcs=[ones_reward])
    rows = read_steps(cfg.output_dir)
    assert [row["async/staleness"] for row in rows] == [0.0, 1.0, 1.0]
    assert all("sampling/importance_sampling_ratio/mean" in row for row in rows)  # corrected
    threshold = 0.1  # config/alerts.py's default
    assert rows[0]["sampling/sampling_logp_difference/mean"] < 1e-5  # fresh: the sampler is the forward
    assert max(row["sampling/sampling_logp_difference/mean"] for row in rows[1:]) > threshold
    assert [a["name"] for a in read_alerts(cfg.output_dir) if a["name"] == "logp_mismatch"] == []


MISMATCHED = {"sampling/sampling_logp_difference/mean": 0.3}
CORRECTED = {"sampling/importance_sampling_ratio/mean": 1.01}


@pytest.mark.parametrize(
    "row, says, never",
    [
        ({}, "Correct it with sampling_correction (token_truncate)", None),
        ({"async/staleness": 0.0}, "Correct it with sampling_correction (token_truncate)", None),
        (CORRECTED, "sample and train in the same precision", "Correct it with sampling_correction"),
        (
            CORRECTED | {"async/staleness": 0.0},
            "sampling_correction weighs the difference already",
            "Correct it with sampling_correction",
        ),
        ({"async/staleness": 2.0}, "Set sampling_correction: token_truncate", None),
        (CORRECTED | {"async/staleness": 1.0}, None, None),
    ],
    ids=["sync", "fresh", "sync-corrected", "fresh-corrected", "stale-uncorrected", "stale-corrected"],
)
def test_logp_mismatch_reads_what_the_correction_does_not_explain(row, says, never):
    fired = AlertWatch().update(3, MISMATCHED | row)
    assert [a.name for a in fired] == ([] if says is None else ["logp_mismatch"])
    if says is not None:
        assert fired[0].value == 0.3 and fired[0].threshold == 0.1 and says in fired[0].advice
        assert never is None or never not in fired[0].advice
    assert AlertWatch().update(3, {"sampling/sampling_logp_difference/mean": 0.09} | row) == []  # below
