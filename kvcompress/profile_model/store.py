"""Where a model's query profile and score surrogate are found, for a model named as vLLM users
name it: a local folder, or a Hugging Face hub id resolved in the local hub cache as vLLM
resolves it (no network is asked).

A file is looked for, in order: where the flag names it (``--kv-surrogate``, ``--kv-profile``),
in the user's cache (``KVCOMPRESS_CACHE``, by default ``$XDG_CACHE_HOME/kvcompress`` or
``~/.cache/kvcompress``), keyed by the model's fingerprint (``profiles.model_fingerprint``,
so a copy of the same checkpoint anywhere finds it), then beside a local model folder.
``python -m kvcompress.profile_model MODEL`` writes beside a folder the user named, and into
the cache for a hub id (never inside the hub cache's snapshot). No vLLM imports.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvcompress.profile_model.profiles import PROFILE_FILE, model_fingerprint
from kvcompress.profile_model.surrogates import SURROGATE_FILE

CACHE_ENV = "KVCOMPRESS_CACHE"
# What the cache keeps, by kind: its folder in the cache and its file name beside a model.
FILES = {"surrogate": ("surrogates", SURROGATE_FILE), "profile": ("profiles", PROFILE_FILE)}


def cache_dir() -> Path:
    """The user's kvcompress cache."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvcompress"


def model_folder(model: str | os.PathLike[str]) -> Path | None:
    """The model's local folder: ``model`` itself, or the snapshot of hub id ``model`` in the
    local Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``); None when neither exists."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        # (The hub cache is read from the environment now: huggingface_hub reads it once,
        # at its import.)
        return Path(snapshot_download(str(model), local_files_only=True,
                                      cache_dir=os.environ.get("HF_HUB_CACHE") or None))
    except Exception:  # not a hub id, or not in the local cache
        return None


def is_hub_id(model: str | os.PathLike[str]) -> bool:
    """Whether ``model`` names a hub model rather than a local folder."""
    return not Path(model).expanduser().is_dir()


def cached_path(kind: str, folder: Path) -> Path:
    """Where the cache keeps the ``kind`` ("surrogate", "profile") of the model in
    ``folder``."""
    subfolder, _ = FILES[kind]
    return cache_dir() / subfolder / f"{model_fingerprint(folder)}.pt"


def beside_path(kind: str, folder: Path) -> Path:
    return folder / FILES[kind][1]


def candidates(kind: str, folder: Path) -> list[Path]:
    """Where a ``kind`` of the model in ``folder`` is looked for, in order."""
    return [cached_path(kind, folder), beside_path(kind, folder)]


def default_out(kind: str, model: str | os.PathLike[str], folder: Path) -> Path:
    """Where ``profile_model`` writes a ``kind``: beside a folder the user named, in the
    cache for a hub id."""
    return cached_path(kind, folder) if is_hub_id(model) else beside_path(kind, folder)


def make_command(model: str | os.PathLike[str]) -> str:
    return f"python -m kvcompress.profile_model {model}"
