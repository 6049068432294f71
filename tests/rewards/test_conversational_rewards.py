"""TRL's reward contract for conversational data (issue 25): with prompts that are conversations,
reward functions get the rows' own messages as `prompts` and each completion as
[{"role": "assistant", "content": text}], so a TRL reward function written as
`completion[0]["content"]` works unchanged; grpokit's own functions (built-ins, reward models) read
text; a reward model renders the conversation through its own chat template, exactly as its
conversational training pairs were."""

from __future__ import annotations

import torch

from grpokit.rewards import BUILTIN_REWARDS, score_completions

CHAT = [[{"role": "system", "content": "Answer after ####."}, {"role": "user", "content": "2+2?"}]] * 2
TEXTS = ["so #### 4", "#### 5"]


def test_a_trl_reward_gets_messages_and_assistant_turns():
    seen = {}

    def trl_style(prompts, completions, answer, **_):
        seen["prompts"], seen["completions"] = prompts, completions
        return [float(c[0]["content"].endswith(a)) for c, a in zip(completions, answer, strict=True)]

    scores = score_completions(
        [trl_style, BUILTIN_REWARDS["gsm8k_answer"]], CHAT, TEXTS, columns={"answer": ["4", "4"]}
    )
    assert seen["prompts"] == CHAT
    assert seen["completions"] == [[{"role": "assistant", "content": t}] for t in TEXTS]
    assert scores.rewards_per_func.tolist() == [[1.0, 1.0], [0.0, 0.0]]  # the built-in read the text


def test_text_prompts_keep_text_completions():
    seen = {}

    def plain(prompts, completions, **_):
        seen["completions"] = completions
        return [1.0] * len(completions)

    score_completions([plain], ["2+2?", "2+2?"], TEXTS)
    assert seen["completions"] == TEXTS


def test_a_reward_model_scores_a_conversation_as_it_was_trained_on_it(hub_offline):
    from transformers import AutoTokenizer

    from grpokit.data.preferences import pair_token_ids
    from grpokit.rewards.reward_model import RewardModelFunction
    from tests.hub_cache import QWEN

    tokenizer = AutoTokenizer.from_pretrained(QWEN)
    reward = RewardModelFunction(
        model=torch.nn.Linear(1, 1), tokenizer=tokenizer
    )  # only its encoding is used
    turn = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    trained, _ = pair_token_ids(
        tokenizer, {"prompt": CHAT[0], "chosen": turn("#### 4"), "rejected": turn("no")}
    )
    assert reward._ids(CHAT[0], "#### 4") == trained  # noqa: SLF001 - the encoding is the contract here
    assert reward._ids("2+2?", " 4") == tokenizer("2+2? 4", add_special_tokens=False)["input_ids"] + [  # noqa: SLF001
        tokenizer.eos_token_id
    ]


def test_a_built_in_task_reward_reads_text_under_a_system_prompt():
    """`task=addition system_prompt=...` makes the prompts conversations; the task's own reward still
    reads each completion as text."""
    from grpokit.data.tasks import addition

    task = addition(num_eval=2)
    row = task.train[0]
    chat = [[{"role": "system", "content": "Add."}, {"role": "user", "content": row["prompt"]}]] * 2
    columns = {k: [row[k]] * 2 for k in row if k != "prompt"}
    right = str(row["answer"]) if "answer" in row else None
    scores = score_completions([task.reward], chat, [right, "x"], columns=columns)
    assert scores.rewards_per_func.tolist() == [[1.0], [0.0]]


def test_the_correctness_reward_reads_text_with_conversational_prompts():
    """Evaluation without a reward of its own scores with `correctness_reward(is_correct)`: is_correct
    takes the completion's text, also when the prompts are conversations (TRL would pass messages)."""
    from grpokit.rewards import score_completions
    from grpokit.train.inputs import correctness_reward

    right = correctness_reward(lambda completion, row: completion.strip() == row["answer"])
    prompts = [[{"role": "user", "content": "3+4?"}]] * 2
    scores = score_completions([right], prompts, [" 7", "8"], columns={"answer": ["7", "7"]})
    assert scores.rewards.tolist() == [1.0, 0.0]
