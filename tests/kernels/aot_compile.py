"""Compile the Triton kernels for a GPU target without a GPU (Triton frontend + LLVM + ptxas).

The interpreter checks numerics but accepts code a GPU compile rejects (non-constexpr globals,
dot shapes, type mismatches in loops) and says nothing about registers or shared memory. This
captures the launches a launcher makes with CPU tensors and compiles them ahead of time.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


@dataclass
class CapturedLaunch:
    kernel: Any  # triton JITFunction
    args: tuple
    kwargs: dict = field(default_factory=dict)

    def compile(self, arch: int = 90):
        import triton
        from triton.backends.compiler import BaseBackend, GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import native_specialize_impl

        names = self.kernel.arg_names
        values = dict(zip(names, self.args, strict=False)) | {
            k: v for k, v in self.kwargs.items() if k not in LAUNCH_OPTIONS
        }
        # Specialize like a real launch: 16-byte aligned pointers and ints divisible by 16 get
        # tt.divisibility (this is what enables vector loads), ints equal to 1 become constexpr.
        signature, constexprs, attrs = {}, {}, {}
        for index, param in enumerate(self.kernel.params):
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[param.name] = value
                continue
            kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
            signature[param.name] = kind
            if kind == "constexpr":
                constexprs[param.name] = spec
            elif spec:
                attrs[(index,)] = BaseBackend.parse_attr(spec)
        options = {k: v for k, v in self.kwargs.items() if k in LAUNCH_OPTIONS and v is not None}
        source = ASTSource(self.kernel, signature, constexprs, attrs)
        return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


class _Recorder:
    def __init__(self, kernel, launches: list[CapturedLaunch]):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(CapturedLaunch(self.kernel, args, kwargs))

        return launch


class _RecordingModule:
    def __init__(self, module, launches: list[CapturedLaunch]):
        self._module, self._launches = module, launches

    def __getattr__(self, name):
        value = getattr(self._module, name)
        return _Recorder(value, self._launches) if hasattr(value, "arg_names") else value


@contextlib.contextmanager
def capture_launches(monkeypatch):
    """Within: launchers record their kernel launches (compiled-mode kernels) instead of running."""
    from kvcompress.kernels import _triton_support

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the current default, minus its warning
    launches: list[CapturedLaunch] = []
    real_loader = _triton_support.load_kernel_module
    for module_name in ("paged_attention", "decode_mass", "window_scores", "write_kv", "move_kv"):
        module = __import__(f"kvcompress.kernels.{module_name}", fromlist=["_"])
        monkeypatch.setattr(module, "check_triton_device", lambda *tensors: None)
        monkeypatch.setattr(
            module, "load_kernel_module", lambda name: _RecordingModule(real_loader(name), launches)
        )
    assert not os.environ.get("TRITON_INTERPRET")
    yield launches
