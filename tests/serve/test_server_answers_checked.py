"""A rollout server's answers are checked, not trusted (engine/remote.py), and `grpokit serve-policy`
refuses what it cannot do right (serve/policy.py): a server restarted behind its URL is sent its
weights again, another run's weights, another tokenizer or an edited answer end the run in one line, a
weight file that is not the model's changes nothing, and requests it cannot serve as asked are 400s.
Over the test-made Qwen2 chat model (tests/serve/conftest.py), on this machine's loopback."""

from __future__ import annotations

import json
import math
from contextlib import closing

import httpx2 as httpx
import pytest
import torch

from grpokit.config.specs import SamplingParams
from grpokit.engine.remote import RemotePolicy, RolloutServerError
from grpokit.models import tokenizer_fingerprint
from grpokit.serve.policy import PolicyServer

pytestmark = pytest.mark.loopback
NAME = "tiny-qwen"
PROMPTS = ["12+3=", "7+8="]
SAMPLED = SamplingParams(num_generations=2, max_completion_length=4, seed=5)  # B = 4 rows
GREEDY = SamplingParams(num_generations=1, max_completion_length=6, temperature=0.0)


def _quiet(_: str) -> None:
    """A server's log, unread."""


@pytest.fixture
def original(engine):
    """The engine's weights, put back after the test (a test's updates change them in place)."""
    kept = {k: v.clone() for k, v in engine.module.state_dict().items()}
    yield kept
    engine.module.load_state_dict(kept)


@pytest.fixture
def server(engine, original):
    with PolicyServer(engine, NAME, log=_quiet) as running:
        yield running


@pytest.fixture(scope="module")
def reading_server(engine):
    """One server for the tests that only sample (none updates its weights)."""
    with PolicyServer(engine, NAME, log=_quiet) as running:
        yield running


def _base(server: PolicyServer) -> str:
    return server.url.rstrip("/")


def _remote(server: PolicyServer, engine) -> RemotePolicy:
    return RemotePolicy((server.url,), engine.tokenizer, 30.0)


def _unique_state(engine) -> dict[str, torch.Tensor]:
    """The engine's weights as the trainer writes them (async_rollout.publish_weights): tied weights
    once, under their first name."""
    seen: set[int] = set()
    unique = {}
    for name, tensor in engine.module.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor.detach().clone()
    return unique


def _write_weights(engine, path, scale: float) -> str:
    """Weights × `scale` (another version of the policy: every weight differs) written to `path`."""
    from safetensors.torch import save_file

    save_file({k: v * scale for k, v in _unique_state(engine).items()}, str(path))
    return str(path)


def _rows(rollout) -> list[list[int]]:
    """Each row's completion token ids (up to and including its EOS)."""
    return [
        ids[mask].tolist() for ids, mask in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
    ]


def _restarted(server: PolicyServer, engine, original) -> PolicyServer:
    """`server` stopped and a new one started on its port with the model's own weights, as a server
    restarted behind its URL is."""
    port = server.port
    server.close()
    engine.module.load_state_dict(original)
    return PolicyServer(engine, NAME, port=port, log=_quiet).start()


# ----------------------------------------------------------------------------- weights and tokenizer


def test_a_server_restarted_behind_its_url_is_sent_the_weights_again(engine, original, tmp_path):
    """Sent version 1, then restarted (its own weights, version 0): the next batch is asked again once
    version 1 is sent again, and is what version 1 samples, not what the restarted weights do."""
    own = _rows(engine.generate(PROMPTS, GREEDY))  # the model's own weights
    path = _write_weights(engine, tmp_path / "weights-v1.safetensors", -1.0)
    first = PolicyServer(engine, NAME, log=_quiet).start()
    with closing(_remote(first, engine)) as remote:
        remote.update_weights(path, 1)
        sent = remote.generate(PROMPTS, GREEDY)
        assert _rows(sent) != own  # (the two versions sample apart: a restart would show)
        restarted = _restarted(first, engine, original)
        try:
            again = remote.generate(PROMPTS, GREEDY)
            assert _rows(again) == _rows(sent) and torch.equal(again.sampling_logps, sent.sampling_logps)
            assert (restarted.version, restarted.sender) == (1, remote.sender)
            assert restarted.decodes == 2  # with its own weights (refused), then with version 1
        finally:
            restarted.close()


def test_a_restarted_server_whose_weights_file_is_gone_ends_the_run_naming_both_versions(
    engine, original, tmp_path
):
    path = tmp_path / "weights-v3.safetensors"
    first = PolicyServer(engine, NAME, log=_quiet).start()
    with closing(_remote(first, engine)) as remote:
        remote.update_weights(_write_weights(engine, path, -1.0), 3)
        url = _base(first)
        path.unlink()  # (the trainer keeps only the versions in flight)
        restarted = _restarted(first, engine, original)
        try:
            with pytest.raises(RolloutServerError) as raised:
                remote.generate(PROMPTS, GREEDY)
        finally:
            restarted.close()
    said = str(raised.value)
    assert "\n" not in said
    assert said.startswith(
        f"rollout server {url} sampled with weight version 0, not version 3 this run sent it"
    )
    assert "sending them again failed" in said and f"{path} is not a file" in said


def test_two_runs_sharing_a_server_are_told_apart_even_at_the_same_version(engine, server, tmp_path):
    """Two trainers send their own version 1 to one server: the first one's next batch would be sampled
    with the second one's weights, and is refused in one line; an eval client that sent nothing sees
    its server's weights changed."""
    evaluating = _remote(server, engine)
    first, second = _remote(server, engine), _remote(server, engine)
    with closing(evaluating), closing(first), closing(second):
        first.update_weights(_write_weights(engine, tmp_path / "a.safetensors", -1.0), 1)
        second.update_weights(_write_weights(engine, tmp_path / "b.safetensors", 0.5), 1)
        with pytest.raises(RolloutServerError) as raised:
            first.generate(PROMPTS, GREEDY)
        assert second.generate(PROMPTS, GREEDY).completions  # its own weights: sampled
        with pytest.raises(RolloutServerError, match="not version 0 it held when this began"):
            evaluating.generate(PROMPTS, GREEDY)
    said = str(raised.value)
    assert "\n" not in said and said == (
        f"rollout server {_base(server)} sampled with weight version 1 that another client sent, not "
        "version 1 this run sent it: two runs share this server? give each run a server of its own"
    )


def test_a_server_restarted_with_another_tokenizer_is_refused_on_its_next_answer(engine, server):
    with closing(_remote(server, engine)) as remote:  # probed: the trainer's tokenizer
        server.fingerprint = "0" * 16  # as a server restarted on another model's tokenizer says
        with pytest.raises(RolloutServerError) as raised:
            remote.generate(PROMPTS, GREEDY)
    said = str(raised.value)
    assert "\n" not in said and said.startswith(
        f'rollout server {_base(server)} sampled with another tokenizer (fingerprint "{"0" * 16}"; the '
        f"trainer's: {tokenizer_fingerprint(engine.tokenizer)})"
    )


@pytest.mark.parametrize("tail", ["v1", "v1/"])
def test_the_v1_url_serve_policy_prints_is_the_server(engine, server, tail):
    with closing(RemotePolicy((server.url + tail,), engine.tokenizer, 30.0)) as remote:
        assert remote.urls == (_base(server),)
        rollout = remote.generate(PROMPTS, SAMPLED)
    assert _rows(rollout) == _rows(engine.generate(PROMPTS, SAMPLED))  # (one server: the seed's draw)


# ----------------------------------------------------------------------------- answers edited on the way


def _row3(edit):
    """`edit(choice, decode)` applied to the answer's last completion (row 3 of the batch)."""
    return lambda choices, decode: edit(choices[3], decode)


def _set_id(value):
    return _row3(lambda c, _: c["token_ids"].__setitem__(0, value(c["token_ids"][0])))


def _set_logp(value):
    return _row3(lambda c, _: c["logprobs"]["token_logprobs"].__setitem__(0, value))


def _over_long(choice: dict, decode) -> None:
    """5 tokens (max_tokens=4), everything else consistent with them: log-probs, reason, text."""
    extra = 5 - len(choice["token_ids"])
    choice["token_ids"] += [choice["token_ids"][0]] * extra
    choice["logprobs"]["token_logprobs"] += [-1.0] * extra
    choice.update(finish_reason="length", text=decode(choice["token_ids"]))


EDITS = [
    (
        "an id beyond the vocabulary",
        _set_id(lambda _: 10**6),
        "token id 1000000 is not an integer from 0 to 469",
    ),
    ("a negative id", _set_id(lambda _: -1), "token id -1 is not an integer from 0 to 469"),
    ("a float id", _set_id(float), ".0 is not an integer from 0 to 469"),
    ("a bool id", _set_id(lambda _: True), "token id true is not an integer from 0 to 469"),
    ("a log-prob too few", _row3(lambda c, _: c["logprobs"]["token_logprobs"].pop()), " log-probs for "),
    ("a positive log-prob", _set_logp(0.5), "log-prob 0.5 is not a finite number ≤ 0"),
    ("a log-prob above round-off", _set_logp(2e-6), "log-prob 2e-06 is not a finite number ≤ 0"),
    ("a NaN log-prob", _set_logp(math.nan), "log-prob NaN is not a finite number ≤ 0"),
    ("a completion over max_tokens", _row3(_over_long), "5 token ids, not 1 to max_tokens=4"),
    ("a text its ids do not decode to", _row3(lambda c, _: c.update(text=c["text"] + " 42")), "its text "),
    ("an unknown finish reason", _row3(lambda c, _: c.update(finish_reason="eos")), 'finish_reason "eos"'),
    ("completions out of order", lambda choices, _: choices.reverse(), "it is not a completion of index 0"),
]


class _EditingProxy(httpx.BaseTransport):
    """A proxy that passes every request on to the server and applies `edit(choices, decode)` to each
    completions answer (`decode`: token ids -> their true text)."""

    def __init__(self, tokenizer, edit) -> None:
        self.real, self.tokenizer, self.edit = httpx.Client(timeout=60), tokenizer, edit

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self.real.request(request.method, str(request.url), content=request.content)
        if request.url.path != "/v1/completions" or answer.status_code != 200:
            return httpx.Response(answer.status_code, content=answer.content, headers=answer.headers)
        body = answer.json()
        self.edit(body["choices"], lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        content = json.dumps(body).encode()  # (NaN written as JavaScript's NaN, which json reads back)
        return httpx.Response(200, content=content, headers={"content-type": "application/json"})

    def close(self) -> None:
        self.real.close()


def _through_proxy(remote: RemotePolicy, tokenizer, edit) -> None:
    """`remote` reaches its server through an _EditingProxy from now on."""
    remote.client.close()
    remote.client = httpx.Client(transport=_EditingProxy(tokenizer, edit))


@pytest.mark.parametrize(("what", "edit", "fault"), EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_answer_is_refused_in_one_line_naming_the_server_the_row_and_the_fault(
    engine, reading_server, what, edit, fault
):
    server = reading_server
    with closing(_remote(server, engine)) as remote:
        _through_proxy(remote, engine.tokenizer, edit)
        with pytest.raises(RolloutServerError) as raised:
            remote.generate(PROMPTS, SAMPLED)
    said = str(raised.value)
    row = 0 if what == "completions out of order" else 3
    assert "\n" not in said and said.startswith(
        f"rollout server {_base(server)} answered a completion no decode gives (row {row} of the batch): "
    )
    assert fault in said


@pytest.mark.parametrize("round_off", [None, 1e-7], ids=["as answered", "a log-prob 1e-7 above 0"])
def test_an_honest_answer_passes_every_check(engine, reading_server, round_off):
    """The server's own answer (rows ending at EOS and at max_tokens alike) is the in-process draw; a
    log-prob a round-off above 0 (LOGP_ROUNDOFF) is let through."""
    server = reading_server
    expected = engine.generate(PROMPTS, SAMPLED)
    with closing(_remote(server, engine)) as remote:
        if round_off is not None:
            _through_proxy(remote, engine.tokenizer, _set_logp(round_off))
        rollout = remote.generate(PROMPTS, SAMPLED)
    assert _rows(rollout) == _rows(expected) and rollout.completions == expected.completions
    assert rollout.truncated.tolist() == expected.truncated.tolist()
    assert set(expected.truncated.tolist()) == {True, False}  # ("length" and "stop" answers both checked)
    logps = expected.sampling_logps.clone()
    if round_off is not None:
        logps[3, 0] = round_off
    assert torch.equal(rollout.sampling_logps, logps)


# ----------------------------------------------------------------------------- weight updates


def _update(server: PolicyServer, path, version: int = 7) -> httpx.Response:
    body = {"path": str(path), "version": version, "sender": "run-a"}
    return httpx.post(f"{_base(server)}/update_weights", json=body, timeout=60)


def _wrong_shape(tensors: dict) -> None:
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:32]


def _nan(tensors: dict) -> None:
    tensors["model.norm.weight"][5] = math.nan


def _int8(tensors: dict) -> None:
    for name in tensors:
        tensors[name] = tensors[name].to(torch.int8)


FILE_FAULTS = [
    ("a wrong shape", _wrong_shape, "'model.norm.weight' has shape [32], not the model's [64]"),
    (
        "an extra tensor",
        lambda t: t.update({"model.extra.weight": torch.zeros(2)}),
        "it holds 1 tensor(s) the model does not have, such as 'model.extra.weight'",
    ),
    (
        "a missing tensor",
        lambda t: t.pop("model.norm.weight"),
        "it lacks 1 of the model's tensors, such as 'model.norm.weight'",
    ),
    (
        "int8 weights",
        _int8,
        "'model.embed_tokens.weight' is I8, not a floating type the model's torch.float32 can take",
    ),
    ("a NaN", _nan, "'model.norm.weight' holds values that are not finite (NaN or inf)"),
]


@pytest.mark.parametrize(("what", "spoil", "fault"), FILE_FAULTS, ids=[f[0] for f in FILE_FAULTS])
def test_a_refused_update_changes_no_weight(engine, original, server, tmp_path, what, spoil, fault):
    """Every weight of the file differs from the server's (a whole new version), one fault in it (last
    in name order, where it is one tensor): 400, every weight bitwise as it was, version 0 kept."""
    from safetensors.torch import save_file

    tensors = {k: -v for k, v in _unique_state(engine).items()}
    spoil(tensors)
    path = tmp_path / "spoiled.safetensors"
    save_file(tensors, str(path))
    answer = _update(server, path)
    held = engine.module.state_dict()
    assert all(torch.equal(held[k], original[k]) for k in original)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "path" and "\n" not in error["message"]
    assert error["message"] == f"cannot load {path}: {fault}; no weight was changed (version 0 kept)"
    assert httpx.get(f"{_base(server)}/weight_version").json() == {"version": 0, "sender": None}


def test_a_whole_update_in_another_float_type_is_cast_and_applied(engine, original, server, tmp_path):
    """The trainer's weights in bfloat16, tied weights under one name: every weight replaced (cast to
    the server's float32), the tied head with the embedding, the version and its sender said."""
    from safetensors.torch import save_file

    tensors = {k: (-v).to(torch.bfloat16) for k, v in _unique_state(engine).items()}
    save_file(tensors, str(tmp_path / "weights-v7.safetensors"))
    answer = _update(server, tmp_path / "weights-v7.safetensors")
    assert answer.status_code == 200 and answer.json() == {"version": 7, "sender": "run-a"}
    held = engine.module.state_dict()
    assert all(torch.equal(held[k], tensors[k].float()) for k in tensors)
    assert torch.equal(held["lm_head.weight"], tensors["model.embed_tokens.weight"].float())
    said = httpx.post(f"{_base(server)}/v1/completions", json={"prompt": "1+1=", "max_tokens": 2}).json()
    assert (said["weight_version"], said["weight_sender"]) == (7, "run-a")


# ----------------------------------------------------------------------------- requests it cannot serve


class _Counting:
    """A tokenizer that counts the characters it is asked to tokenize."""

    def __init__(self, inner) -> None:
        self.inner, self.characters = inner, 0

    def __call__(self, texts, **kwargs):
        self.characters += sum(len(t) for t in texts)
        return self.inner(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _refused(answer: httpx.Response, param: str) -> str:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and "\n" not in error["message"]
    return error["message"]


def test_a_text_prompt_too_long_for_the_model_is_refused_before_it_is_tokenized(engine, server):
    """512 positions, tokens of at most 18 characters: a text of 9,217 characters cannot fit, and is
    refused without tokenizing it (a 20 MB prompt would hold the server for every client)."""
    positions = engine.module.config.max_position_embeddings
    assert (positions, max(len(t) for t in engine.tokenizer.get_vocab())) == (512, 18)
    counting = server.tokenizer = _Counting(server.tokenizer)
    base = _base(server)
    said = _refused(httpx.post(f"{base}/v1/completions", json={"prompt": "1" * 9217}), "prompt")
    assert said == (
        "a text prompt of 9217 characters cannot fit the model's 512 positions (a token here is at most 18 "
        "characters): send a shorter one"
    )
    chat = {"messages": [{"role": "user", "content": "1" * 9217}]}
    assert "cannot fit the model's 512 positions" in _refused(
        httpx.post(f"{base}/v1/chat/completions", json=chat), "messages"
    )
    assert counting.characters == 0
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "1+1=", "max_tokens": 2}).status_code == 200


def test_chat_content_as_a_list_of_text_parts_is_its_texts_joined(engine, server):
    """OpenAI's content parts: the text parts joined by newlines (as vLLM joins them), the same answer
    as that text; an image part is refused, named."""
    base = _base(server)
    body = {"max_tokens": 4, "seed": 3, "return_token_ids": True}
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+3?"}]
    as_parts = httpx.post(
        f"{base}/v1/chat/completions", json=body | {"messages": [{"role": "user", "content": parts}]}
    )
    as_text = httpx.post(
        f"{base}/v1/chat/completions",
        json=body | {"messages": [{"role": "user", "content": "What is\n2+3?"}]},
    )
    assert as_parts.status_code == 200, as_parts.text
    got, expected = as_parts.json()["choices"][0], as_text.json()["choices"][0]
    assert (got["prompt_token_ids"], got["token_ids"]) == (
        expected["prompt_token_ids"],
        expected["token_ids"],
    )
    image = parts + [{"type": "image_url", "image_url": {"url": "file:///cat.png"}}]
    said = _refused(
        httpx.post(
            f"{base}/v1/chat/completions", json=body | {"messages": [{"role": "user", "content": image}]}
        ),
        "messages",
    )
    assert said == 'messages[0].content[2] is a "image_url" part: only text parts are served'


UNUSED = [
    ("/v1/completions", "echo", True, False),
    ("/v1/completions", "suffix", "!", None),
    ("/v1/completions", "best_of", 3, 1),
    ("/v1/completions", "frequency_penalty", 0.5, 0),
    ("/v1/completions", "logit_bias", {"5": 100}, {}),
    ("/v1/chat/completions", "presence_penalty", 1.0, 0.0),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}], []),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}, {"type": "text"}),
]


@pytest.mark.parametrize(("route", "option", "value", "default"), UNUSED, ids=[u[1] for u in UNUSED])
def test_openai_options_it_does_not_implement_are_refused_not_ignored(server, route, option, value, default):
    body = {"max_tokens": 2} | (
        {"prompt": "1+1="}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    said = _refused(httpx.post(f"{_base(server)}{route}", json=body | {option: value}), option)
    assert said.startswith(f"{option} is not supported by this server: leave it out")
    assert httpx.post(f"{_base(server)}{route}", json=body | {option: default}).status_code == 200
