"""push_to_hub (issue 25, point 4): at the end of a finished run the final checkpoint's model is
uploaded through huggingface_hub's HfApi (`hub_push.new_api`), without the optimizer and trainer
state, and what is uploaded loads with transformers' Auto classes. The hub is never reached here:
the client is replaced by a recorder that copies what upload_folder would send. A push that cannot
happen (offline) is refused before any work, and a failed upload loses nothing and says how to
finish it by hand."""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

import pytest
import torch

from grpokit.config import GRPOConfig
from grpokit.train.grpo import train_grpo
from grpokit.train.hub_push import HubPushError
from tests.train.helpers import ones_reward, tiny_config


class FakeHub:
    """Records create_repo and upload_folder, and copies the files upload_folder would send."""

    def __init__(self, into: Path, fail: Exception | None = None) -> None:
        self.into, self.fail, self.calls = into, fail, []

    def create_repo(self, repo_id, private=None, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private, exist_ok))
        return type("RepoUrl", (), {"repo_id": repo_id if "/" in repo_id else f"someone/{repo_id}"})()

    def upload_folder(self, repo_id, folder_path, ignore_patterns=(), commit_message=""):
        self.calls.append(("upload_folder", repo_id, Path(folder_path).name, commit_message))
        if self.fail is not None:
            raise self.fail
        root = Path(folder_path)
        for path in root.rglob("*"):
            name = path.relative_to(root).as_posix()
            if path.is_file() and not any(fnmatch.fnmatch(name, p) for p in ignore_patterns):
                (self.into / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, self.into / name)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    fake = FakeHub(tmp_path / "pushed")
    monkeypatch.setattr("grpokit.train.hub_push.new_api", lambda: fake)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return fake


def test_a_finished_run_uploads_its_final_model_and_it_loads(tmp_path, hub):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tiny_config(
        tmp_path, max_steps=2, push_to_hub=True, hub_model_id="me/tiny-grpo", hub_private_repo=True
    )
    train_grpo(cfg, reward_funcs=[ones_reward])
    assert hub.calls == [
        ("create_repo", "me/tiny-grpo", True, True),
        ("upload_folder", "me/tiny-grpo", "checkpoint-2", "grpokit: checkpoint-2 of run"),
    ]
    pushed = {p.name for p in hub.into.iterdir()}
    assert "model.safetensors" in pushed and "config.json" in pushed
    assert not pushed & {"state.pt", "manifest.json"}  # resuming state stays local
    model = AutoModelForCausalLM.from_pretrained(hub.into)
    tokenizer = AutoTokenizer.from_pretrained(hub.into)
    assert model.config.vocab_size >= len(tokenizer)


def test_without_hub_model_id_the_repository_is_named_after_output_dir(tmp_path, hub):
    cfg = tiny_config(tmp_path, max_steps=1, push_to_hub=True)
    train_grpo(cfg, reward_funcs=[ones_reward])
    assert hub.calls[0] == ("create_repo", "run", None, True)
    assert hub.calls[1][1] == "someone/run"  # the account the hub put it under


def test_offline_push_is_refused_before_any_work(tmp_path, hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = tiny_config(tmp_path, max_steps=1, push_to_hub=True, hub_model_id="me/x")
    with pytest.raises(ValueError, match=r"push_to_hub=true but HF_HUB_OFFLINE=1: the upload to me/x"):
        train_grpo(cfg, reward_funcs=[ones_reward])
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and hub.calls == []


def test_a_failed_upload_keeps_the_run_and_says_how_to_finish(tmp_path, hub):
    hub.fail = OSError("401 Client Error: Unauthorized\nmore detail")
    cfg = tiny_config(tmp_path, max_steps=1, push_to_hub=True, hub_model_id="me/x")
    with pytest.raises(HubPushError) as raised:
        train_grpo(cfg, reward_funcs=[ones_reward])
    line = str(raised.value)
    assert "\n" not in line and "OSError: 401 Client Error: Unauthorized)" in line
    assert f"`hf upload me/x {tmp_path / 'run' / 'checkpoint-1'} --exclude 'state.pt' 'manifest.json'" in line
    assert (tmp_path / "run" / "checkpoint-1" / "state.pt").is_file()  # nothing lost


def test_hub_options_without_push_to_hub_are_one_line():
    with pytest.raises(
        ValueError, match="hub_model_id and hub_private_repo only apply with push_to_hub=true"
    ):
        GRPOConfig(hub_model_id="me/x")


def test_a_lora_run_uploads_the_merged_model_alone(tmp_path, hub):
    """What transformers loads from the upload is the trained model (adapters merged); the adapter
    files and the base copy for resume stay local (the adapters' base is the run's, after any warm
    start, not the model their config names)."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(
        tmp_path,
        max_steps=1,
        push_to_hub=True,
        hub_model_id="me/x",
        use_peft=True,
        lora_r=2,
        learning_rate=0.1,
    )
    train_grpo(cfg, reward_funcs=[ones_reward])
    pushed = sorted(p.relative_to(hub.into).as_posix() for p in hub.into.rglob("*") if p.is_file())
    assert "model.safetensors" in pushed and not [p for p in pushed if p.startswith("lora_adapter")]
    checkpoint = tmp_path / "run" / "checkpoint-1"
    merged = load_file(checkpoint / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(hub.into)
    assert all(torch.equal(v, merged[k]) for k, v in model.state_dict().items() if k in merged)
    base = load_file(checkpoint / "lora_adapter" / "base" / "model.safetensors")
    assert any(not torch.equal(base[k], merged[k]) for k in base)  # the adapters are in it
