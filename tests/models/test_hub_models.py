"""Models by hub id, through a Hugging Face cache made in the test (tests/hub_cache.py): byte-level BPE
tokenizers, chat templates, EOS from the generation config, pad ≠ EOS, tied and untied heads."""

from __future__ import annotations

import pytest
import torch

from grpokit.engine import EngineSpec, PolicyEngine
from grpokit.envs import EnvironmentSpec
from grpokit.models import LeanBackend, backend_of, load_policy, load_reward_model
from grpokit.models.hf import ModelSource
from grpokit.rollout import Decoder, SamplingParams
from grpokit.rollout.decode import eos_and_pad
from tests.hub_cache import LLAMA, QWEN, REVISION


def test_a_hub_id_loads_from_the_cache_offline_with_its_tokens(hub_offline):
    qwen = load_policy(QWEN)
    assert type(qwen.model).__name__ == "Qwen2ForCausalLM"
    assert type(qwen.tokenizer.backend_tokenizer.model).__name__ == "BPE"
    assert qwen.model.lm_head.weight is qwen.model.model.embed_tokens.weight  # tied, as Qwen2.5-0.5B
    ids = qwen.tokenizer.convert_tokens_to_ids
    # EOS from the generation config (both ids), pad its own token: pad ≠ EOS
    assert eos_and_pad(qwen.model, qwen.tokenizer) == (
        [ids("<|im_end|>"), ids("<|endoftext|>")],
        ids("<|endoftext|>"),
    )
    assert qwen.tokenizer.padding_side == "left"

    llama = load_policy(LLAMA, revision=REVISION)
    assert type(llama.model).__name__ == "LlamaForCausalLM"
    assert llama.model.lm_head.weight is not llama.model.model.embed_tokens.weight  # untied
    ids = llama.tokenizer.convert_tokens_to_ids
    eos, pad = eos_and_pad(llama.model, llama.tokenizer)
    assert eos == [ids("<|end_of_text|>"), ids("<|eot_id|>")] and pad == ids("<|eot_id|>")  # no pad: EOS pads
    text = llama.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith(
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
    )


@pytest.mark.parametrize("repo", [QWEN, LLAMA])
def test_the_lean_backend_equals_transformers_on_the_hub_models(hub_offline, repo):
    """Qwen2's qkv bias and tied head, Llama's untied head, GQA: the lean forward the trainer uses gives
    transformers' logits to float32 round-off, over left-padded prompts."""
    loaded = load_policy(repo)
    model, tok = loaded.model, loaded.tokenizer
    backend = backend_of(model)
    assert isinstance(backend, LeanBackend)
    prompts = ["What is 12 + 34?", "Natalia sold clips to 48 of her friends"]
    encoded = tok(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"].bool()  # [2, L] left-padded
    targets = torch.randint(0, len(tok), (2, 5), generator=torch.Generator().manual_seed(0))
    attended = torch.ones_like(targets, dtype=torch.bool)
    with torch.no_grad():
        hidden = backend.hidden(ids, mask, targets, attended, 1)  # [2, 5, H]
        lean = torch.nn.functional.linear(hidden, backend.head.weight, backend.head.bias)
        full = torch.cat([mask, attended], dim=1).long()
        positions = (full.cumsum(-1) - 1).clamp(min=0)
        reference = model(input_ids=torch.cat([ids, targets], 1), attention_mask=full, position_ids=positions)
    torch.testing.assert_close(lean, reference.logits[:, ids.shape[1] - 1 : -1], rtol=0, atol=2e-5)


def test_a_missing_hub_id_offline_is_one_line_naming_the_cache_and_the_download(hub_offline):
    with pytest.raises(ValueError) as caught:
        load_policy("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(caught.value)
    assert "\n" not in message
    for part in (
        "'Qwen/Qwen2.5-0.5B-Instruct'",
        str(hub_offline / "hub"),
        "HF_HUB_OFFLINE=1",
        "hf download Qwen/Qwen2.5-0.5B-Instruct",
    ):
        assert part in message, part
    with pytest.raises(ValueError, match=r"at revision 'v9'.*hf download tiny-org/qwen2-chat --revision v9"):
        load_policy(QWEN, revision="v9")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1"):
        load_reward_model("org/missing-reward-model")


def test_online_failures_name_the_id_the_cache_and_what_to_check(hub_offline, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    error = ModelSource.of("org/gated", "main").failure(OSError("401 Client Error: gated repo\nmore"))
    message = str(error)
    assert "\n" not in message and "'org/gated' at revision 'main'" in message
    assert (
        "401 Client Error: gated repo" in message
        and "HF_TOKEN" in message
        and str(hub_offline / "hub") in message
    )


@pytest.mark.parametrize("name", ["./runs/missing", "runs/a/b", "/no/such/dir", "not a model"])
def test_what_is_neither_a_directory_nor_a_hub_id_is_refused(name):
    with pytest.raises(FileNotFoundError, match="does not exist; give a local model directory or a hub id"):
        ModelSource.of(name)


def _eos_likely(model, eos: int, scale: float = 6.0) -> None:
    """Make EOS frequent in a random model (its output row scaled): turns then end at random places."""
    with torch.no_grad():
        model.get_output_embeddings().weight[eos] *= scale


@pytest.mark.parametrize("repo", [QWEN, LLAMA])
def test_the_loss_mask_ends_at_the_first_eos_decoded(hub_offline, repo):
    """completion_mask covers each completion up to and including its first EOS (any of the generation
    config's), nothing after; the masked tokens decode to the completion text."""
    loaded = load_policy(repo)
    model, tok = loaded.model, loaded.tokenizer
    eos_ids, pad = eos_and_pad(model, tok)
    _eos_likely(model, eos_ids[0])
    engine = PolicyEngine.create(model, tok, EngineSpec())
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 7 * 8?"}], tokenize=False, add_generation_prompt=True
    )
    r = engine.generate(
        [prompt, "Solve: 3 + 4 ="], SamplingParams(num_generations=8, max_completion_length=12, seed=1)
    )
    ended = 0
    for b in range(r.completion_ids.shape[0]):
        ids, mask = r.completion_ids[b].tolist(), r.completion_mask[b].tolist()
        first = next((t for t, i in enumerate(ids) if i in eos_ids), None)
        n = len(ids) if first is None else first + 1
        assert mask == [True] * n + [False] * (len(ids) - n), b
        assert all(i == pad for i in ids[n:])
        assert bool(r.truncated[b]) == (first is None and n == 12)
        assert r.completions[b] == tok.decode(ids[:n], skip_special_tokens=True)
        ended += first is not None
    assert 0 < ended < r.completion_ids.shape[0]  # the case is exercised both ways


class Quoting:
    """Answers each turn with a fixed observation whose BPE tokens differ from what re-tokenising the
    joined transcript would give (a leading space merges with the policy's last token otherwise). A
    policy turn ends at EOS or at an "e" in its text, inside a BPE token or across two."""

    stop_strings = ("e",)

    def reset(self, row, seed):
        return ""

    def step(self, text):
        return " answer 46.", 0.0, False


def test_multi_turn_observations_are_appended_as_their_own_tokens(hub_offline):
    """Token in, token out: each observation's ids are exactly the tokenizer's ids of its text, placed
    after the turn's EOS; the loss mask is the policy's tokens and nothing else; no re-tokenising."""
    loaded = load_policy(QWEN)
    model, tok = loaded.model, loaded.tokenizer
    eos_ids, _ = eos_and_pad(model, tok)
    spec = EnvironmentSpec(Quoting, max_turns=3, stop_strings=Quoting.stop_strings)
    decoder = Decoder(backend_of(model), tok, environment=spec)
    r = decoder.sample(
        ["What is 12 + 34?"], SamplingParams(num_generations=4, max_completion_length=40, seed=0), [{}]
    )
    observation = tok(" answer 46.", add_special_tokens=False)["input_ids"]
    checked = 0
    for b in range(4):
        n = int(r.attention[b].sum())
        ids, mask = r.completion_ids[b, :n].tolist(), r.completion_mask[b, :n].tolist()
        t, start = 0, 0
        while t < n:
            if mask[t]:
                t += 1
                continue
            end = t
            while end < n and not mask[end]:
                end += 1
            turn = tok.decode(ids[start:t], skip_special_tokens=True)
            assert ids[t - 1] in eos_ids or "e" in turn  # the turn ended at EOS or its stop string...
            assert "e" not in tok.decode(ids[start : t - 1], skip_special_tokens=True)  # ...and not before
            assert ids[t:end] == observation[: end - t]  # its own tokens (cut only by the budget)
            checked += 1
            t = start = end
    assert checked > 0


@pytest.mark.parametrize("repo", [QWEN, LLAMA])
def test_a_stop_string_split_over_bpe_tokens_ends_the_turn_where_it_completes(hub_offline, repo):
    """On the real byte-level BPE tokenizers: a stop string that takes several tokens (and one merged
    with the text after it) ends the turn at the draw that completes it, never before."""
    from types import SimpleNamespace

    from grpokit.rollout.decode import StopStrings

    tokenizer = load_policy(repo).tokenizer
    stop = "</answer>"
    for text in ("I think 7 </answer>", "so 7</answer>\n\nok"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = [tokenizer.decode(ids[: k + 1]) for k in range(len(ids))]
        done = next(k for k, p in enumerate(pieces) if stop in p)  # the token that completes it
        assert not any(stop in tokenizer.decode([i]) for i in ids), "not split: the test needs a split stop"
        fired = []
        for k in range(len(ids)):  # one draw at a time, as the decode loop calls it
            columns = torch.tensor([k + 1])
            run = SimpleNamespace(
                rows=SimpleNamespace(column=columns, finished=torch.zeros(1, dtype=torch.bool)),
                tape=SimpleNamespace(tokens=torch.tensor([ids + [0] * 4])),
            )
            check = StopStrings(tokenizer, (stop,), run, [0])
            check.before = [k]
            check()
            fired.append(bool(run.rows.finished[0]))
        assert fired == [k >= done for k in range(len(ids))], (text, [tokenizer.decode([i]) for i in ids])


def test_a_teacher_and_a_reward_model_load_by_hub_id_at_a_revision(hub_offline):
    """teacher_model_revision and a reward_funcs model entry's `revision` reach the loader: the
    revision the cache holds loads (the teacher's shape, its engine, the reward model's scores), one
    it lacks is one line naming it."""
    from grpokit.config import GRPOConfig
    from grpokit.config.plan import EngineSpec, grpo_plan
    from grpokit.rewards import RewardModelFunction
    from grpokit.train.distributed import Dist
    from grpokit.train.grpo_setup import load_teacher, teacher_shape
    from grpokit.train.inputs import configured_rewards

    def plan(revision):
        cfg = GRPOConfig(model=QWEN, loss_type="opd", teacher_model=LLAMA, teacher_model_revision=revision)
        return grpo_plan(cfg)

    good = plan(REVISION)
    assert good.teacher.model.revision == REVISION and good.model.revision is None
    assert teacher_shape(good).vocab_size == load_policy(LLAMA).model.config.vocab_size
    tokenizer = load_policy(LLAMA).tokenizer
    engine = load_teacher(good.teacher, tokenizer, EngineSpec(), Dist(device=torch.device("cpu")))
    assert type(engine.module).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match=rf"'{LLAMA}' at revision 'v9'.*--revision v9"):
        teacher_shape(plan("v9"))

    entry = GRPOConfig(reward_funcs=[{"model": QWEN, "revision": REVISION, "device": "cpu"}])
    (scorer,) = configured_rewards(grpo_plan(entry).rewards, None, torch.device("cpu"))
    assert isinstance(scorer, RewardModelFunction)
    assert len(scorer(prompts=["2+2?"], completions=["4"])) == 1
    with pytest.raises(ValueError, match=r"at revision 'v9'"):
        missing = GRPOConfig(reward_funcs=[{"model": QWEN, "revision": "v9", "device": "cpu"}])
        configured_rewards(grpo_plan(missing).rewards, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="teacher_model_revision is read only with teacher_model"):
        GRPOConfig(teacher_model_revision=REVISION)
    with pytest.raises(ValueError, match="must have exactly one of"):
        GRPOConfig(reward_funcs=[{"builtin": "exact_answer", "revision": REVISION}])


def test_a_cached_model_that_fails_to_load_offline_is_not_called_missing(hub_offline):
    """Offline, a model the cache holds but cannot load (here its weights cut short, as an interrupted
    download leaves them) is named with its own error, not as absent from the cache."""
    from tests.hub_cache import snapshot

    weights = snapshot(hub_offline, QWEN) / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:1000])
    try:
        with pytest.raises(ValueError) as caught:
            load_policy(QWEN)
    finally:
        weights.write_bytes(whole)  # the cache is shared by the session's tests
    message = str(caught.value)
    assert "\n" not in message and "is not in the Hugging Face cache" not in message, message
    assert f"could not load model '{QWEN}' from the Hugging Face cache" in message, message
    assert f"hf download {QWEN}" in message, message


def test_lora_on_a_tied_output_layer_is_refused_and_on_an_untied_one_taken(hub_offline):
    """Qwen2's output layer is its input embeddings (tied): an adapter on it would split the matrix in
    the merged checkpoint, so naming it is one line; the Llama's untied head takes one."""
    pytest.importorskip("peft")
    from grpokit.models import apply_lora

    with pytest.raises(ValueError, match=r"names lm_head: in this model the output layer and the input"):
        apply_lora(load_policy(QWEN).model, target_modules=("q_proj", "lm_head"))
    adapted = apply_lora(load_policy(LLAMA).model, target_modules=("q_proj", "lm_head"))
    assert any("lm_head.lora_A" in name for name, _ in adapted.named_parameters())
