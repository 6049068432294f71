"""How a chat model's episode continues after a policy turn: the environment's observation as a
message of its own role (a tool's result as "tool", another environment's words as "user") through
the model's chat template, then the assistant's generation prompt, as the model saw conversations in
its training:

    ...<tool_call>{"name": "calc", ...}</tool_call><|im_end|>       the policy's turn, ended by EOS
    \\n<|im_start|>tool\\n7<|im_end|>\\n<|im_start|>assistant\\n          the observation's tokens (untrained)
    7<|im_end|>                                                     the policy's next turn

The observation's tokens are the template's rendering of that message, cut after the end-of-turn
token of the assistant's message before it: the text the template adds between the policy's EOS and
the next assistant turn, tokenised on its own and appended (the transcript is never re-tokenised).
A turn the policy ended otherwise (a stop string) gets the end-of-turn token from the environment.
The template is checked once, when `ChatTurns.of` is made: one that does not end an assistant message
with the tokenizer's EOS token, or renders a conversation differently when a message is added, is
refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the conversation an observation follows when its wrapper is cut: what comes before changes nothing
_BEFORE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]
_MARK = "\u2063grpokit-observation\u2063"  # stands for the content while the wrapper's start is found


class ChatTemplateError(ValueError):
    """The chat template cannot continue an episode (see the module docstring)."""


@dataclass(frozen=True)
class ChatTurns:
    """The chat template's continuation of an episode after each policy turn (module docstring)."""

    tokenizer: Any
    role: str  # the role of an observation's message
    end_of_turn: int  # the token id that closes an assistant message (the tokenizer's EOS)
    template_kwargs: dict[str, Any]
    head: str  # the rendering up to and including the assistant message's EOS, before any observation

    @classmethod
    def of(cls, tokenizer: Any, role: str, template_kwargs: dict[str, Any] | None = None) -> ChatTurns:
        """Checked against the template: an observation renders as the module docstring describes."""
        eos = getattr(tokenizer, "eos_token", None)
        if getattr(tokenizer, "chat_template", None) is None or not eos:
            raise ChatTemplateError(
                "multi-turn episodes with conversational prompts go through the chat template, and this "
                "tokenizer has no chat template or no EOS token"
            )
        kwargs = dict(template_kwargs or {})
        marked = _render(tokenizer, role, _MARK, kwargs)
        where = marked.find(_MARK)
        if where < 0:
            raise ChatTemplateError(
                f"the chat template leaves out a {role!r} message's content (it does not know the role); "
                "set the environment's observation_role to a role it renders, or None for plain-text "
                "observations"
            )
        cut = marked.rfind(eos, 0, where)
        if cut < 0:
            raise ChatTemplateError(
                f"the chat template does not close an assistant message with the EOS token {eos!r} "
                f"before a {role!r} message; multi-turn episodes need it (give the environment "
                "observation_role = None to append its observations as plain text)"
            )
        turns = cls(tokenizer, role, tokenizer.convert_tokens_to_ids(eos), kwargs, marked[: cut + len(eos)])
        turns.observation_text("probe")  # the head does not depend on the content
        return turns

    def observation_text(self, content: str) -> str:
        """What the template writes after an assistant turn's EOS for an observation `content`: the
        observation's message, then the assistant's generation prompt."""
        rendered = _render(self.tokenizer, self.role, content, self.template_kwargs)
        if not rendered.startswith(self.head):
            raise ChatTemplateError(
                f"the chat template renders the assistant's message differently when a {self.role!r} "
                "message follows it; multi-turn episodes cannot continue it (give the environment "
                "observation_role = None to append its observations as plain text)"
            )
        return rendered[len(self.head) :]

    def observation_ids(self, content: str, turn_ended: bool) -> list[int]:
        """The tokens appended after a policy turn: its end-of-turn token unless the turn wrote it
        (`turn_ended`), then the observation's message and the generation prompt, tokenised alone."""
        ids = self.tokenizer(self.observation_text(content), add_special_tokens=False)["input_ids"]
        return ids if turn_ended else [self.end_of_turn, *ids]


def _render(tokenizer: Any, role: str, content: str, kwargs: dict[str, Any]) -> str:
    messages = [*_BEFORE, {"role": role, "content": content}]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    except Exception as error:  # noqa: BLE001 - a template's own refusal (raise_exception) is a config error
        raise ChatTemplateError(
            f"the chat template refuses a {role!r} message after the assistant's ({error}); set the "
            "environment's observation_role to a role it takes, or None for plain-text observations"
        ) from None
