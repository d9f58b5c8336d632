"""Prefill/decode hand-off of compressed caches (``--kv-transfer-config`` naming
``KVCompressConnector``): the store both sides of a hand-off meet in, a folder.

A **producer** (prefill instance) writes, for every prompt it completes, each rank's kept rows
after the prompt's compaction (``write_rows``: the pages of every row in row order, packed in
one tensor), then, once the token after the prompt is sampled, what they are (``publish``: per
row the tokens kept, the prompt's length, that first token, the request's settings). A
**consumer** (decode instance) given the same prompt finds them by the prompt's tokens
(``prompt_key``), takes them (``claim``: each hand-off is read once), files them as a
prefix-cache entry of the whole prompt and continues the request from the producer's first
token, as one instance continues after its prefill: the first token was sampled from the
whole prompt's K/V, the next from the compressed rows. Its worker loads the rows onto the
entry's fresh pages before the step that reads them (``load``). The proxy
(``kvcompress.disagg_proxy``) sends a request to the producer with ``max_tokens=1``, then to
the consumer, as vLLM's disaggregated-serving proxies do. Only kept tokens move.

Files are written under a temporary name and renamed, the data before its description: a
consumer that sees a description reads complete data. No vLLM imports.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

CONNECTOR_NAME = "KVCompressConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# additional_config key holding the hand-off ({"role": ..., "path": ...}), from
# --kv-transfer-config, which kvcompress takes over (vLLM then makes no connector).
HANDOFF_KEY = "kvcompress_handoff"
_FORMAT = 1


@dataclass(frozen=True)
class Handoff:
    role: str
    path: str

    @property
    def produces(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None
                               ) -> Handoff | None:
        value = (additional_config or {}).get(HANDOFF_KEY)
        return None if not value else cls(value["role"], value["path"])

    @classmethod
    def from_transfer_config(cls, transfer: Any) -> Handoff:
        """``--kv-transfer-config`` (vLLM's KVTransferConfig or its dict) naming our connector;
        raises ValueError naming the field otherwise."""
        def field_of(name: str) -> Any:
            return _field(transfer, name)

        connector = field_of("kv_connector")
        if connector != CONNECTOR_NAME:
            raise ValueError(
                f"--kv-transfer-config: kv_connector {connector!r} cannot carry compressed "
                f"per-head pages (vLLM's connectors move whole blocks, one token range across "
                f"all heads); with --kv-compression use \"kv_connector\": \"{CONNECTOR_NAME}\"")
        role = field_of("kv_role")
        if role not in ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(ROLES)}, "
                             f"got {role!r}")
        extra = field_of("kv_connector_extra_config") or {}
        path = extra.get("path") if isinstance(extra, Mapping) else None
        if not isinstance(path, str) or not path:
            raise ValueError("--kv-transfer-config: kv_connector_extra_config.path must name "
                             "the folder both instances share (a tmpfs such as /dev/shm on "
                             f"one machine), got {path!r}")
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.path {path!r} "
                             "is not writable")
        return cls(role, os.path.abspath(path))

    def to_mapping(self) -> dict[str, str]:
        return {"role": self.role, "path": self.path}


def _field(transfer: Any, name: str) -> Any:
    return transfer.get(name) if isinstance(transfer, Mapping) else getattr(transfer, name, None)


def names_our_connector(transfer: Any) -> bool:
    """Whether a --kv-transfer-config names ``KVCompressConnector``."""
    return bool(transfer) and _field(transfer, "kv_connector") == CONNECTOR_NAME


def prompt_key(tokens: Sequence[int] | np.ndarray) -> str:
    """The name a prompt's hand-off is stored under: a digest of its token ids."""
    data = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64)).tobytes()
    return hashlib.sha256(data).hexdigest()[:40]


@dataclass(frozen=True)
class Described:
    """One rank's hand-off as its description says: what the consumer's scheduler files and
    the token its request continues from."""

    lengths: np.ndarray  # int64 per row, tokens kept
    prompt_len: int
    first_token: int  # what the prefill instance sampled after the prompt
    fingerprint: str
    settings: dict[str, Any]


def _data_path(folder: str, key: str, rank: int) -> str:
    return os.path.join(folder, f"{key}.r{rank}.pt")


def _description_path(folder: str, key: str, rank: int) -> str:
    return os.path.join(folder, f"{key}.r{rank}.json")


def _replace_atomically(path: str, write: Any) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def write_rows(folder: str, key: str, rank: int, packed: torch.Tensor) -> int:
    """Write one rank's kept rows (``packed``: their pages in row order); returns bytes.
    Nobody reads them before ``publish`` describes them."""
    packed = packed.detach().to("cpu").contiguous()
    _replace_atomically(_data_path(folder, key, rank), lambda path: torch.save(packed, path))
    return packed.numel() * packed.element_size()


def publish(folder: str, key: str, rank: int, part: Described) -> None:
    """Describe one rank's rows (written first): from now on a consumer may take them."""
    description = {"format": _FORMAT, "lengths": [int(n) for n in part.lengths],
                   "prompt_len": part.prompt_len, "first_token": part.first_token,
                   "fingerprint": part.fingerprint, "settings": part.settings}

    def write_description(path: str) -> None:
        with open(path, "w") as file:
            json.dump(description, file)

    _replace_atomically(_description_path(folder, key, rank), write_description)


def claim(folder: str, key: str, ranks: int) -> list[Described] | None:
    """Take the hand-off stored under ``key`` (every rank's description, removed: nobody
    else takes it), or None when there is none, it is incomplete, or another consumer took
    it first. Its data stays until ``load`` (or ``discard``)."""
    paths = [_description_path(folder, key, rank) for rank in range(ranks)]
    if not all(os.path.exists(path) for path in paths):
        return None
    described = []
    try:
        for path in paths:
            with open(path) as file:
                raw = json.load(file)
            os.remove(path)
            described.append(Described(np.asarray(raw["lengths"], dtype=np.int64),
                                       int(raw["prompt_len"]), int(raw["first_token"]),
                                       str(raw["fingerprint"]), dict(raw["settings"])))
    except (OSError, ValueError, KeyError, TypeError):
        discard(folder, key, ranks)
        return None
    return described


def discard(folder: str, key: str, ranks: int) -> None:
    """Remove a hand-off's files (taken but not filed)."""
    for rank in range(ranks):
        discard_rank(folder, key, rank)


def discard_rank(folder: str, key: str, rank: int) -> None:
    for path in (_description_path(folder, key, rank), _data_path(folder, key, rank)):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def load(folder: str, key: str, rank: int, pages: np.ndarray, pool: torch.Tensor) -> int:
    """Put one rank's handed-off rows onto ``pages`` (row order) of ``pool`` and remove their
    file; returns bytes read. Raises when the data is missing or does not fit the pages."""
    path = _data_path(folder, key, rank)
    try:
        packed = torch.load(path, map_location="cpu", weights_only=True)
    finally:
        if os.path.exists(path):
            os.remove(path)
    if (not isinstance(packed, torch.Tensor) or packed.shape[0] != len(pages)
            or packed.shape[1:] != pool.shape[1:] or packed.dtype != pool.dtype):
        raise ValueError(f"hand-off {key} (rank {rank}) does not fit its {len(pages)} pages")
    index = torch.from_numpy(np.asarray(pages, dtype=np.int64)).to(pool.device)
    pool.index_copy_(0, index, packed.to(pool.device, non_blocking=True))
    return packed.numel() * packed.element_size()


def handoff_fingerprint(model: str, layout: Any, dtype: Any, ranks: int) -> str:
    """What both instances must share for rows to mean the same thing (``layout``: a
    ``PageLayout``): the model, its rows per rank, the page shape and dtype."""
    return (f"{model}|rows={layout.num_rows}|page={layout.page_size}x{layout.head_size}"
            f"|{dtype}|tp={ranks}")
