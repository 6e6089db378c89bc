"""Make an installed SGLang's disaggregation code take its host-memory paths on device cpu.

Two conditions, each one line, each applied by matching SGLang's own source text (ours; SGLang's
files are changed in the venv only, never copied into this repository):

* `srt/disaggregation/prefill.py`, `send_kv_chunk`: the branch that copies KV page indices into
  pinned host memory and records a `torch.cuda.Event` is taken only when the indices are CUDA
  tensors. On CPU the first KV send otherwise dies on `pin_memory` / `torch.cuda.Event`.
* `srt/disaggregation/nixl/conn.py`, the KV manager's constructor: on device cpu every KV buffer
  is registered with NIXL as host memory (`DRAM`), not `VRAM` (else `register_memory` fails with
  NIXL_ERR_BACKEND).

For each condition there are three outcomes: SGLang's text is found once and changed; our text is
already there (a second run changes nothing); or the hazard the condition guards is not in this
version at all (e.g. 0.5.19 has no pinned-index branch), which is reported and fine. Anything else
(the hazard is there but the text differs, or the text is found more than once) is an error: the
script changes NO file and exits 1 naming the file and condition, so no SGLang version runs
unpatched or half patched. Usage: `python patch_sources.py [--check] [SGLANG_PACKAGE_DIR]`
(default: the `sglang` importable by this python; --check reports and writes nothing, exit 1 if
anything is unpatched).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

MARK = "# pdchaos: cpu"


@dataclass(frozen=True)
class Condition:
    name: str
    path: str  # relative to the sglang package directory
    old: str  # SGLang's text, exactly
    new: str  # ours: SGLang's text with the condition added (holds MARK)
    hazard: str  # regex: present in the file whenever the condition is needed


CONDITIONS = (
    Condition(
        name="prefill: pinned host KV indices only for CUDA tensors",
        path="srt/disaggregation/prefill.py",
        old='            if getattr(sender, "supports_host_tensor_indices", False) and not (\n',
        new=(
            '            if kv_indices.is_cuda and getattr(sender, "supports_host_tensor_indices", False) and not (  '
            + MARK
            + "\n"
        ),
        hazard=r"pin_memory=True",
    ),
    Condition(
        name="nixl: KV buffers are DRAM on device cpu",
        path="srt/disaggregation/nixl/conn.py",
        old=(
            "        self.kv_args.kv_data_mem_kinds = _normalize_kv_mem_kinds(\n"
            '            getattr(self.kv_args, "kv_data_mem_kinds", None),\n'
            "            len(self.kv_args.kv_data_ptrs),\n"
            "        )\n"
        ),
        new=(
            "        self.kv_args.kv_data_mem_kinds = _normalize_kv_mem_kinds(\n"
            '            getattr(self.kv_args, "kv_data_mem_kinds", None),\n'
            "            len(self.kv_args.kv_data_ptrs),\n"
            "        )\n"
            '        self.kv_args.kv_data_mem_kinds = ["DRAM"] * len(self.kv_args.kv_data_mem_kinds) if '
            'str(getattr(server_args, "device", "")).split(":")[0] == "cpu" else self.kv_args.kv_data_mem_kinds  '
            + MARK
            + "\n"
        ),
        hazard=r'"VRAM"',
    ),
)


@dataclass(frozen=True)
class Outcome:
    condition: Condition
    state: str  # "patch", "already", "not-needed", "error"
    detail: str = ""


def assess(package: Path, condition: Condition) -> tuple[Outcome, str | None]:
    """What to do with one condition, and the file's new text when it is to be patched."""
    path = package / condition.path
    if not path.is_file():
        return Outcome(condition, "error", f"{path} does not exist"), None
    text = path.read_text()
    if condition.new in text:
        return Outcome(condition, "already", str(path)), None
    found = text.count(condition.old)
    if found == 1:
        return Outcome(condition, "patch", str(path)), text.replace(condition.old, condition.new)
    if found > 1:
        return Outcome(condition, "error", f"SGLang's text occurs {found} times in {path}; expected once"), None
    if re.search(condition.hazard, text) is None:
        return Outcome(
            condition, "not-needed", f"{path} has no {condition.hazard!r}: this version needs no change"
        ), None
    return Outcome(
        condition,
        "error",
        f"{path} still has {condition.hazard!r} but not the text this condition was "
        "written against: read that code and update chaos/targets/sglang/cpu/"
        "patch_sources.py for this SGLang version",
    ), None


def sglang_package() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise SystemExit("patch_sources.py: no sglang importable by this python")
    return Path(spec.origin).parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", nargs="?", type=Path, help="the sglang package directory")
    parser.add_argument("--check", action="store_true", help="report only; exit 1 if anything is left to patch")
    args = parser.parse_args(argv)
    package = args.package or sglang_package()
    assessed = [assess(package, c) for c in CONDITIONS]
    for outcome, _ in assessed:
        print(f"patch_sources: {outcome.state:10} {outcome.condition.name}: {outcome.detail}")
    errors = [o for o, _ in assessed if o.state == "error"]
    if errors:
        print(
            f"patch_sources: FAILED, {len(errors)} condition(s) cannot be applied to {package}; no file was changed",
            file=sys.stderr,
        )
        return 1
    pending = [(o, text) for o, text in assessed if o.state == "patch"]
    if args.check:
        return 1 if pending else 0
    for outcome, text in pending:  # every condition was assessed first: all or nothing
        assert text is not None
        (package / outcome.condition.path).write_text(text)
    for stale in package.rglob("disaggregation/**/__pycache__/*.pyc"):
        stale.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
