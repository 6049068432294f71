"""Policies, tokenizers and the reference policy."""

from __future__ import annotations

import pytest
import torch

from grpokit.models import (
    build_policy,
    char_tokenizer,
    load_policy,
    make_reference,
    save_policy,
    should_sync,
    sync_reference,
)


def test_char_tokenizer_round_trip(tmp_path):
    tok = char_tokenizer("0123456789+=")
    ids = tok("12+3=")["input_ids"]
    assert ids == [5, 6, 14, 7, 15]  # <pad>=0 <bos>=1 <eos>=2 <unk>=3, then the alphabet in order
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "12+3="
    assert tok("7x")["input_ids"] == [11, tok.unk_token_id]
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert again("12+3=")["input_ids"] == ids and again.pad_token_id == 0 and again.eos_token_id == 2
    with pytest.raises(ValueError, match="non-empty alphabet"):
        char_tokenizer("")


def test_build_policy_is_deterministic_for_a_seed():
    a = build_policy(hidden_size=16, num_layers=1, num_heads=2, vocab_size=20, max_seq_len=32, seed=5)
    b = build_policy(hidden_size=16, num_layers=1, num_heads=2, vocab_size=20, max_seq_len=32, seed=5)
    c = build_policy(hidden_size=16, num_layers=1, num_heads=2, vocab_size=20, max_seq_len=32, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))
    assert a.config.num_hidden_layers == 1 and a.config.vocab_size == 20


def test_build_policy_defaults_are_edifices():
    import inspect

    defaults = {k: p.default for k, p in inspect.signature(build_policy).parameters.items()}
    assert {
        k: defaults[k]
        for k in ("hidden_size", "num_layers", "num_heads", "vocab_size", "dropout", "max_seq_len")
    } == {
        "hidden_size": 512,
        "num_layers": 6,
        "num_heads": 8,
        "vocab_size": 32000,
        "dropout": 0.1,
        "max_seq_len": 2048,
    }


def test_saved_and_loaded_policy_gives_identical_logits(tmp_path, tiny_policy):
    model, tok = tiny_policy
    save_policy(model, tok, tmp_path / "policy")
    assert (tmp_path / "policy" / "model.safetensors").is_file()
    loaded = load_policy(tmp_path / "policy")
    ids = tok(["12+3=", "99+99="], padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(**ids).logits, loaded.model(**ids).logits)
    assert loaded.tokenizer.padding_side == "left"


def test_load_policy_errors_name_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_policy(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_policy(tmp_path / "empty")


def test_tokenizer_without_pad_gets_eos_as_pad(tmp_path, tiny_policy, caplog):
    model, tok = tiny_policy
    save_policy(model, tok, tmp_path)
    import json

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["pad_token"] = None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    special = tmp_path / "special_tokens_map.json"
    if special.exists():
        data = json.loads(special.read_text())
        data.pop("pad_token", None)
        special.write_text(json.dumps(data))
    with caplog.at_level("INFO"):
        loaded = load_policy(tmp_path)
    assert loaded.tokenizer.pad_token == loaded.tokenizer.eos_token
    assert "no pad token" in caplog.text


def test_reference_policy_is_frozen_or_absent(tiny_policy):
    model, _ = tiny_policy
    assert make_reference(model, beta=0.0) is None
    ref = make_reference(model, beta=0.04)
    assert ref is not model and not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters(), strict=True))


def test_sync_reference_mixes_weights():
    policy, ref = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with torch.no_grad():
        for p in policy.parameters():
            p.fill_(1.0)
        for p in ref.parameters():
            p.fill_(3.0)
    sync_reference(ref, policy, alpha=0.6)  # 0.6·1 + 0.4·3 = 1.8
    assert all(torch.allclose(p, torch.full_like(p, 1.8)) for p in ref.parameters())
    assert [should_sync(s, 4) for s in range(1, 9)] == [False, False, False, True, False, False, False, True]
    with pytest.raises(ValueError, match="alpha"):
        sync_reference(ref, policy, alpha=1.5)


def test_lora_reference_is_the_policy_with_adapters_disabled(tiny_policy):
    pytest.importorskip("peft")
    import copy

    from grpokit.models import apply_lora, is_lora, reference_model

    base, tok = tiny_policy
    policy = apply_lora(copy.deepcopy(base), r=2, alpha=4, target_modules=("q_proj", "v_proj"))
    assert is_lora(policy) and make_reference(policy, beta=0.04) is None
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():  # make the adapters matter: LoRA starts as an identity (B = 0)
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    ids = tok(["12+3="], return_tensors="pt")["input_ids"]
    base.eval()
    policy.eval()
    with torch.no_grad():
        reference_logits = base(ids).logits
        with reference_model(policy, None) as ref:
            assert torch.allclose(ref(ids).logits, reference_logits, atol=1e-6)
        assert not torch.allclose(policy(ids).logits, reference_logits, atol=1e-3)
    with pytest.raises(ValueError, match="no reference policy"), reference_model(base, None):
        pass
