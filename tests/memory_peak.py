"""Peak bytes of the tensors live during a block of code, on any device (CPU included, where
torch keeps no allocator statistics).

``LiveBytes`` is a dispatch mode: every tensor an operation returns is counted by its
storage's bytes from then until the storage is freed, so the peak is what the block held at
once on top of what existed before it (inputs are not counted). Workspaces a kernel allocates
inside one operation and frees before returning are not seen; a sort's outputs are.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._held: set[int] = set()  # data pointers of the storages counted

    def _freed(self, pointer: int, size: int) -> None:
        self.live -= size
        self._held.discard(pointer)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Views and in-place results share a storage of their inputs: not new memory.
        inputs = {tensor.untyped_storage().data_ptr()
                  for tensor in tree_flatten((args, kwargs))[0]
                  if isinstance(tensor, torch.Tensor) and not tensor.is_meta}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                continue
            storage = tensor.untyped_storage()
            pointer, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or pointer in self._held or pointer in inputs:
                continue
            self._held.add(pointer)
            self.live += size
            weakref.finalize(storage, self._freed, pointer, size)
        self.peak = max(self.peak, self.live)
        return out
