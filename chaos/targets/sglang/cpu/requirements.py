"""Print the requirements of the installed `sglang` that a CPU install needs, one per line.

SGLang's wheel declares CUDA-only packages (kernels, attention libraries, NVSHMEM, ...) beside the
ones its server really imports on CPU. `make sglang-env` installs the wheel with --no-deps, then
what this prints. torch is kept with SGLang's own pin and torchvision is printed unpinned, so pip
picks the torchvision built for that torch. Run it with the SGLang venv's python.

Exit 1 when `sglang` is not installed in that interpreter, or when it declares no torch pin
(a wheel whose requirements look nothing like the ones this filter was written against).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

# Distribution names (normalised) that only make sense with CUDA, or that SGLang imports only on
# GPU paths. A name missing here is installed; a CUDA-only one that slips through shows as an
# install or import error in `make sglang-env`, never as a silent difference.
CUDA_ONLY = frozenset(
    {
        "apache-tvm-ffi",
        "cuda-python",
        "flash-attn-4",
        "flashinfer-python",
        "humming-kernels",
        "kernels",
        "numba",
        "nvidia-cutlass-dsl",
        "nvidia-mathdx",
        "nvshmem4py-cu13",
        "nvshmem4py-cu12",
        "quack-kernels",
        "sgl-deep-ep",
        "sgl-deep-gemm",
        "sgl-flash-mla",
        "sgl-kernel",
        "sglang-kernel",
        "tilelang",
        "torch-memory-saver",
        "torchaudio",
        "torchcodec",
        "cuda-tile",
        "tokenspeed-mla",
    }
)
ALWAYS_UNPINNED = frozenset({"torchvision"})
# `torch==2.13.0` also matches a local `2.13.0+cpu` build, which a machine may offer from its own
# wheel folder; torchvision's operators (which SGLang imports when it reads a model config) do not
# load on it. `===` matches the index's build only.
EXACT = frozenset({"torch"})
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def cpu_requirements(declared: list[str]) -> list[str]:
    """The declared requirements that apply here (markers evaluated, no extras), CUDA-only ones dropped."""
    from packaging.requirements import Requirement

    wanted: list[str] = []
    for text in declared:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra, or another platform
        name = normalise(req.name)
        if name in CUDA_ONLY:
            continue
        if name in ALWAYS_UNPINNED:
            wanted.append(req.name)
            continue
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        pins = [spec.version for spec in req.specifier if spec.operator == "=="]
        if name in EXACT and len(pins) == 1 and len(req.specifier) == 1:
            wanted.append(f"{req.name}{extras}==={pins[0]}")
            continue
        wanted.append(f"{req.name}{extras}{req.specifier}")
    return wanted


def main() -> int:
    try:
        declared = metadata.requires("sglang") or []
    except metadata.PackageNotFoundError:
        print("requirements.py: sglang is not installed in this interpreter", file=sys.stderr)
        return 1
    wanted = cpu_requirements(declared)
    if not any(normalise(m.group(1)) == "torch" and "===" in w for w in wanted if (m := _NAME.match(w))):
        print(
            f"requirements.py: sglang {metadata.version('sglang')} declares no pinned torch; "
            "check its requirements by hand before installing",
            file=sys.stderr,
        )
        return 1
    print("\n".join(wanted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
