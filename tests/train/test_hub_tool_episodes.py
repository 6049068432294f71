"""A multi-turn tool run on real-shaped chat models, end to end and offline (issue 25): a model by hub id
from the test-made cache (byte-level BPE, ChatML for the Qwen2, the header template for the Llama), chat
prompts, the `calc` tool, a warm start on whole episodes, GRPO, held-out evaluation with the tool, and
resume, through the Python API (TRL's GRPOTrainer call with `tools=`) and the CLI. The trained model's
episodes are then read back token by token: each call ends with the model's own end-of-turn token, the
tool's result comes back as the template's tool message, and the answer follows the generation prompt."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from grpokit.envs import calc, evaluate_expression, tool_environment
from grpokit.models import backend_of, load_policy
from grpokit.rollout import Decoder, SamplingParams
from grpokit.train.checkpoint import list_checkpoints
from tests.helpers import read_metrics, read_steps
from tests.hub_cache import LLAMA, QWEN, grpokit_offline

CALL = '<tool_call>{"name": "calc", "arguments": {"expression": "%s"}}</tool_call>'


def episodes(n: int, seed: int) -> list[dict]:
    """Two-digit sums as chat prompts, with worked episodes: the call, the tool's result, the answer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                "answer": str(a + b),
                "demonstration": [[CALL % f"{a}+{b}", True], [str(a + b), False], [str(a + b), True]],
            }
        )
    return rows


# a warm start of 200 steps teaches the tiny models the call (seen: 0.9-1.0 calls an episode after it)
SETTINGS = dict(
    max_turns=3, max_completion_length=96, prompts_per_step=4, num_generations=4, micro_batch_size=16,
    sft_steps=200, sft_batch_size=32, sft_learning_rate=1e-2, learning_rate=1e-3, num_eval_prompts=8,
    save_steps=2, log_completions_steps=0, progress=False, device="cpu", dtype="float32",
)  # fmt: skip

# what a chat model's episode is, in its own template's words: call, EOS, tool message, answer
EPISODE = {
    QWEN: re.compile(
        r"(?s)<tool_call>(?P<call>.*?)</tool_call><\|im_end\|>\n<\|im_start\|>tool\n(?P<result>.*?)<\|im_end\|>"
        r"\n<\|im_start\|>assistant\n(?P<answer>.*)"
    ),
    LLAMA: re.compile(
        r"(?s)<tool_call>(?P<call>.*?)</tool_call><\|eot_id\|><\|start_header_id\|>tool<\|end_header_id\|>\n\n"
        r"(?P<result>.*?)<\|eot_id\|><\|start_header_id\|>assistant<\|end_header_id\|>\n\n(?P<answer>.*)"
    ),
}


def called_a_tool(completions, **_):
    """A reward written for TRL's tool episodes: each completion is its messages; 1 if a turn called."""
    return [float(any(m.get("tool_calls") for m in messages)) for messages in completions]


def _episodes_read_back(checkpoint: Path, repo: str, rows: list[dict]) -> int:
    """Greedy episodes of the trained model, decoded with their special tokens: every one that called
    matches the template's layout, and the tool message holds calc's own result of that call."""
    loaded = load_policy(str(checkpoint))
    spec = tool_environment([calc], "hermes", max_turns=3).for_chat()
    decoder = Decoder(backend_of(loaded.model), loaded.tokenizer, environment=spec)
    prompts = [
        loaded.tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
        for r in rows
    ]
    r = decoder.sample(
        prompts, SamplingParams(num_generations=1, max_completion_length=96, temperature=0.0), rows
    )
    called = 0
    for b in range(len(rows)):
        n = int(r.attention[b].sum())
        transcript = loaded.tokenizer.decode(r.completion_ids[b, :n].tolist(), skip_special_tokens=False)
        if "</tool_call>" not in transcript or r.num_turns[b] < 2:
            continue
        match = EPISODE[repo].match(transcript)
        assert match is not None, transcript
        body = json.loads(match["call"])
        value = evaluate_expression(body["arguments"]["expression"])
        assert value is not None and match["result"] == str(value[0]), transcript
        call = {"type": "function", "function": {"name": "calc", "arguments": body["arguments"]}}
        assert r.messages[b][0] == {"role": "assistant", "content": "", "tool_calls": [call]}  # TRL's form
        assert r.messages[b][1] == {"role": "tool", "name": "calc", "content": match["result"]}
        assert r.completions[b] == r.messages[b][-1]["content"]  # the completion is the answer turn
        called += 1
    return called


@pytest.mark.slow
@pytest.mark.parametrize("repo", [QWEN, LLAMA])
def test_a_tool_run_through_the_python_api_on_a_hub_chat_model(hub_offline, tmp_path, repo):
    """TRL's call with tools=[calc]: the warm start teaches the call, GRPO steps run whole episodes
    (turns > 1, calls counted), evaluation runs episodes, and the trained model's episodes read back
    as its template lays them out."""
    from grpokit import GRPOConfig, GRPOTrainer

    out = tmp_path / "run"
    trainer = GRPOTrainer(
        model=repo,
        reward_funcs=["exact_answer", called_a_tool],
        args=GRPOConfig(output_dir=str(out), max_steps=2, eval_steps=2, seed=1, **SETTINGS),
        train_dataset=episodes(200, seed=0),
        eval_dataset=episodes(8, seed=1),
        tools=[calc],
    )
    trainer.train()
    steps = read_steps(out)
    assert [r["step"] for r in steps] == [1, 2]
    calls = sum(r["env/tool_calls"] for r in steps) / len(steps)
    assert calls >= 0.5 and all(r["env/turns"] > 1.0 for r in steps), steps
    # the TRL-style reward saw the calls in its messages: episodes with a call, at most the calls counted
    for r in steps:
        assert 0.5 <= r["rewards/called_a_tool/mean"] <= r["env/tool_calls"] + 1e-6, r
    evals = [r for r in read_metrics(out) if "eval/turns" in r]
    assert evals and evals[-1]["eval/turns"] > 1.0 and "eval/accuracy" in evals[-1]
    assert _episodes_read_back(list_checkpoints(out)[-1], repo, episodes(8, seed=2)) >= 4


@pytest.mark.slow
def test_a_tool_run_through_the_cli_on_a_hub_chat_model_resumes(hub_home, tmp_path):
    """`grpokit train model=ORG/NAME dataset=FILE tools=[calc] ...`, stopped after 2 steps and resumed
    to 3: the episodes' metrics on every step, and the resumed run continues the same one."""
    data, held_out, out = tmp_path / "train.jsonl", tmp_path / "test.jsonl", tmp_path / "run"
    data.write_text("".join(json.dumps(r) + "\n" for r in episodes(200, seed=0)))
    held_out.write_text("".join(json.dumps(r) + "\n" for r in episodes(8, seed=1)))
    common = [
        f"model={QWEN}", "task=null", f"dataset={data}", f"eval_dataset={held_out}", "tools=[calc]",
        "reward_funcs=[exact_answer]", f"output_dir={out}", "seed=1", "eval_steps=0",
        *(f"{k}={v}" for k, v in SETTINGS.items()),
    ]  # fmt: skip
    first = grpokit_offline(hub_home, "train", *common, "max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = grpokit_offline(hub_home, "train", *common, "max_steps=3", "resume=true")
    assert second.returncode == 0, second.stderr[-3000:]
    steps = read_steps(out)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert sum(r["env/tool_calls"] for r in steps) / 3 >= 0.5 and all(r["env/turns"] > 1.0 for r in steps)
