"""A KV-cached decode loop: the fast `Sampler` backend.

Against transformers' `generate` it saves the per-token machinery (processor lists, stopping
criteria, generation-config copies) and shares work across the G completions of a prompt:

* each prompt is prefilled once and its KV cache repeated G times (prefix sharing);
* tokens are drawn by inverse CDF on the cumulative sum of the probabilities, one uniform number
  per row, instead of `torch.multinomial`;
* top-k / top-p / min-p / repetition penalty are applied in HF's order, and the log-probability of
  each drawn token under exactly that distribution is recorded;
* the loop stops as soon as every row has finished.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.nn.functional as F

from ..models import LeanLlamaDecoder, lm_head_of, model_device
from .hf_generate import StopStringEnds, build_rollout, eos_and_pad, tokenize_prompts
from .processing import draw, process_logits
from .static_decode import DrawParams, StaticDecoder, supports_static_decode
from .types import Rollout, SamplingParams

# Decoded tokens between checks whether every row has finished, on a GPU (see `KVCacheSampler.sample`).
FINISH_CHECK_EVERY = 8


class KVCacheSampler:
    """`Sampler` with its own KV-cached decode loop (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids, self.pad_token_id = eos_and_pad(model, tokenizer)
        # decides whether to stop once this process's rows are done; sharded training replaces it
        # with a collective so every rank runs the same number of forward passes
        self.sync_finished: Callable[[bool], bool] = lambda done: done
        # the gradient-free mode of the decode loop: inference mode (cheaper per operation), which
        # sharded training replaces with no_grad (FSDP must not make its unsharded parameters there)
        self.grad_free: Callable[[], Any] = torch.inference_mode
        self.finish_check_every: int | None = None  # tokens between "all finished?" reads; None: by device
        self._dropout: bool | None = None  # `has_dropout`, once known
        # "eager" (the loop below), or a static-shape step: "static", "compiled", "cuda_graph"
        # (`static_decode.StaticDecoder`); set from the `decode_loop` option (`resolve_decode_loop`)
        self.decode_loop = "eager"
        self._static: StaticDecoder | None = None

    def has_dropout(self) -> bool:
        """Whether the model holds an active dropout module (peft's LoRA dropout, say). Checked once
        per sampler: the modules are fixed once training starts."""
        if self._dropout is None:
            self._dropout = any(
                isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0  # noqa: SLF001
                for m in self.model.modules()
            )
        return self._dropout

    def _forward(
        self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> Any:
        return self.model(
            input_ids=ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # only the last position is sampled from: no [P, Lp, V] prefill logits
        )

    def _hf_steps(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, positions: torch.Tensor, G: int
    ) -> Generator[torch.Tensor, torch.Tensor, None]:
        """Yields next-token logits [B, V]; is sent each drawn token [B]. transformers' forward."""
        out = self._forward(prompt_ids, prompt_mask, positions, None)  # prefill once per prompt
        cache = out.past_key_values
        cache.batch_repeat_interleave(G)  # the one place prompts are repeated: [P] -> [B = P·G]
        attention = prompt_mask.repeat_interleave(G, dim=0)  # [B, Lp]
        position = positions[:, -1:].repeat_interleave(G, dim=0)  # [B, 1]
        token = yield out.logits[:, -1].repeat_interleave(G, dim=0)  # [B, V]
        while True:
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)  # [B, Lp+t+1]
            position = position + 1
            token = yield self._forward(token[:, None], attention, position, cache).logits[:, -1]

    def _lean_steps(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        positions: torch.Tensor,
        G: int,
        max_new: int,
    ) -> Generator[torch.Tensor, torch.Tensor, None] | None:
        """As `_hf_steps`, through the lean Llama forward and a preallocated KV cache (in place, O(1)
        per token and layer); None when the model is not one the lean forward covers."""
        head = lm_head_of(self.model)
        if head is None or not isinstance(head.decoder, LeanLlamaDecoder):
            return None
        decoder: LeanLlamaDecoder = head.decoder

        def steps() -> Generator[torch.Tensor, torch.Tensor, None]:
            P, Lp = prompt_ids.shape
            cache = decoder.new_cache(P, Lp + max_new, head.weight)
            hidden = decoder(prompt_ids, key_mask=prompt_mask.bool(), position_ids=positions, cache=cache)
            cache = cache.repeat_rows(G)  # the one place prompts are repeated: [P] -> [B = P·G]
            key_mask = torch.ones(P * G, Lp + max_new, dtype=torch.bool, device=prompt_ids.device)
            key_mask[:, :Lp] = prompt_mask.bool().repeat_interleave(G, dim=0)  # [B, Lp + max_new]
            position = positions[:, -1:].repeat_interleave(G, dim=0)  # [B, 1]
            last = hidden.last_hidden_state[:, -1].repeat_interleave(G, dim=0)  # [B, H]
            while True:
                token = yield F.linear(last, head.weight, head.bias)  # [B, V]
                position = position + 1
                S = cache.length + 1
                out = decoder(token[:, None], key_mask=key_mask[:, :S], position_ids=position, cache=cache)
                last = out.last_hidden_state[:, -1]  # [B, H]

        return steps()

    def _static_decoder(self, params: SamplingParams) -> StaticDecoder | None:
        """The static-shape loop, when chosen and the model and parameters allow it: the lean Llama
        with plain linear layers, no stop strings (matched on decoded text, outside any graph)."""
        if self.decode_loop == "eager" or params.stop_strings:
            return None
        head = lm_head_of(self.model)
        if head is None or not isinstance(head.decoder, LeanLlamaDecoder):
            return None
        if not supports_static_decode(head.decoder, head.weight) or self.has_dropout():
            return None
        static = self._static
        same = static is not None and static.decoder is head.decoder and static.head.weight is head.weight
        if not same or static.mode != self.decode_loop or static.head.bias is not head.bias:
            static = self._static = StaticDecoder(head.decoder, head, self.decode_loop)
        return static

    def _sample_static(
        self,
        static: StaticDecoder,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        positions: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator | None,
        check_every: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and log-probs [B, t] from the static-shape loop. Its KV capacity is fixed by
        max_prompt_length when set, else rounded up to a multiple of 64 (few distinct shapes)."""
        T, Lp = params.max_completion_length, prompt_ids.shape[1]
        longest = params.max_prompt_length or -(-Lp // 64) * 64
        draw = DrawParams(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty,
            pad_token_id=self.pad_token_id,
            eos_token_ids=tuple(self.eos_token_ids),
        )
        with self.grad_free():
            tokens, logps = static.run(
                prompt_ids, prompt_mask, positions, params.num_generations, T, draw, generator,
                check_every, self.sync_finished, capacity=longest + T - 1,
            )  # fmt: skip
        with torch.no_grad():
            return tokens.clone(), logps.clone()  # ordinary tensors, outside inference mode

    @torch.no_grad()
    def sample(self, prompts: list[str], params: SamplingParams) -> Rollout:
        if not prompts:
            raise ValueError("no prompts to sample from: the prompt batch is empty.")
        batch, num_truncated = tokenize_prompts(self.tokenizer, prompts, params)
        device = model_device(self.model)  # inputs go to the model; the Rollout comes back on the host
        G = params.num_generations
        prompt_ids = batch["input_ids"].to(device)  # [P, Lp]
        prompt_mask = batch["attention_mask"].to(device)  # [P, Lp]
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # [P, Lp] left padding aware
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        T = params.max_completion_length
        # whether every row has finished is read every token on a CPU (nothing to wait for), every
        # FINISH_CHECK_EVERY tokens on a GPU, where each read stalls the queue of kernels; rows that
        # finished meanwhile only add padding, which the completion mask excludes
        check_every = self.finish_check_every or (1 if device.type == "cpu" else FINISH_CHECK_EVERY)
        static = self._static_decoder(params)
        if static is not None:
            tokens, logps = self._sample_static(
                static, prompt_ids, prompt_mask, positions, params, generator, check_every
            )
            return build_rollout(
                self.tokenizer,
                prompt_ids.repeat_interleave(G, dim=0).cpu(),
                prompt_mask.repeat_interleave(G, dim=0).cpu(),
                tokens.cpu(),
                logps.cpu(),
                self.eos_token_ids,
                self.pad_token_id,
                None,
                G,
                num_truncated,
            )
        lean = self._lean_steps(prompt_ids, prompt_mask, positions, G, T)  # generators: not started yet
        # else transformers' forward and DynamicCache
        step_logits = lean or self._hf_steps(prompt_ids, prompt_mask, positions, G)
        # eval mode for dropout; the lean forward of a model without dropout does not depend on the
        # mode, and switching costs two walks over every module (0.2 ms a call on a small model)
        was_training = self.model.training
        switch = was_training and (lean is None or self.has_dropout())
        if switch:
            self.model.eval()
        # by default inference mode: no version counters or view tracking in the loop (measurably
        # cheaper per operation); what leaves it is rebuilt below as ordinary tensors
        with self.grad_free():
            try:
                logits = next(step_logits)  # [B, V] after the prompt
                ids_so_far = prompt_ids.repeat_interleave(G, dim=0)  # [B, Lp (+t)]
                B = ids_so_far.shape[0]
                stops = (
                    StopStringEnds(self.tokenizer, params.stop_strings, prompt_ids.shape[1], B)
                    if params.stop_strings
                    else None
                )
                eos = torch.tensor(self.eos_token_ids, device=device)
                finished = torch.zeros(B, dtype=torch.bool, device=device)
                tokens, logps = [], []
                for step in range(params.max_completion_length):
                    logprobs = process_logits(
                        logits, ids_so_far if params.repetition_penalty != 1.0 else None, params
                    )
                    token = draw(logprobs, params.temperature == 0.0, generator)  # [B]
                    token = torch.where(finished, torch.full_like(token, self.pad_token_id), token)
                    logps.append(torch.where(finished, 0.0, logprobs.gather(-1, token[:, None]).squeeze(-1)))
                    tokens.append(token)
                    ids_so_far = torch.cat([ids_so_far, token[:, None]], dim=1)
                    finished = finished | torch.isin(token, eos)
                    if stops is not None:
                        finished = finished | stops(ids_so_far, None)
                    checked = (step + 1) % check_every == 0  # (reading `finished` waits for the GPU)
                    if (checked and self.sync_finished(bool(finished.all()))) or step + 1 == T:
                        break
                    logits = step_logits.send(token)  # [B, V]
            finally:
                step_logits.close()  # ends the decode loop now, not when it is collected
                if switch:
                    self.model.train(was_training)
        return build_rollout(
            self.tokenizer,
            prompt_ids.repeat_interleave(G, dim=0).cpu(),
            prompt_mask.repeat_interleave(G, dim=0).cpu(),
            torch.stack(tokens, dim=1).cpu(),
            torch.stack(logps, dim=1).cpu(),
            self.eos_token_ids,
            self.pad_token_id,
            None if stops is None else stops.ends,
            G,
            num_truncated,
        )
