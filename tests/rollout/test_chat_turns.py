"""Multi-turn episodes of chat models (issue 25, point 3): with conversational prompts, each observation
joins the transcript as a message of its role through the model's own chat template, after the policy's
end-of-turn token, and the next turn opens with the assistant's generation prompt; token in, token out,
and the loss mask exactly the policy's tokens at every boundary. Checked on the test cache's BPE Qwen2
(ChatML) and Llama (header template), by decoding the tokens on either side of every boundary."""

from __future__ import annotations

import pytest
import torch

from grpokit.config import GRPOConfig
from grpokit.data import DataError
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


def _trl_template(name: str) -> str:
    """A model family's real chat template, as TRL ships it (trl is the test suite's reference)."""
    import importlib.resources

    return (importlib.resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text()


# the families' own templates: Qwen renders a tool result as a user turn inside <tool_response>,
# Qwen3 without thinking opens the next turn with an empty think block, Llama 3.1 names the role
# ipython and quotes the content as JSON (by hand, from the templates)
QWEN_TOOL = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
LLAMA_TOOL = '<|start_header_id|>ipython<|end_header_id|>\n\n"42"<|eot_id|>'
REAL = [
    ("qwen2_5", QWEN, {}, QWEN_TOOL),
    ("qwen3", QWEN, {}, QWEN_TOOL),
    ("qwen3", QWEN, {"enable_thinking": False}, QWEN_TOOL + "<think>\n\n</think>\n\n"),
    ("llama3_1", LLAMA, {}, LLAMA_TOOL + "<|start_header_id|>assistant<|end_header_id|>\n\n"),
]


@pytest.mark.parametrize(("template", "repo", "kwargs", "wrapped"), REAL)
def test_the_real_families_templates_continue_episodes_as_they_were_trained(
    hub_offline, template, repo, kwargs, wrapped
):
    tok = load_policy(repo).tokenizer
    tok.chat_template = _trl_template(template)
    assert ChatTurns.of(tok, "tool", kwargs).observation_text("42") == wrapped


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
    tok.chat_template = _trl_template("qwen2_5")  # renders no message of a role it does not know
    with pytest.raises(ChatTemplateError, match="leaves out a 'ipython' message's content"):
        ChatTurns.of(tok, "ipython")


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
    """Every boundary, decoded: a policy turn (trained) ends with one of the model's EOS ids (the
    tokenizer's, or another of its generation config's) or the stop string; the tokens after it up to
    the next trained token are [the end-of-turn token if the stop string ended it] + the template's
    message of what the environment said + the generation prompt, tokenised alone (untrained); the
    messages and the completion text (the last turn) are what was written and said."""
    loaded = load_policy(repo)
    model, tok = loaded.model, loaded.tokenizer
    eos_ids, _ = eos_and_pad(model, tok)
    assert len(eos_ids) == 2  # the tokenizer's EOS and another of the generation config's
    for eos in eos_ids:
        _eos_likely(model, eos, scale=4.0)
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
    boundaries = by_stop = by_other_eos = 0
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
            said = str(len(messages[k - 1]["content"]))  # (what Echo answers)
            expected = turns.observation_ids(said, turn_ended=ended)
            assert ids[t:end] == expected[: end - t]  # ...then exactly the template's tokens, untrained
            if end - t < len(expected):  # cut by the budget: the episode ended, no message for it
                assert end == n and k == len(messages)
                break
            assert messages[k] == {"role": "tool", "content": said}
            if end < n:  # the next turn opens after the whole generation prompt
                assert end - t == len(expected)
                assert tok.decode(ids[t:end]).endswith(
                    WRAPPED[repo].rpartition("42")[2].split("<|eot_id|>")[-1]
                )
            boundaries += 1
            by_stop += not ended
            by_other_eos += ended and turn[-1] != tok.eos_token_id
            k += 1
            t = end
        assert r.completions[b] == [m for m in messages if m["role"] == "assistant"][-1]["content"]
    assert boundaries >= 4 and by_stop >= 1 and by_other_eos >= 1  # every kind of boundary is exercised


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


def test_a_tool_turn_reads_as_trls_assistant_message_with_tool_calls():
    """What conversational reward functions get for a turn: its call parsed into tool_calls (JSON or
    Python call syntax, arguments bound to the tool's parameters), the text around it as content;
    a turn without a call, a malformed one or one to an unknown tool is its text."""
    read = tool_environment([calc], "hermes").for_chat().turn_message
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expression": "3+4"}}}
    json_call = '<tool_call>{"name": "calc", "arguments": {"expression": "3+4"}}</tool_call>'
    assert read(json_call) == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert read('Let me add. <tool_call>calc("3+4")</tool_call>') == {
        "role": "assistant", "content": "Let me add.", "tool_calls": [call],
    }  # fmt: skip
    for text in (
        "7",
        "<tool_call>calc(</tool_call>",
        '<tool_call>nope("3")</tool_call>',
        "<tool_call>calc()",
    ):
        assert read(text) == {"role": "assistant", "content": text}, text


class Inline(Echo):
    observation_role = None  # observations stay plain text inside the assistant's turn


def test_an_environment_class_names_its_observations_role():
    """`observation_role` on the class, as the CLI's `environment:` and GRPOTrainer's environment_factory
    take it: "tool" as given, None kept as plain text with chat prompts, "user" without the attribute."""
    from grpokit.config.plan import EpisodeSpec
    from grpokit.train.inputs import resolve_environment
    from grpokit.trainer import _environment

    ref = "tests.rollout.test_chat_turns:{}"
    for name, role in (("Echo", "tool"), ("Inline", None), ("Quiet", "user")):
        spec = resolve_environment(EpisodeSpec(environment=ref.format(name)), None)
        assert spec.observation_role == role
        assert spec.for_chat().chat is (role is not None)
        assert _environment(GRPOConfig(), None, globals()[name]).observation_role == role


class Quiet:
    def reset(self, row):
        return ""

    def step(self, text):
        return "", 0.0, True


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


@pytest.mark.parametrize("repo", [QWEN, LLAMA])
def test_a_demonstration_opened_by_the_environment_keeps_that_text_plain(hub_offline, repo):
    """A first segment of the environment's is reset's text, which a rollout writes as it is after the
    generation prompt; two environment segments in a row cannot follow a chat model's turns."""
    tok = load_policy(repo).tokenizer
    environment = tool_environment([calc], "hermes").for_chat()
    row = {"prompt": [{"role": "user", "content": "Guess"}], "demonstration": [["Go: ", False], ["5", True]]}
    (laid,) = sft_rows([row], tok, environment=environment)
    assert laid["segments"] == [("Go: ", False), ("5", True)]
    row["demonstration"] = [["5", True], ["no", False], ["higher", False], ["7", True]]
    with pytest.raises(DataError, match="two environment segments in a row \\('no', 'higher'\\)"):
        sft_rows([row], tok, environment=environment)


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


def test_a_template_that_cannot_continue_episodes_stops_the_run_before_any_work(hub_offline, tmp_path):
    """Refused with the run's other input checks, before the output directory is prepared."""
    from grpokit.train.grpo import train_grpo

    loaded = load_policy(QWEN)
    loaded.tokenizer.chat_template = _trl_template("qwen2_5")  # renders no "ipython" message
    rows = [{"prompt": [{"role": "user", "content": f"{a}+1?"}], "answer": str(a + 1)} for a in range(8)]
    cfg = GRPOConfig(
        output_dir=str(tmp_path / "run"), task=None, prompts_per_step=2, num_generations=2, max_steps=1,
        max_completion_length=8, progress=False, sft_steps=0, reward_funcs=["exact_answer"],
    )  # fmt: skip
    environment = EnvironmentSpec(Quiet, observation_role="ipython")
    with pytest.raises(ChatTemplateError, match="leaves out a 'ipython' message"):
        train_grpo(
            cfg, model=loaded.model, tokenizer=loaded.tokenizer, train_rows=rows, environment=environment
        )
    assert not (tmp_path / "run" / "config.yaml").exists()
