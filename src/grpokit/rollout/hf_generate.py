"""The default sampler: transformers' `generate`.

Per-token sampling log-probs are recorded without keeping every step's [B, V] scores: a logits
processor placed after all others (temperature, top-k/p, min-p, repetition penalty) keeps only
the previous step's log-softmax and gathers the token that was drawn from it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..models.device import model_device
from .types import Rollout, SamplingParams

logger = logging.getLogger(__name__)


class _SamplingLogpsRecorder:
    """LogitsProcessor: log π_sample(token_t) for every generated token, O(B·V) memory."""

    def __init__(self, prompt_width: int) -> None:
        self.prompt_width = prompt_width
        self.previous: torch.Tensor | None = None  # [B, V] log-softmax of the last processed scores
        self.logps: list[torch.Tensor] = []  # T × [B]

    def _collect(self, input_ids: torch.Tensor) -> None:
        if self.previous is not None:
            drawn = input_ids[:, -1:]  # [B, 1] the token sampled from `previous`
            self.logps.append(self.previous.gather(-1, drawn).squeeze(-1))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._collect(input_ids)
        self.previous = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        self._collect(sequences)
        return torch.stack(self.logps, dim=1) if self.logps else torch.zeros(sequences.shape[0], 0)


def tokenize_prompts(tokenizer: Any, prompts: list[str], params: SamplingParams) -> tuple[dict, int]:
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    limit = params.max_prompt_length
    too_long = [i for i, ids in enumerate(encoded) if limit is not None and len(ids) > limit]
    if too_long and params.prompt_truncation == "error":
        first = too_long[0]
        raise ValueError(
            f"prompt {first} has {len(encoded[first])} tokens, more than max_prompt_length={limit} "
            f"({len(too_long)} prompts are too long); "
            "raise max_prompt_length or set prompt_truncation='left'."
        )
    if too_long:
        logger.warning(
            "%d prompt(s) longer than max_prompt_length=%d were cut from the left", len(too_long), limit
        )
        encoded = [ids[-limit:] if limit is not None else ids for ids in encoded]
    if any(len(ids) == 0 for ids in encoded):
        raise ValueError("a prompt tokenized to zero tokens; every prompt needs at least one token.")
    from ..models.reward_model import pad_left

    input_ids, attention_mask = pad_left(encoded, tokenizer.pad_token_id)  # [P, Lp] left padding
    return {"input_ids": input_ids, "attention_mask": attention_mask.long()}, len(too_long)


class StopStringEnds:
    """StoppingCriteria: ends a row once its completion contains a stop string, and records where.

    Only the last `window` tokens are decoded each step (a match must involve the newest token,
    or an earlier step would have found it); `window` = the longest stop string in characters,
    since every token decodes to at least one character.
    """

    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...], prompt_width: int, batch: int) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.prompt_width = prompt_width
        self.window = max(len(s) for s in stop_strings)
        self.ends = torch.full(
            (batch,), -1, dtype=torch.long
        )  # [B] exclusive end in the completion, −1 = none

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        width = input_ids.shape[1] - self.prompt_width  # completion tokens so far
        tails = self.tokenizer.batch_decode(
            input_ids[:, -min(self.window, width) :].cpu(), skip_special_tokens=True
        )
        for row, text in enumerate(tails):
            if self.ends[row] < 0 and any(s in text for s in self.stop_strings):
                self.ends[row] = width
        return (self.ends >= 0).to(input_ids.device)


def completion_mask_from_ids(
    completion_ids: torch.Tensor, eos_token_ids: list[int], stop_ends: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and truncation flags of generated ids. [B, T] -> ([B, T] bool, [B] bool)

    A row ends at its first EOS, which counts (True); or where a stop string completed
    (`stop_ends` [B], exclusive, −1 = none), whichever comes first. A row with neither was cut
    by max_completion_length: all its tokens count and it is flagged truncated.
    """
    B, T = completion_ids.shape
    device = completion_ids.device
    positions = torch.arange(T, device=device).expand(B, T)  # [B, T]
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=device))  # [B, T]
    end = torch.where(is_eos, positions + 1, T).amin(-1)  # [B] exclusive; T when no EOS
    if stop_ends is not None:
        stop_ends = stop_ends.to(device)
    stopped = torch.zeros(B, dtype=torch.bool, device=device) if stop_ends is None else stop_ends >= 0  # [B]
    if stop_ends is not None:
        end = torch.where(stopped, torch.minimum(end, stop_ends), end)
    mask = positions < end[:, None]  # [B, T]
    truncated = ~is_eos.any(-1) & ~stopped
    return mask, truncated


def eos_and_pad(model: Any, tokenizer: Any) -> tuple[list[int], int]:
    """Every id that ends a completion (model's generation config and tokenizer), and the pad id."""
    eos = model.generation_config.eos_token_id
    eos_ids = list(eos) if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    if None in eos_ids or not eos_ids:
        raise ValueError("the model and tokenizer define no EOS token; completions could never end.")
    return eos_ids, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]


def build_rollout(
    tokenizer: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    sampling_logps: torch.Tensor,
    eos_token_ids: list[int],
    pad_token_id: int,
    stop_ends: torch.Tensor | None,
    num_generations: int,
    num_truncated_prompts: int,
) -> Rollout:
    """A Rollout from what a sampler drew (all on CPU): masks, flags and texts derived in one place."""
    mask, truncated = completion_mask_from_ids(completion_ids, eos_token_ids, stop_ends)
    return Rollout(
        prompt_ids=prompt_ids,  # [B, Lp]
        prompt_mask=prompt_mask.bool(),  # [B, Lp]
        completion_ids=completion_ids,  # [B, T]
        completion_mask=mask,
        truncated=truncated,
        sampling_logps=torch.where(mask, sampling_logps, torch.zeros_like(sampling_logps)),
        completions=tokenizer.batch_decode(
            torch.where(mask, completion_ids, pad_token_id), skip_special_tokens=True
        ),
        num_generations=num_generations,
        num_truncated_prompts=num_truncated_prompts,
    )


class HFGenerateSampler:
    """`Sampler` backed by transformers' `model.generate`."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids, self.pad_token_id = eos_and_pad(model, tokenizer)
        self.sync_finished: Any = None  # set under sharded training: generate then runs synced_gpus

    def _generation_kwargs(
        self, params: SamplingParams, recorder: _SamplingLogpsRecorder, stops: StopStringEnds | None
    ) -> dict[str, Any]:
        from transformers import (
            LogitsProcessorList,
            MinPLogitsWarper,
            RepetitionPenaltyLogitsProcessor,
            StoppingCriteriaList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        # The whole chain is ours, in a fixed order, so that the recorder (last) sees exactly the
        # distribution tokens are drawn from; generate's own warpers are left neutral.
        chain: list[Any] = []
        if params.repetition_penalty != 1.0:
            chain.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        greedy = params.temperature == 0.0
        if not greedy:
            if params.temperature != 1.0:
                chain.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                chain.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                chain.append(TopPLogitsWarper(params.top_p))
            if params.min_p:
                chain.append(MinPLogitsWarper(params.min_p))
        chain.append(recorder)
        kwargs: dict[str, Any] = dict(
            max_new_tokens=params.max_completion_length,
            do_sample=not greedy,
            temperature=None if greedy else 1.0,
            top_p=None if greedy else 1.0,
            top_k=None if greedy else 0,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_ids,
            logits_processor=LogitsProcessorList(chain),
            return_dict_in_generate=True,
            synced_gpus=self.sync_finished is not None,
        )
        if stops is not None:
            kwargs["stopping_criteria"] = StoppingCriteriaList([stops])
        return kwargs

    @torch.no_grad()
    def sample(self, prompts: list[str], params: SamplingParams) -> Rollout:
        if not prompts:
            raise ValueError("no prompts to sample from: the prompt batch is empty.")
        batch, num_truncated = tokenize_prompts(self.tokenizer, prompts, params)
        device = model_device(self.model)  # inputs go to the model; the Rollout comes back on the host
        G = params.num_generations
        # the one place prompts are repeated: rows p·G … p·G+G−1 are prompt p's completions
        input_ids = batch["input_ids"].repeat_interleave(G, dim=0).to(device)  # [B, Lp]
        attention_mask = batch["attention_mask"].repeat_interleave(G, dim=0).to(device)  # [B, Lp]
        recorder = _SamplingLogpsRecorder(input_ids.shape[1])
        stops = None
        if params.stop_strings:
            stops = StopStringEnds(
                self.tokenizer, params.stop_strings, input_ids.shape[1], input_ids.shape[0]
            )
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                out = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    **self._generation_kwargs(params, recorder, stops),
                )
        finally:
            self.model.train(was_training)
        sequences = out.sequences.cpu()  # [B, Lp + T]
        completion_ids = sequences[:, input_ids.shape[1] :]  # [B, T]
        sampling_logps = recorder.finish(sequences).cpu()  # [B, T]
        return build_rollout(
            self.tokenizer,
            input_ids.cpu(),
            attention_mask.cpu(),
            completion_ids,
            sampling_logps,
            self.eos_token_ids,
            self.pad_token_id,
            None if stops is None else stops.ends,
            G,
            num_truncated,
        )
