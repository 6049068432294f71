"""Multi-turn GRPO end to end: tool_addition with its calc tool, your own environment by reference,
exact resume, the config's errors, and reasoning-gym tasks as a data source."""

from __future__ import annotations

import pytest
import torch

from grpokit.config import GRPOConfig
from grpokit.config.schema import BUILTIN_TASKS
from grpokit.data import TASKS, get_task
from grpokit.train.grpo import train_grpo
from tests.helpers import read_metrics, read_steps

from .helpers import tiny_config, weights


def tool_config(tmp_path, **overrides):
    base = dict(task="tool_addition", max_completion_length=None, max_turns=3, sft_steps=0, max_steps=2)
    return tiny_config(tmp_path, **(base | overrides))


def test_tool_addition_trains_with_episode_metrics(tmp_path):
    # T = 80: room for a tool's error message (the task's 40 ends an episode whose call was malformed)
    cfg = tool_config(
        tmp_path, sft_steps=15, sft_batch_size=32, eval_steps=2, num_eval_prompts=8, max_completion_length=80
    )
    result = train_grpo(cfg)
    rows = read_metrics(result.output_dir)
    step = next(r for r in rows if "loss" in r)
    for key in ("env/turns", "env/tool_calls", "env/tool_errors", "env/tool_timeouts", "env/malformed_calls"):
        assert key in step, key
    # 15 warm-start steps taught a tiny policy to open a call ("[" is 1 of 50 characters): some
    # episodes called, well or not (their turns are still long: the answers rarely fit the budget)
    assert step["env/tool_calls"] + step["env/malformed_calls"] > 0
    assert 1.0 <= step["env/turns"] <= 3.0
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals and "eval/turns" in evals[-1]
    assert step["completions/max_length"] <= 80  # the policy's tokens; the transcript fits T


def test_tools_off_trains_the_same_task_single_turn(tmp_path):
    cfg = tool_config(tmp_path, tools=[])
    result = train_grpo(cfg)
    step = read_steps(result.output_dir)[0]
    assert "env/turns" not in step and step["completions/max_length"] <= 7


@pytest.mark.slow
def test_a_stopped_multi_turn_run_resumes_exactly(tmp_path):
    """Episodes are re-created from their rows and seeds: 4 steps straight equal 2 + resumed 2."""
    straight = tool_config(tmp_path / "a", max_steps=4, save_steps=2)
    train_grpo(straight)
    interrupted = tool_config(tmp_path / "b", max_steps=4, save_steps=2)

    def stop_at_3(kind, step, data):
        if kind == "step" and step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_grpo(interrupted, on_event=stop_at_3)
    train_grpo(interrupted.model_copy(update={"resume": True}))
    a, b = weights(tmp_path / "a" / "run"), weights(tmp_path / "b" / "run")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    calls_a = [r["env/tool_calls"] for r in read_steps(tmp_path / "a" / "run")]
    calls_b = [r["env/tool_calls"] for r in read_steps(tmp_path / "b" / "run")]
    assert calls_a == calls_b


ENVIRONMENT = '''
class Guess:
    """Guess the row's digit: each turn is answered "higher"/"lower"; 1.0 for a right guess."""

    stop_strings = ("=",)

    def reset(self, row, seed):
        self.target = row["digit"]
        return ""

    def step(self, text):
        guess = text.strip().rstrip("=")[-1:] or "x"
        if guess == self.target:
            return "", 1.0, True
        return ("+" if guess < self.target else "1") + "=", 0.0, False
'''


def test_your_own_environment_by_reference_with_its_reward(tmp_path):
    (tmp_path / "guess_env.py").write_text(ENVIRONMENT)
    rows = [{"prompt": f"{d}{d}=", "digit": str(d)} for d in range(10)] * 2
    cfg = tiny_config(
        tmp_path,
        task=None,
        environment=f"{tmp_path / 'guess_env.py'}:Guess",
        max_turns=3,
        max_completion_length=12,
        eval_steps=0,
    )
    result = train_grpo(cfg, train_rows=rows, eval_rows=rows[:4])
    step = read_steps(result.output_dir)[0]
    assert "env/reward" in step and 0.0 <= step["env/reward"] <= 1.0
    assert step["reward"] == pytest.approx(step["env/reward"])  # the env reward is the run's reward
    assert 1.0 <= step["env/turns"] <= 3.0


def test_config_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="tools and environment are both set"):
        GRPOConfig(tools=["calc"], environment="env.py:Env")
    with pytest.raises(ValueError, match="not a built-in tool name nor a reference"):
        GRPOConfig(tools=["no such tool"])
    with pytest.raises(ValueError, match="not a built-in tool \\(calc\\)"):
        train_grpo(tool_config(tmp_path, tools=["abacus"]))
    with pytest.raises(ValueError, match="not a task; built-in tasks: addition"):
        GRPOConfig(task="tool_adition")
    assert GRPOConfig(task="reasoning_gym:countdown").task == "reasoning_gym:countdown"
    # a multi-turn warm start learns worked episodes: rows without one are named before any work
    with pytest.raises(ValueError, match="no 'demonstration' column"):
        train_grpo(
            tiny_config(tmp_path / "d", task=None, tools=["calc"], sft_steps=5, max_completion_length=8),
            train_rows=[{"prompt": "1+1=", "answer": "2"}] * 4,
            reward_funcs=[lambda prompts, completions, **_: [0.0] * len(completions)],
        )


def test_the_config_knows_every_built_in_task():
    assert set(BUILTIN_TASKS) == set(TASKS)


def test_tool_addition_demonstrations_are_right_and_the_answer_is_read_after_the_tool():
    task = get_task("tool_addition", num_eval=50)
    row = task.train[0]
    transcript = "".join(text for text, _ in row["demonstration"])
    assert task.is_correct(transcript, row)  # the worked episode earns full reward
    a, b = map(int, row["prompt"][:-1].split("+"))
    assert row["answer"] == str(a + b) and 10000 <= a <= 99999
    assert not task.is_correct("{" + row["answer"] + "}", row)  # the tool's answer alone is not one
    assert task.is_correct(row["answer"], row)  # without tools, the answer itself
    assert not {r["prompt"] for r in task.train} & {r["prompt"] for r in task.eval}


@pytest.fixture
def reasoning_gym():
    """Imported by the tests that use it (~1 s), not when this module is collected."""
    return pytest.importorskip(
        "reasoning_gym", reason="reasoning-gym is a test dependency (scripts/setup.sh test)"
    )


@pytest.mark.parametrize("name", ["chain_sum", "countdown"])
def test_reasoning_gym_tasks_score_with_their_own_scorer(name, reasoning_gym):
    from grpokit.data.reasoning_gym import reasoning_gym_task

    # countdown generates ~100 rows a second: 60 training rows, not the 2000 a run draws
    task = reasoning_gym_task(name, seed=1, num_eval=20, size=60)
    row = task.eval[0]
    assert task.is_correct(row["answer"], row) and task.is_correct(f"<answer>{row['answer']}</answer>", row)
    (wrong,) = task.reward([row["prompt"]], ["zzz"], **{k: [v] for k, v in row.items()})
    assert wrong < 0.1 and not task.is_correct("zzz", row)  # countdown gives 0.01 for any answer
    assert not {r["prompt"] for r in task.train} & {r["prompt"] for r in task.eval}
    assert get_task("reasoning_gym:chain_sum", num_eval=5).name == "reasoning_gym:chain_sum"
    with pytest.raises(ValueError, match="reasoning-gym has no task 'nope'"):
        get_task("reasoning_gym:nope")


@pytest.mark.slow
def test_a_reasoning_gym_task_trains_end_to_end(tmp_path, reasoning_gym):
    cfg = tiny_config(
        tmp_path, task="reasoning_gym:chain_sum", max_completion_length=None, sft_steps=5, eval_steps=2
    )
    result = train_grpo(cfg)
    rows = read_metrics(result.output_dir)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert any("eval/accuracy" in r for r in rows)


SLOW_TOOL = '''
import time


def nap(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return "awake"
'''


def test_the_episode_options_reach_the_environment(tmp_path):
    """tools (built-in and by reference), tool_call_format, tool_timeout and max_turns make the spec
    episodes run in; a task's own format cannot be swapped."""
    from grpokit.config.plan import episode_spec
    from grpokit.train.inputs import resolve_environment

    (tmp_path / "naps.py").write_text(SLOW_TOOL)
    cfg = GRPOConfig(
        task=None,
        dataset="x.jsonl",
        tools=["calc", f"{tmp_path / 'naps.py'}:nap"],
        tool_call_format="brackets",
        tool_timeout=0.1,
        max_turns=2,
    )
    spec = resolve_environment(episode_spec(cfg), None)
    assert spec.max_turns == 2 and spec.stop_strings == ("]",)
    assert [s["function"]["name"] for s in spec.tool_schemas] == ["calc", "nap"]
    env = spec.factory()
    assert env.step("[nap(1)]")[0] == "{error: nap timed out after 0.1s}"
    assert env.step('[calc("2*21")]')[0] == "{42}"
    hermes = resolve_environment(episode_spec(cfg.model_copy(update={"tool_call_format": None})), None)
    assert hermes.stop_strings == ("</tool_call>",)  # the default format
    assert resolve_environment(episode_spec(cfg.model_copy(update={"tools": []})), None) is None
    task = get_task("tool_addition", num_eval=10)
    assert resolve_environment(episode_spec(GRPOConfig(task="tool_addition")), task).stop_strings == ("]",)
    with pytest.raises(ValueError, match="writes its tool calls as brackets"):
        resolve_environment(episode_spec(GRPOConfig(task="tool_addition", tool_call_format="hermes")), task)
    with pytest.raises(ValueError, match="set task: null and dataset"):
        GRPOConfig(environment="env.py:Env")  # the default task is addition


def test_accuracy_on_your_rows_judges_the_final_answer_after_the_tools():
    from grpokit.config.plan import grpo_plan
    from grpokit.train.inputs import UserInputs, resolve_data

    rows = [{"prompt": "2*21=", "answer": "42"}]
    plan = grpo_plan(GRPOConfig(task=None, tools=["calc"], tool_call_format="brackets", model="tiny"))
    given = UserInputs(train_rows=rows, eval_rows=rows, reward_funcs=[lambda p, c, **_: [0.0] * len(c)])
    data = resolve_data(plan.data, plan.episodes, plan.rewards, given)
    assert data.is_correct('[calc("2*21")]{42}42', rows[0]) and not data.is_correct("{42}41", rows[0])
    assert set("[]{}") <= set(data.alphabet)  # the tiny tokenizer can write a call and read its answer


class Countdown:
    """Pays 1.0 when the policy's turn ends with the row's digit, within the turns it is given."""

    stop_strings = ("=",)

    def reset(self, row):
        self.digit = row["digit"]
        return ""

    def step(self, text):
        if text.rstrip("=").endswith(self.digit):
            return "", 1.0, True
        return "0=", 0.0, False


def test_the_python_api_takes_tools_or_an_environment_factory_as_trl_names_them(tmp_path):
    from grpokit import GRPOTrainer
    from grpokit.envs import calc

    rows = [{"prompt": f"{d}+{d}=", "digit": str(d), "answer": str(2 * d)} for d in range(10)]
    small = {k: v for k, v in tiny_config(tmp_path).model_dump().items() if k != "task"}
    small |= {"max_completion_length": 10, "max_turns": 2, "overwrite": True}
    trainer = GRPOTrainer("tiny", [], small, rows, environment_factory=Countdown)
    assert trainer.environment.stop_strings == ("=",) and trainer.environment.max_turns == 2
    step = read_steps(trainer.train().output_dir)[0]
    assert step["reward"] == pytest.approx(step["env/reward"])  # no reward_funcs: the environment's
    trainer = GRPOTrainer("tiny", [], small | {"tool_call_format": "brackets"}, rows, tools=[calc])
    assert trainer.environment.stop_strings == ("]",)
    assert "env/tool_calls" in read_steps(trainer.train().output_dir)[0]
    with pytest.raises(ValueError, match="not both"):
        GRPOTrainer("tiny", [], small, rows, tools=[calc], environment_factory=Countdown)
