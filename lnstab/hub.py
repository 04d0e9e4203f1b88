"""One request to the Hugging Face hub, shared by ``lnstab check --hf`` and the ``hf`` data source."""

from __future__ import annotations


def hub_error(repo_id: str, repo_type: str, revision: str | None = None, timeout: float = 5.0) -> Exception | None:
    """What one request for ``repo_id`` (``repo_type`` ``"model"`` or ``"dataset"``) raised, ``None`` when the hub
    knows it: no retries (huggingface_hub retries a download five times, a warning each, before it fails). The
    caller tells the hub's answers (``HfHubHTTPError``) from transport failures (unreachable)."""
    from huggingface_hub import HfApi

    try:
        HfApi().repo_info(repo_id, repo_type=repo_type, revision=revision, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - the caller judges it
        return exc
    return None
