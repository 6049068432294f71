"""`grpokit serve-policy MODEL`: the policy served through the engine (the same backends, decode loop,
precision and device as training) behind the generation API that vLLM's OpenAI-compatible server and
the RL systems built on it speak:

    GET  /health                  {"status": "ok"}
    GET  /v1/models               {"object": "list", "data": [{"id": MODEL, "object": "model", ...}]}
    POST /v1/completions          OpenAI's completions: prompt as text or token ids (one, or a list), n,
                                  max_tokens, temperature, top_p, top_k, min_p, repetition_penalty
                                  (vLLM's), seed, stop, logprobs
                                  (0: each sampled token's log-prob), return_token_ids (vLLM's)
    POST /v1/chat/completions     the same for chat models: messages through the chat template, as
                                  training applies it (add_generation_prompt); logprobs true/false
    POST /update_weights          {"path": FILE.safetensors, "version": N, "sender": ID}: the weights the
                                  trainer wrote, the whole file checked before any weight changes
    GET  /weight_version          {"version": N, "sender": ID} (0 and null until an update)

Every completion answer also says what it was sampled with (grpokit's fields, which a trainer checks on
each answer, engine/remote.py): `weight_version` and `weight_sender` (the version and the sender id of
the last update applied before its decode; 0 and null: the weights the server started with) and
`tokenizer_fingerprint`.

Log-probs are those of the distribution each token was drawn from, after temperature, top-k, top-p
and min-p (vLLM's `--logprobs-mode processed_logprobs`): the sampler's own. Choices come prompt by
prompt, n each (index p·n + j, as vLLM orders them); `finish_reason` is "stop" (an EOS or a stop
string, which the text keeps) or "length".

Requests are batched across clients: the generation thread takes every queued request that samples
alike (the same n, max_tokens, temperature, top_p, top_k, min_p, repetition_penalty and stop) into
one decode, so a request of n = G is one group among others. A request with a seed is decoded alone,
so that its tokens are those the in-process engine draws with that seed, whoever else is asking.
Weight updates are applied between decodes, in the order they arrive.

Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx for what the
client sent (an unknown model is 404; an OpenAI option this server does not implement, set to anything
but its default, is 400 naming it, never silently ignored) and one line in the log; the HTTP bounds
(body size, slow and idle clients, connections at once, the API key) are net/server.py's, and a text
prompt longer in characters than the model's positions could hold is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.specs import SamplingParams
from ..engine.weights import WeightsFileError
from ..models import tokenizer_fingerprint
from ..net.server import DEFAULT_MAX_BATCH_ROWS, JsonServer, ServeLimits, stderr_line

MAX_N = 256  # completions per prompt a request may ask for
MAX_SENDER = 64  # characters of an update's sender id
# OpenAI options this server does not implement, each with the values that mean "not used" (its default,
# and null): a request setting one to anything else is refused (400, naming it), never answered as if
# it were not set
UNUSED_OPTIONS: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0),
    "presence_penalty": (None, 0),
    "logit_bias": (None, {}),
}
COMPLETION_UNUSED = UNUSED_OPTIONS | {"echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}
CHAT_UNUSED = UNUSED_OPTIONS | {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),  # (without tools, "auto" chooses none)
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "Timeout",
               413: "BadRequestError", 500: "InternalServerError"}  # fmt: skip


class RequestError(ValueError):
    """What a client sent is refused: (message, param, status)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class Sampling:
    """How one request samples: the fields of SamplingParams it sets (and whether it wants log-probs
    and ids back, which change nothing about the decode)."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(
            num_generations=self.n,
            max_completion_length=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            stop_strings=self.stop,
            seed=self.seed,
        )

    @property
    def key(self) -> tuple:
        """Requests with the same key (and no seed) share a decode."""
        return (
            self.n, self.max_tokens, self.temperature, self.top_p, self.top_k, self.min_p,
            self.repetition_penalty, self.stop,
        )  # fmt: skip


@dataclass
class Job:
    """A decode of `prompts` (token ids) for one request, or a weight update (`path`, `version`, and the
    `sender` id its client tags it with)."""

    prompts: list[list[int]] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    path: str | None = None
    version: int = 0
    sender: str | None = None
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


# ----------------------------------------------------------------------------- reading a request


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {json.dumps(value)[:40]}", name)
    if value < low or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"from {low} to {high}"
        raise RequestError(f"{name} must be {bounds}, got {value}", name)
    return value


def _number(
    body: dict, name: str, default: float, low: float, high: float, *, open_low: bool = False
) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {json.dumps(value)[:40]}", name)
    if value != value or value > high or value < low or (open_low and value == low):
        side = "(" if open_low else "["
        raise RequestError(f"{name} must be in {side}{low:g}, {high:g}], got {value}", name)
    return float(value)


def read_sampling(body: dict, max_model_tokens: int) -> Sampling:
    """A request's sampling fields, each checked (RequestError names the first bad one)."""
    if body.get("stream"):
        raise RequestError("stream is not supported: leave it false (the answer comes whole)", "stream")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a string or a list of non-empty strings", "stop")
    top_k = _integer(body, "top_k", None, -1)
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer({name: limit}, name, 16, 1, max_model_tokens)
    return Sampling(
        n=_integer(body, "n", 1, 1, MAX_N) or 1,
        max_tokens=max_tokens or 16,
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        top_k=None if top_k in (None, -1, 0) else top_k,
        min_p=None if min_p == 0.0 else min_p,
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 100.0, open_low=True),
        stop=tuple(stop),
        seed=_integer(body, "seed", None, 0, 2**63 - 1),
    )


def read_prompts(prompt: Any, vocab_size: int) -> list[list[int]] | list[str]:
    """`prompt` as OpenAI takes it: a text, a list of texts, a list of token ids, or a list of lists of
    token ids (each id below the vocabulary's size)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and p for p in prompt):
        for ids in prompt:
            bad = next((t for t in ids if not _is_id(t) or t >= vocab_size), None)
            if bad is not None:
                raise RequestError(
                    f"token id {json.dumps(bad)[:40]} is not in the vocabulary (0 to {vocab_size - 1})",
                    "prompt",
                )
        return prompt
    raise RequestError(
        "prompt must be a non-empty text, list of texts, list of token ids or list of lists of token ids",
        "prompt",
    )


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def refuse_unused(body: dict, options: dict[str, tuple[Any, ...]]) -> None:
    """RequestError naming the first of `options` (OpenAI's, not implemented here) that `body` sets to
    anything but a value that means "not used"."""
    for name, unused in options.items():
        if name in body and body[name] not in unused:
            allowed = " or ".join(json.dumps(v) for v in unused)
            raise RequestError(f"{name} is not supported by this server: leave it out (or {allowed})", name)


def read_messages(messages: Any) -> list[Any]:
    """Chat `messages` with each content one text: a list of OpenAI content parts
    ([{"type": "text", "text": ...}, ...]) becomes its texts joined by newlines, as vLLM joins them; any
    other part is refused (RequestError naming it). The rest is the chat template's to check
    (data.render_prompt)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content}", "messages")
    return [
        _joined_text(m, i) if isinstance(m, dict) and isinstance(m.get("content"), list) else m
        for i, m in enumerate(messages)
    ]


def _joined_text(message: dict, i: int) -> dict:
    """Message `i`, its list of content parts made one text (only text parts: else RequestError)."""
    texts = []
    for j, part in enumerate(message["content"]):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            what = (
                f"a {json.dumps(kind)[:40]} part"
                if kind not in (None, "text")
                else 'not a text part {"type": "text", "text": ...}'
            )
            raise RequestError(
                f"messages[{i}].content[{j}] is {what}: only text parts are served", "messages"
            )
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def longest_token(tokenizer: Any) -> int:
    """The most characters one token of `tokenizer` stands for: its longest vocabulary entry (byte-level
    BPE writes an entry a character per byte, and a character is at least one byte), so a text of more
    than positions × this many characters cannot fit the model."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


# ----------------------------------------------------------------------------- the server


class PolicyServer(JsonServer):
    """`engine`'s policy served as `model_name` on (host, port) (net/server.py's JsonServer: binding,
    start, close, bounds). `limits.max_batch_rows`: completions one decode may hold; a request asking
    for more is refused (400)."""

    name = "serve-policy"

    def __init__(
        self,
        engine: Any,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        limits: ServeLimits | None = None,
        api_key: str | None = None,
        log: Callable[[str], None] = stderr_line,
    ) -> None:
        self.engine, self.model_name = engine, model_name
        self.max_batch_rows = (limits or ServeLimits()).max_batch_rows
        self.tokenizer = engine.tokenizer
        self.vocab_size = len(self.tokenizer)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        config = getattr(engine.module, "config", None)
        self.max_model_tokens = int(getattr(config, "max_position_embeddings", None) or 2**20)
        # ids the model can draw: its output rows, more than the tokenizer's ids where they are padded
        self.output_vocab_size = max(int(getattr(config, "vocab_size", None) or 0), self.vocab_size)
        self.longest_token = longest_token(self.tokenizer)
        self.version, self.created = 0, int(time.time())
        self.sender: str | None = None  # the id the last weight update came tagged with
        self.decodes = 0  # decodes run (requests batched together count once)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        super().__init__(host, port, limits=limits, api_key=api_key, log=log)
        self.generator = threading.Thread(target=self._generate_loop, name="serve-policy-decode", daemon=True)
        self.generator.start()

    def close(self) -> None:
        super().close()
        self.jobs.put(None)

    def routes(self) -> list[Any]:
        from starlette.routing import Route

        def route(path: str, answer: Callable[[Any], Any], method: str) -> Route:
            async def refusing(request: Any) -> Any:  # a RequestError answered with its status and param
                try:
                    return await answer(request)
                except RequestError as error:
                    return self.reply(request, error.status, str(error), param=error.param)

            async def endpoint(request: Any) -> Any:
                return await self.guarded(request, refusing)

            return Route(path, endpoint, methods=[method])

        return [
            route("/health", self._health, "GET"),
            route("/v1/models", self._models, "GET"),
            route("/weight_version", self._weight_version, "GET"),
            route("/v1/completions", self._completions, "POST"),
            route("/v1/chat/completions", self._chat, "POST"),
            route("/update_weights", self._update_weights, "POST"),
        ]

    def error_payload(self, status: int, message: str, param: str | None = None) -> dict[str, Any]:
        """OpenAI's error shape."""
        kind = ERROR_TYPES.get(status, "BadRequestError")
        return {"error": {"message": message, "type": kind, "param": param, "code": status}}

    # ------------------------------------------------------------------------------------ routes

    async def _health(self, request: Any) -> Any:
        return self.reply(request, 200, {"status": "ok"})

    async def _models(self, request: Any) -> Any:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "grpokit",
            "max_model_len": self.max_model_tokens,
            # (grpokit's: a trainer checks they are its tokenizer's)
            "vocab_size": self.vocab_size,
            "output_vocab_size": self.output_vocab_size,
            "tokenizer_fingerprint": self.fingerprint,
        }
        return self.reply(request, 200, {"object": "list", "data": [model]})

    async def _weight_version(self, request: Any) -> Any:
        return self.reply(request, 200, {"version": self.version, "sender": self.sender})

    async def _json(self, request: Any) -> dict[str, Any]:
        body = await self.body(request)
        try:
            value = json.loads(body)
        except RecursionError:
            raise RequestError("the body is JSON nested too deep") from None
        except ValueError as error:
            raise RequestError(f"the body is not JSON: {error}") from None
        if not isinstance(value, dict):
            raise RequestError(f"the body is a JSON {type(value).__name__}, not an object")
        return value

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(
                f"the model {json.dumps(model)[:80]} does not exist: this server serves {self.model_name!r}",
                "model",
                404,
            )

    async def _completions(self, request: Any) -> Any:
        body = await self._json(request)
        self._check_model(body)
        refuse_unused(body, COMPLETION_UNUSED)
        sampling = read_sampling(body, self.max_model_tokens)
        prompts = read_prompts(body.get("prompt"), self.vocab_size)
        logprobs = body.get("logprobs")
        if logprobs not in (None, 0) or isinstance(logprobs, bool):
            raise RequestError(
                "logprobs must be 0 (each sampled token's log-prob) or null: top alternatives are not "
                "returned",
                "logprobs",
            )
        ids = self._ids(prompts, "prompt")
        rollout = await self._decode(ids, sampling)
        choices = [
            self._choice(rollout, row, logprobs is not None, bool(body.get("return_token_ids")), ids)
            for row in range(len(rollout.completions))
        ]
        return self.reply(request, 200, self._answer("cmpl", "text_completion", ids, choices, rollout))

    async def _chat(self, request: Any) -> Any:
        from ..data import DataError, render_prompt

        body = await self._json(request)
        self._check_model(body)
        refuse_unused(body, CHAT_UNUSED)
        sampling = read_sampling(body, self.max_model_tokens)
        messages = read_messages(body.get("messages"))
        try:
            text = render_prompt(messages, self.tokenizer, None, body.get("chat_template_kwargs") or {})
        except DataError as error:
            raise RequestError(str(error), "messages") from None
        logprobs = body.get("logprobs") or False
        if not isinstance(logprobs, bool):
            raise RequestError("logprobs must be true or false", "logprobs")
        if body.get("top_logprobs"):
            raise RequestError(
                "top_logprobs is not supported: each sampled token's log-prob is", "top_logprobs"
            )
        ids = self._ids([text], "messages")
        rollout = await self._decode(ids, sampling)
        choices = []
        for row in range(len(rollout.completions)):
            choice = self._choice(rollout, row, False, bool(body.get("return_token_ids")), ids)
            choice["message"] = {"role": "assistant", "content": choice.pop("text")}
            choice["logprobs"] = {"content": self._chat_logprobs(rollout, row)} if logprobs else None
            choices.append(choice)
        return self.reply(request, 200, self._answer("chatcmpl", "chat.completion", ids, choices, rollout))

    async def _update_weights(self, request: Any) -> Any:
        body = await self._json(request)
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise RequestError("path must name a .safetensors file the trainer wrote", "path")
        if not Path(path).is_file():
            raise RequestError(f"{path} is not a file on this server's machine", "path")
        version = _integer(body, "version", None, 0)
        if version is None:
            raise RequestError(
                "version must be given: the weights' version number (steps trained)", "version"
            )
        sender = body.get("sender")
        if sender is not None and not (isinstance(sender, str) and 0 < len(sender) <= MAX_SENDER):
            raise RequestError(f"sender must be an id of 1 to {MAX_SENDER} characters, or null", "sender")
        job = Job(path=path, version=version, sender=sender)
        self.jobs.put(job)
        version, sender = await asyncio.wrap_future(job.done)
        return self.reply(request, 200, {"version": version, "sender": sender})

    # ------------------------------------------------------------------------------------ decoding

    def _ids(self, prompts: list[list[int]] | list[str], param: str) -> list[list[int]]:
        """Each prompt's token ids (texts tokenized as training tokenizes them: no special tokens added);
        a text that cannot fit the model's positions is refused before it is tokenized (`param`: the
        field it came in)."""
        texts = [p for p in prompts if isinstance(p, str)]
        bound = self.max_model_tokens * self.longest_token
        longest = max(map(len, texts), default=0)
        if longest > bound:
            raise RequestError(
                f"a text prompt of {longest} characters cannot fit the model's {self.max_model_tokens} "
                f"positions (a token here is at most {self.longest_token} characters): send a shorter one",
                param,
            )
        encoded = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
        ids = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
        if any(not p for p in ids):
            raise RequestError("a prompt tokenized to no tokens", "prompt")
        return ids

    async def _decode(self, prompts: list[list[int]], sampling: Sampling) -> Any:
        rows = len(prompts) * sampling.n
        if rows > self.max_batch_rows:
            raise RequestError(
                f"{len(prompts)} prompt(s) × n={sampling.n} is {rows} completions, over this server's "
                f"--max-batch-rows {self.max_batch_rows}: send fewer at once",
                "n",
            )
        longest = max(len(p) for p in prompts) + sampling.max_tokens
        if longest > self.max_model_tokens:
            raise RequestError(
                f"a prompt of {longest - sampling.max_tokens} tokens plus max_tokens={sampling.max_tokens} "
                f"is over the model's {self.max_model_tokens} positions",
                "max_tokens",
            )
        job = Job(prompts=prompts, sampling=sampling)
        self.jobs.put(job)
        return await asyncio.wrap_future(job.done)

    def _generate_loop(self) -> None:
        """The generation thread: jobs in the order they arrive; a decode takes with it every later
        request that samples alike and fits, up to the next weight update (a seeded request alone)."""
        pending: collections.deque[Job | None] = collections.deque()
        while True:
            if not pending:
                pending.append(self.jobs.get())
            while True:  # everything queued now, in arrival order
                try:
                    pending.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            job = pending.popleft()
            if job is None:
                return
            if job.path is not None:
                self._load(job)
                continue
            batch, rows = [job], len(job.prompts) * job.sampling.n
            kept: collections.deque[Job | None] = collections.deque()
            while pending and job.sampling.seed is None:
                other = pending.popleft()
                if other is None or other.path is not None:  # nothing after an update or the end joins
                    kept.append(other)
                    break
                size = len(other.prompts) * other.sampling.n
                if (
                    other.sampling.seed is None
                    and other.sampling.key == job.sampling.key
                    and rows + size <= self.max_batch_rows
                ):
                    batch.append(other)
                    rows += size
                else:
                    kept.append(other)
            pending = kept + pending
            self._decode_batch(batch)

    def _decode_batch(self, batch: list[Job]) -> None:
        prompts = [p for job in batch for p in job.prompts]
        self.decodes += 1
        try:
            rollout = self.engine.generate(prompts, batch[0].sampling.params())
        except ValueError as error:
            for job in batch:
                job.done.set_exception(RequestError(str(error)))
            return
        except Exception as error:  # noqa: BLE001 - answered (500), the server goes on
            self.log(f"{self.name}: the decode failed: {type(error).__name__}: {error}")
            for job in batch:
                job.done.set_exception(
                    RequestError(f"the decode failed: {type(error).__name__}: {error}", None, 500)
                )
            return
        start = 0
        for job in batch:
            rows = len(job.prompts) * job.sampling.n
            job.done.set_result(_Slice(rollout, start, rows, job.sampling.n, self.version, self.sender))
            start += rows

    def _load(self, job: Job) -> None:
        """Apply update `job` (`PolicyEngine.update_weights`: the whole file checked first); a refused
        file changes no weight, nor the version."""
        try:
            self.engine.update_weights(str(job.path), job.version)
        except Exception as error:  # noqa: BLE001 - a file that is not these weights: one answer
            fault = str(error) if isinstance(error, WeightsFileError) else f"{type(error).__name__}: {error}"
            line = " ".join(fault.split())[:300]
            kept = f"no weight was changed (version {self.version} kept)"
            job.done.set_exception(RequestError(f"cannot load {job.path}: {line}; {kept}", "path"))
            return
        self.version, self.sender = job.version, job.sender
        job.done.set_result((self.version, self.sender))

    # ------------------------------------------------------------------------------------ answers

    def _answer(self, prefix: str, kind: str, ids: list[list[int]], choices: list, rollout: Any) -> dict:
        completion_tokens = rollout.completion_tokens
        prompt_tokens = sum(len(p) for p in ids)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
            # (grpokit's: what the decode sampled with, which a trainer checks on every answer)
            "weight_version": rollout.version,
            "weight_sender": rollout.sender,
            "tokenizer_fingerprint": self.fingerprint,
        }

    def _choice(
        self, rollout: Any, row: int, logprobs: bool, token_ids: bool, prompts: list[list[int]]
    ) -> dict[str, Any]:
        """Row `row` (prompt row // n) as an OpenAI completion choice; with `token_ids`, vLLM's
        prompt_token_ids and token_ids too."""
        ids, logps = rollout.tokens(row)
        choice: dict[str, Any] = {
            "index": row,
            "text": rollout.completions[row],
            "logprobs": None,
            "finish_reason": "length" if rollout.truncated[row] else "stop",
        }
        if logprobs:
            tokens = [self.tokenizer.decode([t]) for t in ids]
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": logps,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        if token_ids:
            choice["prompt_token_ids"] = prompts[row // rollout.n]
            choice["token_ids"] = ids
        return choice

    def _chat_logprobs(self, rollout: Any, row: int) -> list[dict[str, Any]]:
        ids, logps = rollout.tokens(row)
        out = []
        for t, lp in zip(ids, logps, strict=True):
            text = self.tokenizer.decode([t])
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        return out


@dataclass(frozen=True)
class _Slice:
    """One request's rows of a decode that batched several."""

    rollout: Any
    start: int
    rows: int
    n: int  # completions per prompt
    version: int  # the weight version it was sampled with
    sender: str | None  # and that version's sender id

    @property
    def completions(self) -> list[str]:
        return self.rollout.completions[self.start : self.start + self.rows]

    @property
    def truncated(self) -> list[bool]:
        return self.rollout.truncated[self.start : self.start + self.rows].tolist()

    @property
    def completion_tokens(self) -> int:
        """Tokens sampled for this request's rows (each up to and including its EOS or stop)."""
        return int(self.rollout.completion_mask[self.start : self.start + self.rows].sum())

    def tokens(self, row: int) -> tuple[list[int], list[float]]:
        """Row `row`'s sampled token ids and their log-probs (up to and including its EOS or stop)."""
        r = self.start + row
        mask = self.rollout.completion_mask[r]
        return self.rollout.completion_ids[r][mask].tolist(), self.rollout.sampling_logps[r][mask].tolist()


# ----------------------------------------------------------------------------- grpokit serve-policy


@dataclass(frozen=True)
class ServePolicyCommand:
    """`grpokit serve-policy`'s options (the config's key=value items aside)."""

    model: str
    port: int = 8000
    host: str = "127.0.0.1"
    served_model_name: str | None = None
    max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS
    max_body_mb: float = 64.0
    request_timeout: float = 30.0
    max_connections: int = 64
    api_key: str | None = None

    def check(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port} is not a port (0 to 65535; 0: any free one)")
        if self.max_batch_rows < 1:
            raise ValueError(f"--max-batch-rows {self.max_batch_rows} must be at least 1")
        for option, value in (
            ("--max-body-mb", self.max_body_mb),
            ("--request-timeout", self.request_timeout),
        ):
            if not value > 0:
                raise ValueError(f"{option} {value:g} must be above 0")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections {self.max_connections} must be at least 1")


def serve_policy(command: ServePolicyCommand, plan: Any) -> None:
    """Load `plan`'s policy (config.plan.eval_plan's: the model, its precision, device and decode loop)
    and serve it until Ctrl-C or SIGTERM; where it listens on stdout, and a warning on stderr when it
    is reachable beyond this machine."""
    from ..net.server import api_key_from, bind, serve_until_stopped
    from ..train.eval_run import policy_engine

    command.check()
    api_key = api_key_from(command.api_key)
    engine, _ = policy_engine(plan)
    name = command.served_model_name or command.model
    limits = ServeLimits(
        max_body_mb=command.max_body_mb,
        request_timeout=command.request_timeout,
        max_connections=command.max_connections,
        max_batch_rows=command.max_batch_rows,
    )
    server = bind(
        lambda: PolicyServer(engine, name, command.host, command.port, limits=limits, api_key=api_key),
        command.host,
        command.port,
    )
    listening = f"serving {name!r} at {server.url}v1 (Ctrl-C stops)"
    serve_until_stopped(
        server, command.host, f"the policy {name!r}", keyed=api_key is not None, listening=listening
    )
