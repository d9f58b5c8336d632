"""The native sources compile, without a GPU: the CUDA kernel with nvcc for sm_80 / sm_90,
the torch binding and the module stub with the host compiler against the installed torch's
headers (syntax only: this torch may be a CPU build, nothing is linked).

All compilers start together (module fixture) and each test waits for its own.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

CSRC = Path(__file__).resolve().parents[2] / "csrc"
ARCHS = ("sm_80", "sm_90")
# Every (word, index) instantiation of the kernel: 5 word sizes x 2 slot dtypes.
KERNEL_INSTANTIATIONS = 10


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    home = cpp_extension.CUDA_HOME or os.environ.get("CUDA_HOME")
    if found is None and home and Path(home, "bin", "nvcc").exists():
        found = str(Path(home, "bin", "nvcc"))
    return found


NVCC = _nvcc()
CXX = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
needs_nvcc = pytest.mark.skipif(
    NVCC is None, reason="nvcc not found (no CUDA toolkit): the kernel compile check is skipped"
)
needs_cxx = pytest.mark.skipif(CXX is None, reason="no host C++ compiler (g++ / c++) found")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[subprocess.Popen, Path]]:
    out = tmp_path_factory.mktemp("csrc")
    commands: dict[str, tuple[list[str], Path]] = {}
    if NVCC is not None:
        for arch in ARCHS:
            cubin = out / f"move_kv_kernel.{arch}.cubin"
            commands[arch] = ([
                NVCC, "-std=c++17", "-O3", f"-arch={arch}", "-cubin", "-Werror", "all-warnings",
                "-I", str(CSRC), str(CSRC / "move_kv_kernel.cu"), "-o", str(cubin),
            ], cubin)
    if CXX is not None:
        torch_includes = [flag for path in cpp_extension.include_paths()
                          for flag in ("-isystem", path)]
        python_include = ["-isystem", sysconfig.get_paths()["include"]]
        for name in ("move_kv_binding.cpp", "module.cpp"):
            commands[name] = ([
                CXX, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror",
                "-I", str(CSRC), *torch_includes, *python_include, str(CSRC / name),
            ], out / name)
    return {
        name: (subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True), target)
        for name, (command, target) in commands.items()
    }


def _wait(jobs, name: str) -> Path:
    process, target = jobs[name]
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, f"{' '.join(process.args)}\n{output}"
    return target


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_kernel_compiles_to_cubin(jobs, arch):
    cubin = _wait(jobs, arch).read_bytes()
    kernels = set(re.findall(rb"_Z\w*move_kv_kernel\w*", cubin))
    assert len(kernels) == KERNEL_INSTANTIATIONS, sorted(kernels)


@needs_cxx
def test_torch_binding_compiles_without_cuda_headers(jobs):
    _wait(jobs, "move_kv_binding.cpp")


@needs_cxx
def test_python_module_stub_compiles(jobs):
    _wait(jobs, "module.cpp")


def test_setup_builds_the_extension_only_with_cuda_torch_and_a_toolkit(monkeypatch):
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("kvcompress_setup", CSRC.parent / "setup.py")
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)  # not __main__: defines the helpers, builds nothing
    for name in setup_py.CUDA_SOURCES:
        assert (CSRC.parent / name).is_file(), name
    monkeypatch.setenv("KVCOMPRESS_BUILD_CUDA", "0")
    assert setup_py.cuda_extension_kwargs() == {}
    if torch.version.cuda is None:
        assert "not a CUDA build" in setup_py.why_no_cuda_extension()
        monkeypatch.setenv("KVCOMPRESS_BUILD_CUDA", "auto")
        assert setup_py.cuda_extension_kwargs() == {}  # skipped, no compiler run
        monkeypatch.setenv("KVCOMPRESS_BUILD_CUDA", "1")
        with pytest.raises(RuntimeError, match="not a CUDA build"):
            setup_py.cuda_extension_kwargs()
