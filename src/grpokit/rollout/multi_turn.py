"""Multi-turn rollouts: G episodes per prompt, the policy and an environment taking turns.

Each of the B = P·G rows is one episode with its own environment (`envs.EnvironmentSpec`). The
policy writes a turn (until EOS, one of the environment's stop strings, or the token budget); the
environment answers; its observation's tokens are appended to the transcript, and so on for up to
`max_turns` policy turns. The completion of a row is the whole transcript after the prompt:

    completion_ids        [B, T]  policy and environment tokens, right-padded
    completion_mask       [B, T]  True on the policy's tokens only: what the loss trains
    completion_attention  [B, T]  True on every real token: what a forward attends to
    sampling_logps        [B, T]  log-probs of the policy's tokens as drawn (0 elsewhere)

T, max_completion_length, bounds the whole transcript (policy and environment tokens), so the loss's
normalisers and the training forward's width are those of single-turn training.

The KV cache is kept across turns: every row's prompt is prefilled once (and shared by its G
episodes), each drawn token is fed once, and an observation is fed as one chunk appended to the
cache, never by re-running the transcript. Rows advance in lockstep; a row that has ended its turn
(or its episode) while others still write takes cache slots that its key mask hides, and its
positions continue from its own last real token, so every row sees exactly its own transcript at
the positions a single forward over it would use.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..envs import EnvironmentSpec, episode_metrics, reset_episode, step_episode
from ..models import LeanLlamaDecoder, lm_head_of, model_device
from ..models.lean_llama import KVCache
from .hf_generate import eos_and_pad, tokenize_prompts
from .processing import draw, process_logits
from .types import Rollout, SamplingParams

GROW = 64  # cache slots added at least when the lean cache is full
ENV_THREADS = 16  # environment steps of a turn run concurrently (a slow tool delays its turn once)


def episode_seed(seed: int | None, row: dict[str, Any], g: int) -> int:
    """The seed an episode's environment is reset with: from the sampling seed (None: 0), the row and
    the episode's place g in its group; 31 bits, so any random number generator takes it. Independent
    of the batch the row is in (an evaluation's chunking changes nothing)."""
    key = json.dumps([seed or 0, g, row], sort_keys=True, default=repr)
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


class _LeanForward:
    """Appends tokens to a preallocated lean-Llama KV cache (grown when full)."""

    def __init__(self, head: Any) -> None:
        self.head, self.decoder = head, head.decoder
        self.cache: KVCache | None = None

    def prefill(
        self, ids: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor, G: int
    ) -> torch.Tensor:
        """The prompts [P, Lp], once each -> hidden [P·G, Lp, H]; the cache repeated G times."""
        P, Lp = ids.shape
        self.cache = self.decoder.new_cache(P, Lp + GROW, self.head.weight)
        hidden = self.decoder(
            ids, key_mask=key_mask, position_ids=positions, cache=self.cache
        ).last_hidden_state
        self.cache = self.cache.repeat_rows(G)  # the one place prompts are repeated: [P] -> [B = P·G]
        return hidden.repeat_interleave(G, dim=0)

    def append(self, ids: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids [B, L] after what the cache holds; key_mask [B, S + L] -> hidden [B, L, H]."""
        assert self.cache is not None
        needed = self.cache.length + ids.shape[1]
        capacity = self.cache.keys.shape[3]
        if needed > capacity:  # grow: a new cache holding what there is
            old = self.cache
            grown = self.decoder.new_cache(ids.shape[0], max(needed, capacity + GROW, 2 * capacity), old.keys)
            grown.keys[:, :, :, : old.length].copy_(old.keys[:, :, :, : old.length])
            grown.values[:, :, :, : old.length].copy_(old.values[:, :, :, : old.length])
            grown.length = old.length
            self.cache = grown
        return self.decoder(
            ids, key_mask=key_mask, position_ids=positions, cache=self.cache
        ).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head.weight, self.head.bias)  # [B, V]


class _HFForward:
    """transformers' forward with its own growing cache (any causal LM)."""

    def __init__(self, model: Any) -> None:
        self.model, self.cache = model, None

    def _run(
        self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, keep: int = 0
    ) -> torch.Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=attention.long(),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,  # 0: every position's
        )
        self.cache = out.past_key_values
        return out.logits  # [b, L, V]

    def prefill(
        self, ids: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor, G: int
    ) -> torch.Tensor:
        logits = self._run(ids, key_mask, positions, keep=1)  # [P, 1, V]: no [P, Lp, V] prompt logits
        self.cache.batch_repeat_interleave(G)  # [P] -> [B = P·G]
        return logits.repeat_interleave(G, dim=0)

    def append(self, ids: torch.Tensor, key_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._run(ids, key_mask, positions)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return out  # already logits


@dataclass(frozen=True)
class _CacheState:
    """What the cache holds for each row, besides the keys and values."""

    key_mask: torch.Tensor  # [B, S] bool: slots holding the row's real tokens
    context: torch.Tensor  # [B, S] the ids in the slots (the repetition penalty reads them)
    position: torch.Tensor  # [B] the row's last real position
    last: torch.Tensor  # [B, V] logits of the row's next token


@dataclass
class _Episode:
    """One row's transcript after the prompt, as it grows (host lists)."""

    env: Any
    ids: list[int]  # the transcript after the prompt
    trained: list[bool]  # per token: the policy wrote it
    logps: list[float]  # per token: its sampling log-prob (0 for the environment's)
    reward: float | None = None
    turns: int = 0
    running: bool = True
    truncated: bool = False


class EpisodeSampler:
    """Multi-turn rollouts of `model` in `environment` (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, environment: EnvironmentSpec) -> None:
        self.model, self.tokenizer, self.environment = model, tokenizer, environment
        self.eos_token_ids, self.pad_token_id = eos_and_pad(model, tokenizer)
        # as KVCacheSampler: the "all done?" decisions (collective under FSDP) and the grad-free mode
        self.sync_finished: Callable[[bool], bool] = lambda done: done
        self.grad_free: Callable[[], Any] = torch.inference_mode

    def _forward(self) -> _LeanForward | _HFForward:
        head = lm_head_of(self.model)
        if head is not None and isinstance(head.decoder, LeanLlamaDecoder):
            return _LeanForward(head)
        return _HFForward(self.model)

    def _stopped(self, turn_ids: list[int], stops: tuple[str, ...]) -> bool:
        """Whether the turn's text has just completed a stop string. Checked after every token, so a
        stop string can only have completed within the last len(stop) tokens (each real token is a
        character at least), possibly merged with what follows it (a BPE token "]\n")."""
        width = max((len(s) for s in stops), default=0)
        if not width:
            return False
        tail = self.tokenizer.decode(turn_ids[-width:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    @torch.no_grad()
    def sample(self, prompts: list[str], params: SamplingParams, rows: list[dict[str, Any]]) -> Rollout:
        if not prompts:
            raise ValueError("no prompts to sample from: the prompt batch is empty.")
        if len(rows) != len(prompts):
            raise ValueError(f"{len(rows)} rows for {len(prompts)} prompts: an episode needs its row.")
        batch, num_truncated = tokenize_prompts(self.tokenizer, prompts, params)
        prompt_ids, prompt_mask = batch["input_ids"], batch["attention_mask"].bool()  # [P, Lp] each
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling
        try:
            with self.grad_free():  # what leaves it is host lists: the Rollout is built outside
                episodes = self._episodes(prompt_ids, prompt_mask, params, rows)
        finally:
            self.model.train(was_training)
        return self._rollout(episodes, prompt_ids, prompt_mask, params.num_generations, num_truncated)

    def _episodes(  # noqa: C901 - the turn loop reads top to bottom
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        rows: list[dict[str, Any]],
    ) -> list[_Episode]:
        device = model_device(self.model)
        G, T, spec = params.num_generations, params.max_completion_length, self.environment
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)  # [P, Lp] each
        P, Lp = prompt_ids.shape
        B = P * G
        generator = None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)
        stops = tuple(dict.fromkeys(spec.stop_strings + params.stop_strings))  # a turn ends at either
        episodes = []
        for i in range(B):  # a fresh environment per episode, reset from its row and its own seed
            env = spec.factory()
            seed = episode_seed(params.seed, rows[i // G], i % G)
            first = self._encode(reset_episode(env, rows[i // G], seed, spec.name))
            kept = first[: T - 1]  # the policy keeps one token at least
            episodes.append(_Episode(env, kept, [False] * len(kept), [0.0] * len(kept)))
            episodes[-1].truncated = len(kept) < len(first)
        forward = self._forward()
        # key_mask [B, S]: which cache slots hold real tokens of the row; context [B, S]: the ids in the
        # slots (for the repetition penalty); position [B]: the row's last real position
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)  # [P, Lp] left padding aware
        out = forward.prefill(prompt_ids, prompt_mask, positions, G)  # [B, Lp, ·]
        state = _CacheState(
            key_mask=prompt_mask.repeat_interleave(G, dim=0),  # [B, Lp]
            context=prompt_ids.repeat_interleave(G, dim=0),  # [B, Lp]
            position=positions[:, -1].repeat_interleave(G, dim=0),  # [B]
            last=forward.logits(out[:, -1]),  # [B, V] the next-token logits of every row
        )
        penalised = params.repetition_penalty != 1.0
        eos = set(self.eos_token_ids)
        pending = [ep.ids[:] for ep in episodes]  # tokens in the transcript, not yet in the cache
        for turn in range(spec.max_turns):
            # the environment's words (and the token that ended the policy's turn) go into the cache;
            # every rank feeds while any has something to feed (collective under FSDP)
            if not self.sync_finished(not any(pending)):
                state = self._feed(forward, pending, state, device)
                pending = [[] for _ in range(B)]
            # ---------------------------------------------------------------- the policy's turn
            writing = [ep.running for ep in episodes]
            turn_ids: list[list[int]] = [[] for _ in range(B)]
            while True:
                logprobs = process_logits(state.last, state.context if penalised else None, params)  # [B, V]
                token = draw(logprobs, params.temperature == 0.0, generator)  # [B]
                picked = logprobs.gather(-1, token[:, None]).squeeze(-1)  # [B]
                drawn, drawn_logps = token.tolist(), picked.float().tolist()
                feeding = [False] * B
                for i, ep in enumerate(episodes):
                    if not writing[i]:
                        continue
                    ep.ids.append(drawn[i])
                    ep.trained.append(True)
                    ep.logps.append(drawn_logps[i])
                    turn_ids[i].append(drawn[i])
                    if drawn[i] in eos or self._stopped(turn_ids[i], stops):
                        writing[i] = False  # the turn is over
                    elif len(ep.ids) >= T:
                        writing[i], ep.truncated = False, True  # cut by the token budget mid-turn
                    else:
                        feeding[i] = True
                    if not writing[i]:
                        pending[i] = [drawn[i]]  # fed with the observation, if the episode goes on
                if self.sync_finished(not any(writing)):
                    break
                valid = torch.tensor(feeding, device=device)[:, None]  # [B, 1]
                token_in = torch.where(valid, token[:, None], self.pad_token_id)  # [B, 1]
                state = self._append(forward, token_in, valid, state)
            # ---------------------------------------------------------------- the environment's turn
            stepping = []  # episodes whose turn the environment answers (not cut by the budget)
            for i, ep in enumerate(episodes):
                if ep.running:
                    ep.turns += 1
                    ep.running = False  # unless the environment goes on, below
                    if not ep.truncated:
                        stepping.append(i)
            texts = [self.tokenizer.decode(turn_ids[i], skip_special_tokens=True) for i in stepping]
            answers = self._step_all([episodes[i].env for i in stepping], texts)
            for i, (observation, reward, done) in zip(stepping, answers, strict=True):
                ep = episodes[i]
                if reward is not None:
                    ep.reward = (ep.reward or 0.0) + reward
                if done or turn + 1 == spec.max_turns:
                    continue
                obs_ids = self._encode(observation)
                room = T - len(ep.ids) - 1  # the policy keeps one token at least
                if len(obs_ids) > room:  # the observation does not fit the budget: the episode ends here
                    obs_ids, ep.truncated = obs_ids[: max(room, 0)], True
                ep.ids.extend(obs_ids)
                ep.trained.extend([False] * len(obs_ids))
                ep.logps.extend([0.0] * len(obs_ids))
                ep.running = not ep.truncated
                pending[i] = pending[i] + obs_ids  # after the token that ended the turn
            pending = [p if ep.running else [] for p, ep in zip(pending, episodes, strict=True)]
            if self.sync_finished(not any(ep.running for ep in episodes)):
                break
        return episodes

    def _step_all(self, envs: list[Any], texts: list[str]) -> list[Any]:
        """Every episode's `step`, concurrently (a tool waiting on I/O or its timeout holds up one
        thread, not the turn), answers in order; what an environment raises is raised here."""
        name = self.environment.name
        if len(envs) <= 1:
            return [step_episode(env, text, name) for env, text in zip(envs, texts, strict=True)]
        with ThreadPoolExecutor(max_workers=min(ENV_THREADS, len(envs))) as pool:
            return list(
                pool.map(lambda pair: step_episode(pair[0], pair[1], name), zip(envs, texts, strict=True))
            )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _append(
        self, forward: _LeanForward | _HFForward, ids: torch.Tensor, valid: torch.Tensor, state: _CacheState
    ) -> _CacheState:
        """Feed ids [B, L] whose real tokens are `valid` [B, L] (each row's real tokens first): every
        row's positions continue from its own last real one. The new state's logits are those after
        each row's last real token (a row fed nothing keeps its own)."""
        steps = valid.long().cumsum(-1)  # [B, L]
        positions = state.position[:, None] + steps.clamp(min=1)  # [B, L] (padding: masked anyway)
        key_mask = torch.cat([state.key_mask, valid], dim=1)  # [B, S + L]
        out = forward.append(ids, key_mask, positions)  # [B, L, ·]
        count = steps[:, -1]  # [B] real tokens fed per row
        at = (count - 1).clamp(min=0)  # [B] index of each row's last real token
        fresh = forward.logits(out[torch.arange(ids.shape[0], device=ids.device), at])  # [B, V]
        return _CacheState(
            key_mask=key_mask,
            context=torch.cat([state.context, ids], dim=1),  # [B, S + L]
            position=state.position + count,
            last=torch.where((count > 0)[:, None], fresh, state.last),
        )

    def _feed(
        self, forward: _LeanForward | _HFForward, pending: list[list[int]], state: _CacheState, device: Any
    ) -> _CacheState:
        """Feed each row's pending tokens, right-padded into one chunk [B, L]."""
        width = max(1, max(len(p) for p in pending))
        ids = torch.full((len(pending), width), self.pad_token_id, dtype=torch.long)  # [B, L]
        valid = torch.zeros(len(pending), width, dtype=torch.bool)  # [B, L]
        for i, p in enumerate(pending):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
            valid[i, : len(p)] = True
        return self._append(forward, ids.to(device), valid.to(device), state)

    def _rollout(
        self,
        episodes: list[_Episode],
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        G: int,
        num_truncated: int,
    ) -> Rollout:
        B = len(episodes)
        width = max(1, max(len(ep.ids) for ep in episodes))
        ids = torch.full((B, width), self.pad_token_id, dtype=torch.long)  # [B, T]
        trained = torch.zeros(B, width, dtype=torch.bool)  # [B, T]
        real = torch.zeros(B, width, dtype=torch.bool)  # [B, T]
        logps = torch.zeros(B, width, dtype=torch.float32)  # [B, T]
        for i, ep in enumerate(episodes):
            n = len(ep.ids)
            ids[i, :n] = torch.tensor(ep.ids, dtype=torch.long)
            trained[i, :n] = torch.tensor(ep.trained, dtype=torch.bool)
            real[i, :n] = True
            logps[i, :n] = torch.tensor(ep.logps, dtype=torch.float32)
        metrics: dict[str, float] = {}
        for ep in episodes:
            for key, value in episode_metrics(ep.env).items():
                metrics[key] = metrics.get(key, 0.0) + value
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(G, dim=0),  # [B, Lp]
            prompt_mask=prompt_mask.repeat_interleave(G, dim=0),  # [B, Lp]
            completion_ids=ids,
            completion_mask=trained,
            truncated=torch.tensor([ep.truncated for ep in episodes]),
            sampling_logps=logps,
            completions=[self.tokenizer.decode(ep.ids, skip_special_tokens=True) for ep in episodes],
            num_generations=G,
            num_truncated_prompts=num_truncated,
            completion_attention=real,
            env_rewards=torch.tensor(
                [float("nan") if ep.reward is None else ep.reward for ep in episodes], dtype=torch.float32
            ),
            num_turns=torch.tensor([ep.turns for ep in episodes]),
            env_metrics=metrics,
        )
