"""The decode loop: G completions per prompt, or G episodes per prompt with an environment, from any
model backend (`models.backend`). There is one loop; single-turn sampling is one turn with no
environment, and the static-shape modes (static, compiled, CUDA graphs) are another way to run its
step, not another loop.

    prefill each prompt once, repeat its cache for its G rows            (backend.prefill)
    per turn: feed what is pending (the environment's words), then
        draw a token for every row, record it and its log-prob            (processing.draw_and_record)
        until every row has ended its turn: feed the token, draw the next (backend.append, or the
                                                                           static step over buffers)
    the environment answers each turn; its tokens join the transcript, untrained (with a chat
    model, as a message through its chat template: envs.chat)

What a row writes goes to its `Tape` (tokens, sampling log-probs, which tokens the policy drew); the
Rollout is read off the tape. A row's turn ends at an end-of-sequence token, a stop string (matched on
decoded text, on the host) or the budget: T = max_completion_length bounds the whole transcript,
policy and environment tokens together, so a multi-turn batch has the width of a single-turn one.

Rows advance in lockstep. A row that has ended its turn while others write still draws (its token is
padding, never fed), so the random numbers a row uses do not depend on the others; its key mask hides
the slots it skips and its positions continue from its own last real token, so every row sees exactly
its own transcript at the positions one forward over it would use (what training scores).
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..envs import ChatTurns, EnvironmentSpec, episode_metrics, reset_episode, step_episode
from ..models.reward_model import pad_left
from .processing import DrawParams, Rows, Tape, draw_and_record
from .static_decode import DecodeState, StaticSteps, buckets_of, static_shape
from .types import Rollout, SamplingParams

logger = logging.getLogger(__name__)

FINISH_CHECK_EVERY = 8  # tokens between "has every row finished?" reads on a GPU (each read stalls it)
ENV_THREADS = 16  # environment steps of a turn run concurrently (a slow tool delays its turn once)


def _alone(done: bool) -> bool:
    return done


@dataclass(frozen=True)
class LoopControl:
    """How the loop runs besides what it draws. Sharded training replaces the defaults so that every
    rank runs the same number of forward passes, and FSDP's unsharded parameters stay ordinary."""

    sync_finished: Callable[[bool], bool] = _alone  # done here -> stop everywhere (collective under FSDP)
    grad_free: Callable[[], Any] = torch.inference_mode  # the loop's gradient-free mode
    check_every: int | None = None  # draws between "all finished?" reads; None: 1 on a CPU, 8 on a GPU


def tokenize_prompts(
    tokenizer: Any, prompts: Sequence[str | Sequence[int]], params: SamplingParams
) -> tuple[Any, Any, int]:
    """Prompts (texts, or token ids as they are: a rollout server's clients send ids) -> left-padded ids
    [P, Lp], mask [P, Lp] bool, and how many were cut to max_prompt_length (with
    prompt_truncation='error', refused instead)."""
    texts = [p for p in prompts if isinstance(p, str)]
    tokenized = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    encoded = [next(tokenized) if isinstance(p, str) else list(p) for p in prompts]
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
        encoded = [ids[-limit:] for ids in encoded]
    if any(len(ids) == 0 for ids in encoded):
        raise ValueError("a prompt tokenized to zero tokens; every prompt needs at least one token.")
    ids, mask = pad_left(encoded, tokenizer.pad_token_id)  # [P, Lp] left padding
    return ids, mask.bool(), len(too_long)


def eos_and_pad(model: Any, tokenizer: Any) -> tuple[list[int], int]:
    """Every id that ends a completion (model's generation config and tokenizer), and the pad id."""
    eos = model.generation_config.eos_token_id
    eos_ids = list(eos) if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    if None in eos_ids or not eos_ids:
        raise ValueError("the model and tokenizer define no EOS token; completions could never end.")
    return eos_ids, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]


def uniforms(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The uniform numbers in [0, 1) that draws are made with, taken here only, by either step (tests
    across devices draw them on the host here: one stream on both)."""
    return torch.rand(shape, generator=generator, device=device)


def episode_seed(seed: int | None, row: dict[str, Any], g: int) -> int:
    """The seed an episode's environment is reset with: from the sampling seed (None: 0), the row and
    the episode's place g in its group; 31 bits, so any random number generator takes it. Independent
    of the batch the row is in (an evaluation's chunking changes nothing)."""
    key = json.dumps([seed or 0, g, row], sort_keys=True, default=repr)
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class _Call:
    """One `sample` call's settings, as the loop reads them."""

    params: SamplingParams
    draw: DrawParams
    generator: torch.Generator | None
    check_every: int
    sync: Callable[[bool], bool]


@dataclass
class _Episodes:
    """Each row's episode, on the host: its environment and what the loop remembers of it."""

    envs: list[Any]
    reward: list[float | None]
    turns: list[int]
    running: list[bool]
    truncated: list[bool]
    pending: list[list[int]]  # tokens in the transcript, not yet in the cache (fed at the next turn)
    messages: list[list[dict[str, str]]]  # the policy's turns and the observations, as chat messages


def decode_turn(run: Any, T: int, check_every: int, after_draw: Callable[[], None] | None = None) -> int:
    """The decode loop: draw for every row, then feed the last token and draw the next until every
    row's turn has ended (read every `check_every` draws) or T draws were made. `run` is the eager or
    the static step (`first`, `step`, `check`). -> draws made"""
    run.first()
    drawn = 1
    while True:
        if after_draw is not None:
            after_draw()  # stop strings: matched on the host
        if drawn == T:
            return T
        if drawn % check_every == 0 and run.check():
            return drawn
        run.step()
        drawn += 1


@dataclass
class _Eager:
    """The loop's step through the backend's forward: feed each row's last token (a row that has ended
    its turn feeds padding under a masked key), keep the next-token logits."""

    backend: Any
    cache: Any
    logits: torch.Tensor  # [B, V] every row's next-token logits
    key_mask: torch.Tensor  # [B, S] bool: cache slots holding the row's real tokens
    position: torch.Tensor  # [B] long: the row's last real position
    rows: Rows
    tape: Tape
    call: _Call
    token: torch.Tensor | None = None  # [B] the last draw

    def first(self) -> None:
        u = None
        if self.call.draw.temperature != 0.0:
            u = uniforms(self.logits.shape[:1], self.call.generator, self.logits.device)  # [B]
        self.token = draw_and_record(self.logits, self.call.draw, self.rows, u, self.tape)

    def step(self) -> None:
        valid = ~self.rows.finished[:, None]  # [B, 1] rows still writing their turn
        self.feed(torch.where(valid, self.token[:, None], self.call.draw.pad_token_id), valid)
        self.first()

    def check(self) -> bool:
        return self.call.sync(bool(self.rows.finished.all()))  # (waits for the device)

    def feed(self, ids: torch.Tensor, valid: torch.Tensor) -> None:
        """ids [B, L] whose real tokens are `valid` (each row's first): every row's positions continue
        from its own last real one, its logits become those after its last real token (a row fed
        nothing keeps its own), and the repetition penalty sees what was fed."""
        steps = valid.long().cumsum(-1)  # [B, L]
        positions = self.position[:, None] + steps.clamp(min=1)  # [B, L] (padding: masked anyway)
        self.key_mask = torch.cat([self.key_mask, valid], dim=1)  # [B, S + L]
        count = steps[:, -1]  # [B] real tokens fed per row
        at = None if ids.shape[1] == 1 else (count - 1).clamp(min=0)  # [B] each row's last real token
        self.cache, fresh = self.backend.append(self.cache, ids, self.key_mask, positions, at)
        # one token: a row that fed nothing has ended its turn, and its logits are never read
        self.logits = fresh if at is None else torch.where((count > 0)[:, None], fresh, self.logits)
        self.rows.ids = torch.cat([self.rows.ids, ids], dim=1)
        self.position = self.position + count


class _Static:
    """The loop's step over the static buffers (`static_decode`): the compiled or captured step over
    the first b slots, the live rows gathered there at every check."""

    def __init__(self, steps: StaticSteps, prompt: tuple[torch.Tensor, torch.Tensor], call: _Call) -> None:
        ids, mask = prompt  # [P, Lp]
        P, Lp = ids.shape
        G, T = call.params.num_generations, call.params.max_completion_length
        B = P * G
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [P, Lp]
        cache, self.logits = steps.backend.prefill(ids, mask, positions, G, 0)  # [layers, B, kv, Lp, d]
        self.weights, self.buffers = steps.prepare(
            static_shape(call.params, Lp, B, cache.keys.dtype, call.draw)
        )
        state: DecodeState = self.buffers.state
        for i, (k, v) in enumerate(cache.layers):  # [B, kv, Lp, d] each
            state.keys[i][:, :, :Lp], state.values[i][:, :, :Lp] = k, v
        state.key_mask.zero_()
        state.key_mask[:, :Lp] = mask.repeat_interleave(G, dim=0)  # [B, Lp]
        repeated = ids.repeat_interleave(G, dim=0)  # [B, Lp]
        state.rows.ids.copy_(repeated[:, :1].expand_as(state.rows.ids))  # unwritten slots: a token seen
        state.rows.ids[:, :Lp] = repeated
        state.position.copy_(positions[:, -1].repeat_interleave(G) + 1)  # [B]
        state.rows.finished.zero_()
        state.rows.row.copy_(torch.arange(B, device=ids.device))
        state.rows.column.zero_()
        # [T, B] by output row: on a CPU the same numbers, in the same order, as the eager step's
        state.uniform[:T] = uniforms((T, B), call.generator, ids.device)
        state.step.zero_()
        state.slot.fill_(Lp)
        state.tape.tokens.fill_(call.draw.pad_token_id)
        state.tape.logps.zero_()
        state.tape.trained.zero_()
        self.steps, self.state, self.call, self.b, self.buckets = steps, state, call, B, buckets_of(B)

    def first(self) -> None:
        state = self.state
        state.token.copy_(
            draw_and_record(self.logits, self.call.draw, state.rows, state.uniform[0], state.tape)
        )
        state.step.add_(1)

    def step(self) -> None:
        self.steps.step(self.weights, self.call.draw, self.buffers, self.b)()

    def check(self) -> bool:
        live = int((~self.state.rows.finished[: self.b]).sum())  # (waits for the device)
        if self.call.sync(live == 0):
            return True
        smaller = [size for size in self.buckets if size >= max(live, 1)][-1]
        if smaller < self.b:
            self.state.compact(self.b, smaller)
            self.b = smaller
        return False


class StopStrings:
    """Ends a row's turn once the text it wrote this turn holds a stop string: after every draw the last
    few tokens of each row that wrote are decoded (a stop string can only have completed within its
    length in tokens, possibly merged with what follows it, a BPE token "]\n")."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], run: _Eager, starts: list[int]) -> None:
        self.tokenizer, self.stops, self.run, self.starts = tokenizer, stops, run, starts
        self.width = max(len(s) for s in stops)
        self.before = list(starts)  # each row's column before the last draw
        self.ends = [-1] * len(starts)  # where each row's stop string ended (exclusive column), −1: none

    def __call__(self) -> None:
        columns = self.run.rows.column  # [B]
        offsets = torch.arange(-self.width, 0, device=columns.device)  # [w]
        window = self.run.tape.tokens.gather(1, (columns[:, None] + offsets).clamp(min=0))  # [B, w]
        hit = []
        for i, (tail, end) in enumerate(zip(window.tolist(), columns.tolist(), strict=True)):
            wrote, self.before[i] = end != self.before[i], end
            if wrote and self.ends[i] < 0:
                turn = tail[self.width - min(self.width, end - self.starts[i]) :]  # this turn's tokens only
                if any(s in self.tokenizer.decode(turn, skip_special_tokens=True) for s in self.stops):
                    self.ends[i] = end
                    hit.append(i)
        if hit:
            self.run.rows.finished[hit] = True


@dataclass
class _Drawn:
    """What the loop leaves, on the host: the tape's first `width` columns and each row's length."""

    tokens: torch.Tensor  # [B, W] long
    logps: torch.Tensor  # [B, W] float32
    trained: torch.Tensor  # [B, W] bool: the policy drew it
    lengths: torch.Tensor  # [B] long: the transcript's real tokens
    truncated: torch.Tensor  # [B] bool: cut by the budget

    @classmethod
    def of(
        cls,
        tape: Tape,
        width: int,
        lengths: torch.Tensor | None = None,
        truncated: Any = None,
        stopped: list[int] | None = None,
    ) -> _Drawn:
        """Host copies, ordinary tensors (the loop ran in inference mode). lengths None: one turn, the
        policy's tokens; truncated None: one turn, cut where it ends neither at an EOS nor where a stop
        string ended (`stopped`: the column per row, −1: none)."""
        with torch.inference_mode(False):
            tokens, logps, trained = (
                t[:, :width].cpu().clone() for t in (tape.tokens, tape.logps, tape.trained)
            )
            lengths = trained.sum(-1) if lengths is None else lengths.cpu().clone()
            if truncated is None:
                last = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]  # [B]
                truncated = ~torch.isin(last, tape.eos.cpu())
                if stopped is not None:
                    truncated &= torch.tensor(stopped) < 0
        return cls(tokens, logps, trained, lengths, torch.as_tensor(truncated, dtype=torch.bool))


class Decoder:
    """Samples from one model backend (see the module docstring). `loop`: "eager", or a static-shape
    mode ("static", "compiled", "cuda_graph") used where the backend supports it (the lean Llama with
    plain linear layers and no dropout) and the rollout is one turn without stop strings; the eager
    step otherwise."""

    def __init__(
        self,
        backend: Any,
        tokenizer: Any,
        loop: str = "eager",
        environment: EnvironmentSpec | None = None,
        control: LoopControl | None = None,
    ) -> None:
        self.backend, self.tokenizer, self.environment = backend, tokenizer, environment
        self.control = control or LoopControl()
        self.loop = loop
        self.eos_token_ids, self.pad_token_id = eos_and_pad(backend.model, tokenizer)
        # conversational prompts: observations continue the episode through the chat template
        self.turns: ChatTurns | None = environment.chat_turns(tokenizer) if environment is not None else None
        self._static: StaticSteps | None = None

    def static_steps(self, params: SamplingParams) -> StaticSteps | None:
        """The static-shape step for these parameters, if the loop runs one."""
        if self.loop == "eager" or params.stop_strings or self.environment is not None:
            return None
        if not self.backend.capabilities.static_shapes:
            return None
        if self._static is None:
            self._static = StaticSteps(self.backend, self.loop)
        return self._static

    @torch.no_grad()
    def sample(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        rows: list[dict[str, Any]] | None = None,
    ) -> Rollout:
        """G completions of each prompt (a text, or its token ids; with an environment, G episodes
        started from its row of `rows`), as a Rollout on the host."""
        if not prompts:
            raise ValueError("no prompts to sample from: the prompt batch is empty.")
        if self.environment is not None and (rows is None or len(rows) != len(prompts)):
            given = "no" if rows is None else len(rows)
            raise ValueError(f"{given} rows for {len(prompts)} prompts: an episode needs its row (rows=).")
        prompt_ids, prompt_mask, num_truncated = tokenize_prompts(self.tokenizer, prompts, params)
        device = self.backend.device  # inputs go to the model; the Rollout comes back on the host
        processing = {name: getattr(params, name) for name in DrawParams.PROCESSING}
        draw = DrawParams(
            **processing, pad_token_id=self.pad_token_id, eos_token_ids=tuple(self.eos_token_ids)
        )
        generator = None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)
        check_every = self.control.check_every or (1 if device.type == "cpu" else FINISH_CHECK_EVERY)
        call = _Call(params, draw, generator, check_every, self.control.sync_finished)
        # eval mode for dropout; the lean forward of a model without dropout does not depend on the
        # mode (its log-probs are then the training forward's), and switching walks every module twice
        model = self.backend.model
        switch = model.training and not self.backend.capabilities.exact_sampler_logps
        if switch:
            model.eval()
        episodes = None
        try:
            # inference mode by default: no version counters or view tracking in the loop
            with self.control.grad_free():
                prompt = (prompt_ids.to(device), prompt_mask.to(device))  # [P, Lp] each
                static = self.static_steps(params)
                if static is not None:
                    drawn = self._static_turn(static, prompt, call)
                elif self.environment is None:
                    drawn = self._one_turn(prompt, call)
                else:
                    episodes = self._reset(rows or [], params)
                    drawn = self._episodes(prompt, call, episodes)
        finally:
            if switch:
                model.train(True)
        G = params.num_generations
        real = torch.arange(drawn.tokens.shape[1])[None, :] < drawn.lengths[:, None]  # [B, W]
        mask = drawn.trained & real  # [B, W] what the loss trains: the policy's tokens
        metrics: dict[str, float] = {}
        for env in episodes.envs if episodes is not None else ():
            for key, value in episode_metrics(env).items():
                metrics[key] = metrics.get(key, 0.0) + value
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(G, dim=0),  # [B, Lp]
            prompt_mask=prompt_mask.repeat_interleave(G, dim=0),
            completion_ids=torch.where(real, drawn.tokens, self.pad_token_id),  # [B, W]
            completion_mask=mask,
            truncated=drawn.truncated,
            sampling_logps=torch.where(mask, drawn.logps, 0.0),
            completions=self._texts(drawn, episodes),
            num_generations=G,
            num_truncated_prompts=num_truncated,
            completion_attention=real if episodes is not None else None,
            env_rewards=None
            if episodes is None
            else torch.tensor(
                [float("nan") if r is None else r for r in episodes.reward], dtype=torch.float32
            ),
            num_turns=None if episodes is None else torch.tensor(episodes.turns),
            env_metrics=metrics,
            messages=episodes.messages if episodes is not None and self.turns is not None else None,
        )

    def _texts(self, drawn: _Drawn, episodes: _Episodes | None) -> list[str]:
        """Each row's completion text: decoded up to its length (multi-turn: the whole transcript), or,
        when episodes continue through the chat template, the text of its last policy turn (its answer)."""
        if episodes is not None and self.turns is not None:
            last = (
                next((m["content"] for m in reversed(ms) if m["role"] == "assistant"), "")
                for ms in episodes.messages
            )
            return list(last)
        return [
            self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            for ids, n in zip(drawn.tokens.tolist(), drawn.lengths.tolist(), strict=True)
        ]

    def demonstrate(self, prompts: list[str], answers: list[str], params: SamplingParams) -> Rollout:
        """The dataset's answers as the completions of their prompts, one row each (GKD's off-policy
        batches): each prompt tokenised and left-padded as `sample` does; each answer tokenised on its
        own (no special tokens) and ended by the tokenizer's EOS, as the supervised warm start learns it;
        one longer than max_completion_length is cut there and counts as truncated (no EOS). Nothing is
        sampled: the log-probs are 0."""
        if len(answers) != len(prompts):
            raise ValueError(f"{len(answers)} answers for {len(prompts)} prompts: one answer per prompt.")
        prompt_ids, prompt_mask, num_truncated = tokenize_prompts(self.tokenizer, prompts, params)
        eos = (
            self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.eos_token_ids[0]
        )
        encoded = [self.tokenizer(a, add_special_tokens=False)["input_ids"] + [eos] for a in answers]
        limit = params.max_completion_length
        lengths = torch.tensor([min(len(ids), limit) for ids in encoded])  # [P]
        width = int(lengths.max())
        ids = torch.full((len(encoded), width), self.pad_token_id, dtype=torch.long)  # [P, T]
        for row, tokens in enumerate(encoded):
            ids[row, : lengths[row]] = torch.tensor(tokens[:limit])
        mask = torch.arange(width)[None, :] < lengths[:, None]  # [P, T]
        return Rollout(
            prompt_ids=prompt_ids,  # [P, Lp]
            prompt_mask=prompt_mask,
            completion_ids=ids,
            completion_mask=mask,
            truncated=torch.tensor([len(tokens) > limit for tokens in encoded]),
            sampling_logps=torch.zeros(ids.shape),
            completions=list(answers),
            num_generations=1,
            num_truncated_prompts=num_truncated,
        )

    # ------------------------------------------------------------------ one turn

    def _static_turn(
        self, steps: StaticSteps, prompt: tuple[torch.Tensor, torch.Tensor], call: _Call
    ) -> _Drawn:
        run = _Static(steps, prompt, call)
        with torch.autocast(prompt[0].device.type, enabled=False):  # the step casts by itself
            width = decode_turn(run, call.params.max_completion_length, call.check_every)
        return _Drawn.of(run.state.tape, width)

    def _start(self, prompt: tuple[torch.Tensor, torch.Tensor], call: _Call) -> _Eager:
        """Prefill each prompt once, its cache repeated for its G rows; an empty tape."""
        ids, mask = prompt  # [P, Lp]
        G, T = call.params.num_generations, call.params.max_completion_length
        B = ids.shape[0] * G
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # [P, Lp] left padding aware
        cache, logits = self.backend.prefill(ids, mask, positions, G, T)  # logits [B, V]
        long = {"dtype": torch.long, "device": ids.device}
        rows = Rows(
            ids=ids.repeat_interleave(G, dim=0),  # [B, Lp] what the repetition penalty reads
            finished=torch.zeros(B, dtype=torch.bool, device=ids.device),
            row=torch.arange(B, **long),
            column=torch.zeros(B, **long),
        )
        return _Eager(
            backend=self.backend,
            cache=cache,
            logits=logits,
            key_mask=mask.repeat_interleave(G, dim=0),
            position=positions[:, -1].repeat_interleave(G),
            rows=rows,
            tape=Tape.empty(B, T, call.draw, ids.device),
            call=call,
        )

    def _one_turn(self, prompt: tuple[torch.Tensor, torch.Tensor], call: _Call) -> _Drawn:
        run = self._start(prompt, call)
        stops = call.params.stop_strings
        check = StopStrings(self.tokenizer, stops, run, [0] * run.logits.shape[0]) if stops else None
        width = decode_turn(run, call.params.max_completion_length, call.check_every, check)
        return _Drawn.of(run.tape, width, stopped=check.ends if check is not None else None)

    # ------------------------------------------------------------------ episodes

    def _reset(self, rows: list[dict[str, Any]], params: SamplingParams) -> _Episodes:
        """A fresh environment per episode, reset from its row and its own seed; the first observation
        is pending (it opens the transcript, untrained)."""
        G, spec = params.num_generations, self.environment
        assert spec is not None
        B = len(rows) * G
        episodes = _Episodes([], [None] * B, [0] * B, [True] * B, [False] * B, [], [[] for _ in range(B)])
        for i in range(B):
            env, row = spec.factory(), rows[i // G]
            first = self._encode(reset_episode(env, row, episode_seed(params.seed, row, i % G), spec.name))
            kept = first[: params.max_completion_length - 1]  # the policy keeps one token at least
            episodes.envs.append(env)
            episodes.pending.append(kept)
            episodes.truncated[i] = len(kept) < len(first)
        return episodes

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _episodes(
        self, prompt: tuple[torch.Tensor, torch.Tensor], call: _Call, episodes: _Episodes
    ) -> _Drawn:
        """Up to max_turns policy turns per row, each answered by the row's environment; the KV cache is
        kept across turns (an observation is fed as one chunk, never by re-running the transcript)."""
        spec = self.environment
        assert spec is not None
        run = self._start(prompt, call)
        stops = tuple(dict.fromkeys(spec.stop_strings + call.params.stop_strings))  # a turn ends at either
        _write(run, episodes.pending)  # the first observations open the transcripts
        for turn in range(spec.max_turns):
            # every rank feeds while any has something to feed (collective under FSDP)
            if not call.sync(not any(episodes.pending)):
                run.feed(*_chunk(episodes.pending, call.draw.pad_token_id, run.logits.device))
                episodes.pending = [[] for _ in episodes.pending]
            run.rows.finished.copy_(torch.tensor([not r for r in episodes.running]))
            starts = run.rows.column.tolist()
            check = StopStrings(self.tokenizer, stops, run, starts) if stops else None
            decode_turn(run, call.params.max_completion_length, call.check_every, check)
            self._answer(run, episodes, starts, check, turn)
            if call.sync(not any(episodes.running)):
                break
        columns = run.rows.column
        return _Drawn.of(run.tape, max(1, int(columns.max())), columns, episodes.truncated)

    def _answer(self, run: _Eager, episodes: _Episodes, starts: list[int], check: Any, turn: int) -> None:
        """The environment's turn: each episode whose policy turn ended (not cut by the budget) is
        stepped with the text of that turn; its observation is written and pending, after the token
        that ended the turn, unless the episode is done or out of budget."""
        spec, T = self.environment, int(run.tape.limit)
        assert spec is not None
        columns, tokens = run.rows.column.tolist(), run.tape.tokens.tolist()
        stepping, texts = [], {}
        for i, running in enumerate(episodes.running):
            if not running:
                continue
            end = columns[i]
            texts[i] = self.tokenizer.decode(tokens[i][starts[i] : end], skip_special_tokens=True)
            episodes.messages[i].append(_turn_message(spec, texts[i]))
            episodes.turns[i] += 1
            episodes.running[i] = False  # unless the environment goes on, below
            episodes.pending[i] = [tokens[i][end - 1]]  # fed with the observation, if the episode goes on
            ended = tokens[i][end - 1] in self.eos_token_ids or (check is not None and check.ends[i] >= 0)
            if ended or end < T:
                stepping.append(i)
            else:
                episodes.truncated[i] = True  # cut by the token budget mid-turn
        observations: list[list[int]] = [[] for _ in columns]
        answers = self._step_all(episodes, stepping, [texts[i] for i in stepping])
        for i, (observation, reward, done) in zip(stepping, answers, strict=True):
            if reward is not None:
                episodes.reward[i] = (episodes.reward[i] or 0.0) + reward
            if done or turn + 1 == spec.max_turns:
                continue
            if self.turns is None:
                obs = self._encode(observation)
            else:  # the observation's message and the next turn's opening, after the turn's end (any
                # of the model's EOS ids ends it, as the model wrote it: Llama 3.1's <|eom_id|> too)
                ended = tokens[i][columns[i] - 1] in self.eos_token_ids
                obs = self.turns.observation_ids(observation, ended)
            room = T - columns[i] - 1  # the policy keeps one token at least
            if len(obs) > room:  # the observation does not fit the budget: the episode ends here
                obs, episodes.truncated[i] = obs[: max(room, 0)], True
            observations[i] = obs
            if obs and not episodes.truncated[i]:  # a message only for an observation written whole
                episodes.messages[i].append(_observation_message(spec, episodes.messages[i][-1], observation))
            episodes.running[i] = not episodes.truncated[i]
            episodes.pending[i] = episodes.pending[i] + obs
        _write(run, observations)
        episodes.pending = [p if r else [] for p, r in zip(episodes.pending, episodes.running, strict=True)]

    def _step_all(self, episodes: _Episodes, stepping: list[int], texts: list[str]) -> list[Any]:
        """The `step` of every episode in `stepping`, concurrently (a tool waiting on I/O or its timeout
        holds up one thread, not the turn), answers in order; what an environment raises is raised here."""
        name = self.environment.name if self.environment is not None else "environment"
        pairs = [(episodes.envs[i], text) for i, text in zip(stepping, texts, strict=True)]
        if len(pairs) <= 1:
            return [step_episode(env, text, name) for env, text in pairs]
        with ThreadPoolExecutor(max_workers=min(ENV_THREADS, len(pairs))) as pool:
            return list(pool.map(lambda pair: step_episode(pair[0], pair[1], name), pairs))


def _turn_message(spec: EnvironmentSpec, text: str) -> dict[str, Any]:
    """A policy turn as a chat message (the environment's reading of it, e.g. a parsed tool call)."""
    return (
        spec.turn_message(text) if spec.turn_message is not None else {"role": "assistant", "content": text}
    )


def _observation_message(spec: EnvironmentSpec, turn: dict[str, Any], observation: str) -> dict[str, Any]:
    """An observation as a chat message; a tool's result names the tool the turn called (as TRL's)."""
    message = {"role": str(spec.observation_role), "content": observation}
    calls = turn.get("tool_calls")
    return {**message, "name": calls[0]["function"]["name"]} if calls else message


def _chunk(pending: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's pending tokens, right-padded into one chunk: ids [B, L] and which are real [B, L]."""
    B, width = len(pending), max(1, max(len(p) for p in pending))
    ids = torch.full((B, width), pad, dtype=torch.long)  # [B, L]
    valid = torch.zeros(B, width, dtype=torch.bool)  # [B, L]
    for i, p in enumerate(pending):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        valid[i, : len(p)] = True
    return ids.to(device), valid.to(device)


def _write(run: _Eager, texts: list[list[int]]) -> None:
    """Append the environment's tokens to each row's transcript (untrained, log-prob 0)."""
    columns = run.rows.column.tolist()
    for i, ids in enumerate(texts):
        if ids:
            run.tape.tokens[i, columns[i] : columns[i] + len(ids)] = torch.tensor(ids)
            columns[i] += len(ids)
    run.rows.column.copy_(torch.tensor(columns))
