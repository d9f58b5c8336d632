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
consumer that sees a description reads complete data. The folder is bounded (``sweep``, run
by each producer rank over its own files): a hand-off nobody took within ``timeout_s`` (the
decode request never came) is removed, and the oldest go first when a rank's files pass its
share of ``max_bytes``; a thread of the producer's (``Sweeper``) does it every second, idle
or not. No vLLM imports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcompress.log import get_logger
from kvcompress.paging.page_format import PageFormat

logger = get_logger(__name__)

CONNECTOR_NAME = "KVCompressConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# additional_config key holding the hand-off ({"role": ..., "path": ...}), from
# --kv-transfer-config, which kvcompress takes over (vLLM then makes no connector).
HANDOFF_KEY = "kvcompress_handoff"
# 2: pages in the row layout whatever the writer's kernel (1 held them as the kernel did).
_FORMAT = 2
# As long as vLLM's NIXL connector keeps a prefill's blocks for a decode instance that never
# reads them (VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
DEFAULT_TIMEOUT_S = 480.0


@dataclass(frozen=True)
class Handoff:
    role: str
    path: str
    timeout_s: float = DEFAULT_TIMEOUT_S  # an untaken hand-off is removed after this
    max_bytes: int | None = None  # the folder's bound (None: only the timeout)

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
        if not value:
            return None
        return cls(value["role"], value["path"],
                   float(value.get("timeout_s", DEFAULT_TIMEOUT_S)), value.get("max_bytes"))

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
        if not isinstance(extra, Mapping):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config must be an object "
                             f"({{\"path\": FOLDER, ...}}), got {extra!r}")
        path = extra.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError("--kv-transfer-config: kv_connector_extra_config.path must name "
                             "the folder both instances share (a tmpfs such as /dev/shm on "
                             f"one machine), got {path!r}")
        os.makedirs(path, exist_ok=True)
        if not os.access(path, os.W_OK):
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.path {path!r} "
                             "is not writable")
        timeout_s = _positive(extra, "timeout_s", DEFAULT_TIMEOUT_S)
        max_gib = _positive(extra, "max_gib", None)
        unknown = sorted(set(extra) - {"path", "timeout_s", "max_gib"})
        if unknown:
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config has no field "
                             f"{unknown[0]!r} (fields: path, timeout_s, max_gib)")
        max_bytes = None if max_gib is None else int(max_gib * (1 << 30))
        return cls(role, os.path.abspath(path), timeout_s, max_bytes)

    def per_rank(self, ranks: int) -> Handoff:
        """Each tensor-parallel rank bounds its own files by its share of the folder."""
        if self.max_bytes is None or ranks <= 1:
            return self
        return dataclasses.replace(self, max_bytes=self.max_bytes // ranks)

    def to_mapping(self) -> dict[str, Any]:
        return {"role": self.role, "path": self.path, "timeout_s": self.timeout_s,
                "max_bytes": self.max_bytes}


def _positive(extra: Mapping[str, Any], name: str, default: float | None) -> float | None:
    value = extra.get(name, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{name} must be a "
                         f"number > 0, got {value!r}")
    return float(value)


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


def write_rows(folder: str, key: str, rank: int, packed: torch.Tensor, *,
               page_format: PageFormat) -> int:
    """Write one rank's kept rows (``packed``: their pages in row order, laid out as
    ``page_format`` says); returns bytes. The file holds them in the row layout, which every
    kernel's pages convert to and from (``PageFormat.to_row_layout``). Nobody reads them
    before ``publish`` describes them."""
    packed = page_format.to_row_layout(packed.detach()).to("cpu").contiguous()
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
            if raw.get("format") != _FORMAT:  # another version wrote it: its pages differ
                raise ValueError(f"hand-off format {raw.get('format')!r}, not {_FORMAT}")
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


def load(folder: str, key: str, rank: int, pages: np.ndarray, pool: torch.Tensor, *,
         page_format: PageFormat) -> int:
    """Put one rank's handed-off rows onto ``pages`` (row order) of ``pool``, laid out as
    ``page_format`` says, and remove their file; returns bytes read. Raises when the data is
    missing or does not fit the pages."""
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
    packed = page_format.from_row_layout(packed.to(pool.device, non_blocking=True))
    pool.index_copy_(0, index, packed)
    return packed.numel() * packed.element_size()


def sweep(folder: str, rank: int, timeout_s: float, max_bytes: int | None,
          now: float | None = None) -> int:
    """Remove this rank's hand-offs nobody took within ``timeout_s`` of their last write (and
    writes left half done), then its oldest until its files hold at most ``max_bytes``.
    Returns the hand-offs removed. A consumer that claimed one of them just before finds
    its data gone and prefills the prompt itself (a failed import)."""
    now = time.time() if now is None else now
    suffix = f".r{rank}."
    ages: dict[str, float] = {}  # key -> newest write
    sizes: dict[str, int] = {}
    stale: list[str] = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if suffix not in entry.name:
                continue
            try:
                status = entry.stat()
            except FileNotFoundError:  # taken meanwhile
                continue
            if entry.name.endswith(".tmp"):
                if now - status.st_mtime > timeout_s:
                    stale.append(entry.path)
                continue
            key = entry.name.split(suffix, 1)[0]
            ages[key] = max(ages.get(key, 0.0), status.st_mtime)
            sizes[key] = sizes.get(key, 0) + status.st_size
    for path in stale:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    removed = [key for key, written in ages.items() if now - written > timeout_s]
    held = sum(sizes.values()) - sum(sizes[key] for key in removed)
    if max_bytes is not None and held > max_bytes:
        for key in sorted(set(ages) - set(removed), key=ages.__getitem__):
            removed.append(key)
            held -= sizes[key]
            if held <= max_bytes:
                break
    for key in removed:
        discard_rank(folder, key, rank)
    return len(removed)


class Sweeper:
    """Keeps one producer rank's files bounded (``sweep``) every ``interval_s`` from a daemon
    thread, so that a prefill instance left idle after a burst whose decode requests never
    came does not hold their rows (on a tmpfs, memory) until its next request."""

    def __init__(self, settings: Handoff, rank: int, interval_s: float = 1.0) -> None:
        self.settings = settings
        self.rank = rank
        self.interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvcompress-handoff-sweep-{rank}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval_s):
            try:
                removed = sweep(self.settings.path, self.rank, self.settings.timeout_s,
                                self.settings.max_bytes)
            except OSError:
                logger.exception("kvcompress: bounding the hand-off folder failed")
                continue
            if removed:
                logger.warning("kvcompress: removed %d hand-off(s) no decode instance took "
                               "(older than %g s, or past the folder's max_gib)", removed,
                               self.settings.timeout_s)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def handoff_fingerprint(model: str, layout: Any, dtype: Any, kv_cache_dtype: str,
                        ranks: int) -> str:
    """What both instances must share for rows to mean the same thing (``layout``: a
    ``PageLayout``): the model, its rows per rank, the page shape, the pages' dtype and
    ``--kv-cache-dtype`` (fp8_e4m3 and fp8_e5m2 pages are both uint8). Not the kernel's page
    layout: files hold the row layout."""
    return (f"{model}|rows={layout.num_rows}|page={layout.page_size}x{layout.head_size}"
            f"|{dtype}|{kv_cache_dtype}|tp={ranks}")
