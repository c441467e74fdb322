"""Static check that a Dockerfile ships the target's prebuilt C kernels
(bf16w, kquant): a stage runs ``python -m target_service.cbuild build DIR``,
and the final (runtime) stage copies DIR from that stage and sets
``SPECDEC_KERNEL_DIR=DIR``. Without them an image with no C compiler at run
time silently drops bf16w and kquant from calibration (docs/deploy.md).

    python scripts/check_dockerfile_kernels.py docker/Dockerfile [...]

Exit status 1 with the problems listed when a file fails.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

BUILD = re.compile(r"\bpython3?\s+-m\s+target_service\.cbuild\s+build\s+(\S+)")


@dataclass
class Stage:
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)


def stages(text: str) -> list[Stage]:
    """The Dockerfile's stages with their instructions (continuations joined, comments dropped)."""
    out: list[Stage] = []
    logical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        word, _, args = logical.partition(" ")
        logical = ""
        word = word.upper()
        if word == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else str(len(out))
            out.append(Stage(name))
        elif out:
            out[-1].instructions.append((word, args.strip()))
    return out


def env_values(args: str) -> dict[str, str]:
    """``ENV K=V K2=V2`` (or the legacy ``ENV K V``) as a dict."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words if "=" in w)


def problems(text: str) -> list[str]:
    """What is missing for the image to ship its kernels ([] when nothing)."""
    st = stages(text)
    if not st:
        return ["no FROM instruction"]
    built: dict[str, str] = {}  # stage -> kernel dir it builds
    for s in st:
        for word, args in s.instructions:
            if word == "RUN" and (m := BUILD.search(args)):
                built[s.name] = m.group(1).rstrip("/")
    if not built:
        return ["no stage runs `python -m target_service.cbuild build DIR`"]
    runtime = st[-1]
    found: list[str] = []
    env: dict[str, str] = {}
    copied = set()
    for word, args in runtime.instructions:
        if word == "ENV":
            env.update(env_values(args))
        if word == "COPY":
            words = args.split()
            src = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
            paths = [w.rstrip("/") for w in words if not w.startswith("--")]
            if src in built and built[src] in paths[:-1] and paths[-1] == built[src]:
                copied.add(built[src])
    if runtime.name in built:
        copied.add(built[runtime.name])
    if not copied:
        found.append(f"the runtime stage {runtime.name!r} does not copy the kernel dir "
                     f"({', '.join(sorted(set(built.values())))}) from the stage that builds it")
    kdir = env.get("SPECDEC_KERNEL_DIR", "").rstrip("/")
    if not kdir:
        found.append(f"the runtime stage {runtime.name!r} does not set SPECDEC_KERNEL_DIR")
    elif copied and kdir not in copied:
        found.append(f"SPECDEC_KERNEL_DIR={kdir} is not the kernel dir the runtime stage copies ({', '.join(copied)})")
    return found


def main(argv: list[str]) -> int:
    bad = 0
    for path in argv:
        for p in problems(Path(path).read_text()):
            print(f"{path}: {p}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
