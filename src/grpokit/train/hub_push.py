"""`push_to_hub`: at the end of a run, the final checkpoint's model (weights, config, tokenizer with
its chat template, generation config, the run's config.yaml) is uploaded to the Hugging Face Hub
through huggingface_hub, as `Trainer.push_to_hub` does for a TRL user. The optimizer and trainer
state stay local. The upload comes after everything is saved, so a failed one loses nothing: its one
line names the checkpoint and the `hf upload` command that finishes the job by hand. An offline
setting is refused before any work, not found at the end of a long run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..config.plan import RunControl
from .checkpoint import list_checkpoints

# a checkpoint's files that only resuming reads: not the model a user loads
# (a LoRA run's adapters too: their base is the run's, after any warm start, not the model they name)
LOCAL_ONLY = ["state.pt", "manifest.json", "dcp/*", "dcp/**", "lora_adapter/*", "lora_adapter/**"]


class HubPushError(ValueError):
    """The upload failed; the run itself is saved."""


def repo_id_of(control: RunControl) -> str:
    """hub_model_id, or (as TRL does) output_dir's last folder name, under the logged-in account."""
    return control.hub_model_id or Path(control.output_dir).resolve().name


def check_push(control: RunControl) -> None:
    """Before any work: a push that cannot happen is said now (one line), not after the run."""
    if control.push_to_hub and os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {
        "1",
        "true",
        "yes",
        "on",
    }:
        raise ValueError(
            f"push_to_hub=true but HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']}: the upload to "
            f"{repo_id_of(control)} could not happen. Unset HF_HUB_OFFLINE, or set push_to_hub=false "
            "and upload the final checkpoint later with `hf upload`."
        )


def new_api() -> Any:
    """huggingface_hub's client, with the login's token (`hf auth login` or HF_TOKEN)."""
    from huggingface_hub import HfApi

    return HfApi()


def push_final(
    control: RunControl, *, main: bool = True, stopped: bool = False, api: Any = None
) -> str | None:
    """Uploads the newest checkpoint's model files of a finished run, from the main process; returns
    the repository's id (None: no push asked, another rank, or a run stopped by a signal, which is
    resumed rather than published). `api`: a huggingface_hub `HfApi` (default: one with the login)."""
    if not (control.push_to_hub and main and not stopped):
        return None
    output_dir = Path(control.output_dir)
    checkpoints = list_checkpoints(output_dir)
    if not checkpoints:
        raise HubPushError(f"push_to_hub: {output_dir} holds no checkpoint to upload.")
    final, repo_id = checkpoints[-1], repo_id_of(control)
    api = new_api() if api is None else api
    try:
        url = api.create_repo(repo_id, private=control.hub_private_repo, exist_ok=True)
        repo_id = getattr(url, "repo_id", None) or repo_id
        api.upload_folder(
            repo_id=repo_id,
            folder_path=str(final),
            ignore_patterns=LOCAL_ONLY,
            commit_message=f"grpokit: {final.name} of {output_dir.name}",
        )
    except Exception as error:  # noqa: BLE001 - any failure of the hub client becomes the one line below
        first = (str(error).strip().splitlines() or [""])[0]
        excluded = " ".join(f"'{pattern}'" for pattern in LOCAL_ONLY)
        raise HubPushError(
            f"push_to_hub: uploading {final} to {repo_id} failed ({type(error).__name__}: {first}). The "
            f"run is saved; upload it with `hf upload {repo_id} {final} --exclude {excluded}` once that is "
            "fixed (a login: `hf auth login` or HF_TOKEN)."
        ) from error
    return repo_id
