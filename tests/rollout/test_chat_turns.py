"""Multi-turn episodes of chat models (issue 25, point 3): with conversational prompts, each observation
joins the transcript as a message of its role through the model's own chat template, after the policy's
end-of-turn token, and the next turn opens with the assistant's generation prompt; token in, token out,
and the loss mask exactly the policy's tokens at every boundary. Checked on the test cache's BPE Qwen2
(ChatML) and Llama (header template), by decoding the tokens on either side of every boundary."""

from __future__ import annotations

import pytest
import torch

from grpokit.data.custom import sft_rows
from grpokit.envs import ChatTemplateError, ChatTurns, EnvironmentSpec, calc, tool_environment
from grpokit.models import backend_of, load_policy
from grpokit.rewards import score_completions
from grpokit.rollout import Decoder, SamplingParams
from grpokit.rollout.decode import eos_and_pad
from grpokit.train.sft import sft_batch
from tests.hub_cache import LLAMA, QWEN

# what each template writes between the assistant's EOS and the next assistant turn, by hand
WRAPPED = {
    QWEN: "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n",
    LLAMA: "<|start_header_id|>tool<|end_header_id|>\n\n42<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


@pytest.mark.parametrize("repo", [QWEN, LLAMA])
def test_an_observation_is_the_templates_message_and_generation_prompt(hub_offline, repo):
    tok = load_policy(repo).tokenizer
    turns = ChatTurns.of(tok, "tool")
    assert turns.observation_text("42") == WRAPPED[repo]
    assert turns.end_of_turn == tok.eos_token_id
    ids = tok(WRAPPED[repo], add_special_tokens=False)["input_ids"]
    assert turns.observation_ids("42", turn_ended=True) == ids
    assert turns.observation_ids("42", turn_ended=False) == [tok.eos_token_id, *ids]  # the env closes it


def test_templates_that_cannot_continue_an_episode_are_one_line(hub_offline):
    tok = load_policy(QWEN).tokenizer
    refusing = tok.chat_template.replace(
        "{%- for message in messages %}",
        "{%- for message in messages %}"
        "{% if message['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}",
    )
    tok.chat_template = refusing
    with pytest.raises(ChatTemplateError, match="refuses a 'tool' message.*observation_role"):
        ChatTurns.of(tok, "tool")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"  # no EOS
    with pytest.raises(ChatTemplateError, match="does not close an assistant message with the EOS"):
        ChatTurns.of(tok, "user")


class Echo:
    """Answers every turn with the number of characters it wrote; done after 3 turns. A turn also ends
    at "9", a stop string, so some turns end without EOS."""

    stop_strings = ("9",)
    observation_role = "tool"

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, row):
        return ""

    def step(self, text):
        self.turn += 1
        return str(len(text)), float(len(text) % 2), self.turn == 3


def _eos_likely(model, eos: int, scale: float = 5.0) -> None:
    with torch.no_grad():
        model.get_output_embeddings().weight[eos] *= scale


@pytest.mark.parametrize("repo", [QWEN, LLAMA])
def test_episodes_continue_through_the_template_with_exact_masks(hub_offline, repo):
    """Every boundary, decoded: a policy turn (trained) ends with EOS or the stop string; the tokens
    after it up to the next trained token are [EOS if the stop string ended it] + the template's
    message of what the environment said + the generation prompt, tokenised alone (untrained); the
    messages and the completion text (the last turn) are what was written and said."""
    loaded = load_policy(repo)
    model, tok = loaded.model, loaded.tokenizer
    _eos_likely(model, tok.eos_token_id)
    eos_ids, _ = eos_and_pad(model, tok)
    spec = EnvironmentSpec(
        Echo, max_turns=3, stop_strings=Echo.stop_strings, observation_role="tool"
    ).for_chat()
    turns = ChatTurns.of(tok, "tool")
    decoder = Decoder(backend_of(model), tok, environment=spec)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 7 * 8?"}], tokenize=False, add_generation_prompt=True
    )
    r = decoder.sample(
        [prompt, prompt], SamplingParams(num_generations=4, max_completion_length=80, seed=3), [{}, {}]
    )
    assert r.messages is not None and len(r.messages) == 8
    boundaries = by_stop = 0
    for b in range(8):
        n = int(r.attention[b].sum())
        ids, mask = r.completion_ids[b, :n].tolist(), r.completion_mask[b, :n].tolist()
        messages = r.messages[b]
        t, k = 0, 0  # token, message
        while t < n:
            start = t
            while t < n and mask[t]:
                t += 1
            turn = ids[start:t]
            assert messages[k]["role"] == "assistant"
            assert messages[k]["content"] == tok.decode(turn, skip_special_tokens=True)
            k += 1
            if t == n:
                break
            end = t
            while end < n and not mask[end]:
                end += 1
            ended = turn[-1] in eos_ids
            assert ended or "9" in tok.decode(turn)  # a turn ends at EOS or its stop string...
            said = messages[k]
            assert said["role"] == "tool" and said["content"] == str(len(messages[k - 1]["content"]))
            expected = turns.observation_ids(said["content"], turn_ended=turn[-1] == tok.eos_token_id)
            assert ids[t:end] == expected[: end - t]  # ...then exactly the template's tokens, untrained
            if end < n:  # the next turn opens after the whole generation prompt
                assert end - t == len(expected)
                assert tok.decode(ids[t:end]).endswith(
                    WRAPPED[repo].rpartition("42")[2].split("<|eot_id|>")[-1]
                )
            boundaries += 1
            by_stop += not ended
            k += 1
            t = end
        assert r.completions[b] == [m for m in messages if m["role"] == "assistant"][-1]["content"]
    assert boundaries >= 4 and by_stop >= 1  # both kinds of boundary are exercised


def test_tools_with_conversational_prompts_end_turns_at_eos_and_answer_bare():
    spec = tool_environment([calc], "hermes")
    chat = spec.for_chat({"enable_thinking": False})
    assert (spec.stop_strings, spec.answer_after, spec.chat) == (("</tool_call>",), "</tool_response>", False)
    assert (chat.stop_strings, chat.answer_after, chat.chat) == ((), None, True)
    assert chat.observation_role == "tool" and chat.chat_template_kwargs == {"enable_thinking": False}
    assert chat.final_answer("  7 ") == "7"  # the completion text is already the last turn
    env = chat.factory()
    assert env.step('<tool_call>{"name": "calc", "arguments": {"expression": "3+4"}}</tool_call>') == (
        "7",
        None,
        False,
    )
    assert spec.factory().step('<tool_call>calc("3+4")</tool_call>')[0] == "<tool_response>7</tool_response>"
    inline = EnvironmentSpec(Echo, observation_role=None)
    assert inline.for_chat() is inline  # plain-text observations: unchanged


@pytest.mark.parametrize("repo", [QWEN, LLAMA])
def test_the_warm_start_lays_a_demonstration_out_as_a_rollout_does(hub_offline, repo):
    """A demonstration [[call, policy], [result, env], [answer, policy]]: the call and its EOS, the
    answer and its EOS are learned; between them the template's tool message, as a rollout writes it."""
    tok = load_policy(repo).tokenizer
    turns = ChatTurns.of(tok, "tool")
    environment = tool_environment([calc], "hermes").for_chat()
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "3+4"}}</tool_call>'
    row = {
        "prompt": [{"role": "user", "content": "3+4?"}],
        "demonstration": [[call, True], ["7", False], ["7", True]],
    }
    (laid,) = sft_rows([row], tok, environment=environment)
    batch = sft_batch(tok, [laid])
    ids, learn = batch["input_ids"][0].tolist(), batch["target_mask"][0].tolist()
    prompt = tok(laid["prompt"], add_special_tokens=False)["input_ids"]
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tok.eos_token_id
    expected = prompt + enc(call) + [eos] + turns.observation_ids("7", turn_ended=True) + enc("7") + [eos]
    assert ids == expected
    policy = [False] * len(prompt) + [True] * (len(enc(call)) + 1)
    policy += [False] * len(turns.observation_ids("7", True)) + [True] * (len(enc("7")) + 1)
    assert learn == policy


def test_conversational_rewards_get_the_episodes_messages():
    seen = {}

    def reward(prompts, completions, **_):
        seen["completions"] = completions
        return [float(len(c)) for c in completions]

    messages = [
        [{"role": "assistant", "content": "<tool_call>..</tool_call>"}, {"role": "tool", "content": "7"},
         {"role": "assistant", "content": "7"}],
        [{"role": "assistant", "content": "8"}],
    ]  # fmt: skip
    prompts = [[{"role": "user", "content": "3+4?"}]] * 2
    text = []

    def text_reward(prompts, completions, **_):
        text.extend(completions)
        return [0.0] * len(completions)

    text_reward.takes_text = True
    scores = score_completions([reward, text_reward], prompts, messages, weights=[1.0, 0.0])
    assert seen["completions"] == messages
    assert text == ["7", "8"]  # a function reading text reads each episode's last turn
    assert scores.rewards.tolist() == [3.0, 1.0]
