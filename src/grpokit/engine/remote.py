"""Sampling on rollout servers (`rollout_server_urls`): the asynchronous rollout worker's engine when
generation runs behind `grpokit serve-policy` (serve/policy.py), over OpenAI's completions API.

A batch's prompts are rendered and tokenized here, as the in-process engine does (the same
`tokenize_prompts`: max_prompt_length applied before sending), and sent as token ids with n = G, the
step's seed, the sampling options, `logprobs: 0` and `return_token_ids`; the answers become the same
Rollout the in-process decode makes (completions right-padded to the longest, log-probs of the
distribution each token was drawn from). With one server the whole batch is one request, decoded
alone (it carries a seed): the server's engine draws exactly what the in-process engine draws, so an
asynchronous run equals its in-process twin bit for bit. With several, the prompts are split in
contiguous shares, one request per server at once, share j seeded with the step's seed mixed with j:
a run repeats itself bit for bit with the same servers in the same order, and differs from a run on
another number of servers.

Weights go to every server by path (`POST /update_weights {"path", "version", "sender"}`): the
safetensors file the trainer wrote, read by the server from the same filesystem, tagged with this
client's random `sender` id. A server that refuses, fails, or does not answer within `request_timeout`
seconds ends the run with one line naming it (RolloutServerError); its groups do not go to the others,
which would change what the run samples.

Answers are checked, not trusted. Each says the weight version and sender it sampled with, and its
tokenizer's fingerprint: another tokenizer ends the run; weights other than those this client last sent
(a server restarted behind its URL) are sent again once and the request asked again, and a server still
sampling with others, or with another client's (two runs sharing one server), ends the run. Each
completion's token ids, log-probs, length, finish reason and text must be what a decode can give.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from ..config.specs import SamplingParams
from ..rollout import Rollout
from ..rollout.decode import tokenize_prompts

# A sampled token's log-prob is at most 0: log_softmax's largest entry is 0 − log(a sum ≥ 1). A few
# float32 ulps above 0 are let through (a kernel's log of a sum just above 1 may round below 0); they
# move an importance weight by a millionth. Anything above is no log-prob.
LOGP_ROUNDOFF = 1e-6
FINISH_REASONS = ("stop", "length")


class RolloutServerError(ValueError):
    """A rollout server refused, failed, did not answer in time, or answered what it cannot have sampled
    (one line, naming it). A ValueError: a command sampling on a server (`grpokit eval --server`,
    `report --server`) prints the line (user_errors.py), as for any input the user can fix."""


def share_seed(seed: int | None, share: int) -> int | None:
    """Share `share`'s seed of a step whose seed is `seed` (share 0 keeps it)."""
    return seed if seed is None or share == 0 else (seed * 1_000_003 + 7_777_777 * share) % 2**63


@dataclass(frozen=True)
class ServerProbe:
    """What a rollout server says of itself (`RemotePolicy.probe`)."""

    model: str  # the served model's name
    version: int  # its weight version
    round_trip_s: float  # GET /v1/models, answered
    sender: str | None = None  # the id its weights' update came tagged with (None: its own weights)
    output_vocab_size: int = 0  # token ids it can draw: [0, this)


class RemotePolicy:
    """The rollout worker's engine on rollout servers: `generate` as PolicyEngine.generate (one turn),
    `update_weights` on every server."""

    environment = None  # multi-turn episodes run in process (refused with servers at config time)
    device = torch.device("cpu")

    def __init__(
        self, urls: tuple[str, ...], tokenizer: Any, timeout: float, api_key: str | None = None
    ) -> None:
        import httpx2 as httpx

        from ..models import tokenizer_fingerprint
        from ..net.server import API_KEY_ENV, server_base_url

        self.urls = tuple(server_base_url(u) for u in urls)
        self.tokenizer, self.timeout = tokenizer, timeout
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.sender = uuid.uuid4().hex[:16]  # tags this client's updates: another client's are told apart
        api_key = api_key or os.environ.get(API_KEY_ENV)  # (None: the servers' own variable, if set)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers)
        self.pad_token_id = tokenizer.pad_token_id
        self.sent: dict[str, tuple[str, int]] = {}  # url -> (path, version) last sent there
        try:
            self.probes = {url: self.probe(url) for url in self.urls}
        except BaseException:
            self.client.close()
            raise
        self.models = [self.probes[url].model for url in self.urls]

    def _call(self, url: str, method: str, path: str, body: Any = None) -> Any:
        """The JSON answer of `url`+`path`; RolloutServerError (one line) for anything else."""
        import httpx2 as httpx

        try:
            answer = self.client.request(method, url + path, json=body)
        except httpx.TimeoutException:
            raise RolloutServerError(
                f"rollout server {url} did not answer {method} {path} within "
                f"request_timeout={self.timeout:g} s"
            ) from None
        except httpx.HTTPError as error:
            raise RolloutServerError(
                f"rollout server {url} cannot be reached ({type(error).__name__}: {error}): is "
                "`grpokit serve-policy` running there?"
            ) from None
        if answer.status_code != 200:
            try:
                said = answer.json()["error"]["message"]
            except Exception:  # noqa: BLE001 - not our server's error shape: its first line
                said = (answer.text.strip().splitlines() or [""])[0][:200]
            said = " ".join(str(said).split())  # (one line, whatever it sent)
            raise RolloutServerError(
                f"rollout server {url} answered {method} {path} with HTTP {answer.status_code}: {said}"
            )
        try:
            return answer.json()
        except ValueError:
            raise RolloutServerError(f"rollout server {url} answered {method} {path} with no JSON") from None

    def probe(self, url: str) -> ServerProbe:
        """`url`'s model, weight version and round-trip time, after checking it samples with this
        tokenizer (its vocabulary size, and the fingerprint of its token ids where the server gives one):
        RolloutServerError (one line) when it does not."""
        from ..net.server import server_base_url

        url = server_base_url(url)
        began = time.perf_counter()
        models = self._call(url, "GET", "/v1/models")
        round_trip = time.perf_counter() - began
        held = self._call(url, "GET", "/weight_version")
        try:
            data, version, sender = models["data"][0], int(held["version"]), held.get("sender")
            model, drawable = str(data["id"]), int(data.get("output_vocab_size") or 0)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise RolloutServerError(
                f"rollout server {url} answered GET /v1/models or /weight_version without its model or "
                "weight version: is it `grpokit serve-policy`?"
            ) from None
        ours = (len(self.tokenizer), self.fingerprint)
        theirs = (data.get("vocab_size", ours[0]), data.get("tokenizer_fingerprint", ours[1]))
        if theirs != ours:
            raise RolloutServerError(
                f"rollout server {url} serves {model!r} with another tokenizer (vocabulary {theirs[0]}, "
                f"fingerprint {theirs[1]}; the trainer's: {ours[0]}, {ours[1]}): serve the trainer's model "
                "(grpokit serve-policy MODEL)"
            )
        return ServerProbe(model, version, round_trip, sender, max(drawable, ours[0]))

    def update_weights(self, path: str, version: int) -> None:
        """Every server loads the weights at `path` (version `version`) before it samples again."""
        for url in self.urls:
            self._send_weights(url, path, version)

    def _send_weights(self, url: str, path: str, version: int) -> None:
        self._call(url, "POST", "/update_weights", {"path": path, "version": version, "sender": self.sender})
        self.sent[url] = (path, version)

    def generate(self, prompts: list[str], params: SamplingParams, rows: Any = None) -> Rollout:
        """G completions of each prompt, sampled on the servers (contiguous shares, one each)."""
        prompt_ids, prompt_mask, cut = tokenize_prompts(self.tokenizer, prompts, params)  # [P, Lp]
        ids = [row[mask].tolist() for row, mask in zip(prompt_ids, prompt_mask, strict=True)]
        P, N, G = len(ids), len(self.urls), params.num_generations
        bounds = [P * j // N for j in range(N + 1)]
        shares = [
            (j, bounds[j], ids[bounds[j] : bounds[j + 1]]) for j in range(N) if bounds[j + 1] > bounds[j]
        ]
        with concurrent.futures.ThreadPoolExecutor(len(shares)) as pool:
            answers = list(pool.map(lambda share: self._sample(*share, params), shares))
        choices = [c for answer in answers for c in answer]
        lengths = torch.tensor([len(c["token_ids"]) for c in choices])  # [B]
        width = max(1, int(lengths.max()))
        completion_ids = torch.full((len(choices), width), self.pad_token_id, dtype=torch.long)  # [B, T]
        logps = torch.zeros((len(choices), width), dtype=torch.float32)  # [B, T]
        for row, choice in enumerate(choices):
            completion_ids[row, : lengths[row]] = torch.tensor(choice["token_ids"], dtype=torch.long)
            logps[row, : lengths[row]] = torch.tensor(
                choice["logprobs"]["token_logprobs"], dtype=torch.float32
            )
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(G, dim=0),  # [B, Lp]
            prompt_mask=prompt_mask.repeat_interleave(G, dim=0),
            completion_ids=completion_ids,
            completion_mask=torch.arange(width)[None, :] < lengths[:, None],  # [B, T]
            truncated=torch.tensor([c["finish_reason"] == "length" for c in choices]),
            sampling_logps=logps,
            completions=[c["text"] for c in choices],
            num_generations=G,
            num_truncated_prompts=cut,
        )

    def _sample(
        self, share: int, first: int, ids: list[list[int]], params: SamplingParams
    ) -> list[dict[str, Any]]:
        """Share `share` of a batch (its prompts `ids`, from prompt `first` on) sampled on its server:
        the answer's completions, each checked (`_choice_fault`)."""
        url = self.urls[share]
        body = {
            "model": self.models[share],
            "prompt": ids,
            "n": params.num_generations,
            "max_tokens": params.max_completion_length,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": params.min_p,
            "repetition_penalty": params.repetition_penalty,
            "stop": list(params.stop_strings),
            "seed": share_seed(params.seed, share),
            "logprobs": 0,
            "return_token_ids": True,
        }
        choices = self._completions(url, body).get("choices")
        G = params.num_generations
        if not isinstance(choices, list) or len(choices) != len(ids) * G:
            count = len(choices) if isinstance(choices, list) else "no list of"
            raise RolloutServerError(
                f"rollout server {url} answered {count} completions for {len(ids)} prompts × n={G}"
            )
        for index, choice in enumerate(choices):
            fault = self._choice_fault(choice, index, params.max_completion_length, url)
            if fault is not None:
                raise RolloutServerError(
                    f"rollout server {url} answered a completion no decode gives (row {first * G + index} of "
                    f"the batch): {fault}"
                )
        return choices

    def _completions(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """`url`'s answer to `body`, sampled with this tokenizer and the weights this client last sent
        it (before any: those it held when probed). A server that lost them (restarted: its own weights,
        or this client's older ones) is sent them again once and asked again; else RolloutServerError."""
        answer = self._call(url, "POST", "/v1/completions", body)
        held, wanted = self._sampled_with(url, answer), self._wanted(url)
        if held != wanted and url in self.sent and held[1] in (None, self.sender):
            path, version = self.sent[url]
            try:
                self._send_weights(url, path, version)
            except RolloutServerError as error:
                raise RolloutServerError(
                    f"rollout server {url} sampled with weight version {held[0]}, not version {version} "
                    f"this run sent it (restarted?), and sending them again failed: {error}"
                ) from None
            answer = self._call(url, "POST", "/v1/completions", body)
            held = self._sampled_with(url, answer)
        if held != wanted:
            raise RolloutServerError(self._weights_fault(url, held, wanted))
        return answer

    def _wanted(self, url: str) -> tuple[int, str | None]:
        """(weight version, sender) `url`'s answers must say they sampled with."""
        if url in self.sent:
            return self.sent[url][1], self.sender
        return self.probes[url].version, self.probes[url].sender

    def _sampled_with(self, url: str, answer: Any) -> tuple[int, str | None]:
        """(weight version, sender) a completions answer says it sampled with, after checking it
        sampled with this tokenizer (RolloutServerError otherwise, or when it does not say)."""
        said = answer if isinstance(answer, dict) else {}
        version, sender, fingerprint = (
            said.get(k) for k in ("weight_version", "weight_sender", "tokenizer_fingerprint")
        )
        if type(version) is not int or not isinstance(sender, (str, type(None))) or fingerprint is None:
            raise RolloutServerError(
                f"rollout server {url} answered without weight_version, weight_sender and "
                "tokenizer_fingerprint: is it `grpokit serve-policy`, of this grpokit's version?"
            )
        if fingerprint != self.fingerprint:
            theirs = json.dumps(fingerprint)[:40]
            raise RolloutServerError(
                f"rollout server {url} sampled with another tokenizer (fingerprint {theirs}; the trainer's: "
                f"{self.fingerprint}): restarted with another model? serve the trainer's model (grpokit "
                "serve-policy MODEL)"
            )
        return version, sender

    def _weights_fault(self, url: str, held: tuple[int, str | None], wanted: tuple[int, str | None]) -> str:
        """The line for `url` sampling with weights `held` (version, sender) instead of `wanted`."""
        got = f"rollout server {url} sampled with weight version {held[0]}"
        if url not in self.sent:  # wanted: what it held when probed
            return (
                f"{got}, not version {wanted[0]} it held when this began: its weights changed meanwhile "
                "(a restart, or a trainer's update); sample where nothing updates the weights"
            )
        if held[1] is not None and held[1] != self.sender:
            return (
                f"{got} that another client sent, not version {wanted[0]} this run sent it: two runs share "
                "this server? give each run a server of its own"
            )
        return f"{got}, not version {wanted[0]} this run sent it, even once sent them again"

    def _choice_fault(self, choice: Any, index: int, max_tokens: int, url: str) -> str | None:
        """What is wrong with completion `index` of an answer (None: nothing): its token ids integers the
        model can draw, 1 to `max_tokens` of them, a finite log-prob ≤ 0 for each, a known finish
        reason ("length": all `max_tokens` drawn) and its text what its ids decode to (as the decode
        loop makes texts: special tokens skipped)."""
        if not isinstance(choice, dict) or choice.get("index") != index:
            return f"it is not a completion of index {index}"
        ids = choice.get("token_ids")
        if not isinstance(ids, list) or not 1 <= len(ids) <= max_tokens:
            count = len(ids) if isinstance(ids, list) else "no list of"
            return f"{count} token ids, not 1 to max_tokens={max_tokens}"
        drawable = self.probes[url].output_vocab_size
        bad = next((t for t in ids if type(t) is not int or not 0 <= t < drawable), None)
        if bad is not None:
            return f"token id {json.dumps(bad)[:40]} is not an integer from 0 to {drawable - 1}"
        logps = choice.get("logprobs")
        logps = logps.get("token_logprobs") if isinstance(logps, dict) else None
        if not isinstance(logps, list) or len(logps) != len(ids):
            count = len(logps) if isinstance(logps, list) else "no list of"
            return f"{count} log-probs for {len(ids)} tokens"
        bad = next((lp for lp in logps if not _is_logp(lp)), None)
        if bad is not None:
            return f"log-prob {json.dumps(bad)[:40]} is not a finite number ≤ 0"
        reason = choice.get("finish_reason")
        if reason not in FINISH_REASONS or (reason == "length" and len(ids) != max_tokens):
            return f"finish_reason {json.dumps(reason)[:40]} after {len(ids)} of max_tokens={max_tokens}"
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if choice.get("text") != text:
            return f"its text {json.dumps(choice.get('text'))[:60]} is not its ids' {json.dumps(text)[:60]}"
        return None

    def close(self) -> None:
        self.client.close()


def _is_logp(value: Any) -> bool:
    """Whether `value` (from JSON) is a sampled token's log-prob: a finite number ≤ 0 (LOGP_ROUNDOFF)."""
    return type(value) in (int, float) and math.isfinite(value) and value <= LOGP_ROUNDOFF
