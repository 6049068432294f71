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

Weights go to every server by path (`POST /update_weights {"path", "version"}`): the safetensors file
the trainer wrote, read by the server from the same filesystem. A server that refuses, fails, or does
not answer within `request_timeout` seconds ends the run with one line naming it (RolloutServerError);
its groups do not go to the others, which would change what the run samples.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..config.specs import SamplingParams
from ..rollout import Rollout
from ..rollout.decode import tokenize_prompts


class RolloutServerError(RuntimeError):
    """A rollout server refused, failed or did not answer in time (one line, naming it)."""


def share_seed(seed: int | None, share: int) -> int | None:
    """Share `share`'s seed of a step whose seed is `seed` (share 0 keeps it)."""
    if seed is None or share == 0:
        return seed
    return (seed * 1_000_003 + 7_777_777 * share) % 2**63


@dataclass(frozen=True)
class ServerProbe:
    """What a rollout server says of itself (`RemotePolicy.probe`)."""

    model: str  # the served model's name
    version: int  # its weight version
    round_trip_s: float  # GET /v1/models, answered


class RemotePolicy:
    """The rollout worker's engine on rollout servers: `generate` as PolicyEngine.generate (one turn),
    `update_weights` on every server."""

    environment = None  # multi-turn episodes run in process (refused with servers at config time)
    device = torch.device("cpu")

    def __init__(
        self, urls: tuple[str, ...], tokenizer: Any, timeout: float, api_key: str | None = None
    ) -> None:
        import httpx2 as httpx

        self.urls, self.tokenizer, self.timeout = tuple(u.rstrip("/") for u in urls), tokenizer, timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers)
        self.pad_token_id = tokenizer.pad_token_id
        try:
            self.models = [self.probe(url).model for url in self.urls]
        except BaseException:
            self.client.close()
            raise

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
            raise RolloutServerError(
                f"rollout server {url} answered {method} {path} with HTTP {answer.status_code}: {said}"
            )
        return answer.json()

    def probe(self, url: str) -> ServerProbe:
        """`url`'s model, weight version and round-trip time, after checking it samples with this
        tokenizer (its vocabulary size, and the fingerprint of its token ids where the server gives one):
        RolloutServerError (one line) when it does not."""
        from ..models import tokenizer_fingerprint

        began = time.perf_counter()
        data = self._call(url, "GET", "/v1/models")["data"][0]
        round_trip = time.perf_counter() - began
        ours = (len(self.tokenizer), tokenizer_fingerprint(self.tokenizer))
        theirs = (data.get("vocab_size", ours[0]), data.get("tokenizer_fingerprint", ours[1]))
        if theirs != ours:
            raise RolloutServerError(
                f"rollout server {url} serves {data['id']!r} with another tokenizer (vocabulary {theirs[0]}, "
                f"fingerprint {theirs[1]}; the trainer's: {ours[0]}, {ours[1]}): serve the trainer's model "
                "(grpokit serve-policy MODEL)"
            )
        version = int(self._call(url, "GET", "/weight_version")["version"])
        return ServerProbe(str(data["id"]), version, round_trip)

    def update_weights(self, path: str, version: int) -> None:
        """Every server loads the weights at `path` (version `version`) before it samples again."""
        for url in self.urls:
            self._call(url, "POST", "/update_weights", {"path": path, "version": version})

    def generate(self, prompts: list[str], params: SamplingParams, rows: Any = None) -> Rollout:
        """G completions of each prompt, sampled on the servers (contiguous shares, one each)."""
        prompt_ids, prompt_mask, cut = tokenize_prompts(self.tokenizer, prompts, params)  # [P, Lp]
        ids = [row[mask].tolist() for row, mask in zip(prompt_ids, prompt_mask, strict=True)]
        P, N = len(ids), len(self.urls)
        bounds = [P * j // N for j in range(N + 1)]
        shares = [(j, ids[bounds[j] : bounds[j + 1]]) for j in range(N) if bounds[j + 1] > bounds[j]]
        with concurrent.futures.ThreadPoolExecutor(len(shares)) as pool:
            answers = list(pool.map(lambda share: self._sample(*share, params), shares))
        choices = [c for answer in answers for c in answer]
        G = params.num_generations
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

    def _sample(self, share: int, ids: list[list[int]], params: SamplingParams) -> list[dict[str, Any]]:
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
        choices = self._call(url, "POST", "/v1/completions", body)["choices"]
        if len(choices) != len(ids) * params.num_generations:
            raise RolloutServerError(
                f"rollout server {url} answered {len(choices)} completions for {len(ids)} prompts × n="
                f"{params.num_generations}"
            )
        return choices

    def close(self) -> None:
        self.client.close()
