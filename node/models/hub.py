"""Can a Hub model be had right now? Asked once, in seconds, before any download starts.

Without this, a machine with no network spends half a minute in huggingface_hub's
retries ("Retrying in 8s") before the first error. One short HTTP request to the Hub's
endpoint (``HF_ENDPOINT``, default https://huggingface.co) tells whether it answers; a
model already in the local Hugging Face cache is then loaded from there, offline.
"""

from __future__ import annotations

import logging
import os

from node.models.cache import ModelLoadError

__all__ = ["PROBE_TIMEOUT_S", "hub_endpoint", "hub_load_options", "in_local_cache", "offline_requested"]

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 4.0
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
LOCAL_CHOICES = "tiny-s, tiny-m, tiny-l, tiny-alt or smollm2-135m-embedded"


def offline_requested() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set to a true value."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in _OFFLINE_VARS)


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def in_local_cache(hf_id: str) -> bool:
    """Whether the model's config is in the local Hugging Face cache (a cheap sign it was downloaded)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(hf_id, "config.json"), str)


def _hub_problem(timeout: float) -> str | None:
    """None if the Hub's endpoint answers HTTP at all, else why not."""
    import httpx

    url = hub_endpoint()
    try:
        httpx.head(url, timeout=timeout, follow_redirects=False)
    except httpx.HTTPError as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        return f"{url} does not answer ({reason})"
    return None


def hub_load_options(hf_id: str, timeout: float = PROBE_TIMEOUT_S) -> dict[str, bool]:
    """The ``from_pretrained`` options for a Hub model, or ModelLoadError at once when it cannot be had.

    ``{"local_files_only": True}`` when offline was asked for or the Hub does not answer
    but the model is cached; ``{}`` when the Hub answers.
    """
    if offline_requested():
        if not in_local_cache(hf_id):
            raise ModelLoadError(
                f"cannot load {hf_id!r}: HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache. "
                "No network? Pass a local model folder (--model /path/to/folder) or a model the project builds: "
                + LOCAL_CHOICES
            )
        return {"local_files_only": True}
    problem = _hub_problem(timeout)
    if problem is None:
        return {}
    if in_local_cache(hf_id):
        logger.warning("the Hugging Face Hub is unreachable (%s); loading %s from the local cache", problem, hf_id)
        return {"local_files_only": True}
    raise ModelLoadError(
        f"cannot download {hf_id!r}: the Hugging Face Hub at {problem} and the model is not in the local cache. "
        f"No network? Pass a local model folder (--model /path/to/folder, e.g. one saved with save_pretrained) "
        f"or a model the project builds: {LOCAL_CHOICES}"
    )
