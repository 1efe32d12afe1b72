"""A small Dockerfile reader for the checks: instructions with their continuation lines joined.

No Docker engine runs here, so the checks read the file the way `docker build` would parse it: comments
dropped, backslash continuations joined, one (INSTRUCTION, arguments) pair per instruction.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    name: str   # upper case: FROM, COPY, RUN, ...
    args: str   # the rest of the instruction, continuations joined with a space

    def words(self) -> list[str]:
        """Exec form (a JSON array) or shell form, split into words."""
        text = self.args.strip()
        if text.startswith("["):
            return [str(w) for w in json.loads(text)]
        return shlex.split(text)


def parse(path: Path) -> list[Instruction]:
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction is dropped by the parser too
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        name, _, args = full.partition(" ")
        out.append(Instruction(name.upper(), args.strip()))
    if pending:
        raise ValueError(f"{path}: the last instruction ends with a continuation backslash")
    return out


def comments(path: Path) -> str:
    """All comment text, for what the file documents rather than does (e.g. the stop timeout)."""
    return "\n".join(line.strip()[1:].strip() for line in path.read_text(encoding="utf-8").splitlines()
                     if line.strip().startswith("#"))


def last(instructions: list[Instruction], name: str) -> Instruction | None:
    found = [i for i in instructions if i.name == name]
    return found[-1] if found else None


def copy_sources(instruction: Instruction) -> list[str]:
    """The source paths of a COPY/ADD (flags such as --chown and the destination left out)."""
    words = [w for w in instruction.words() if not w.startswith("--")]
    return words[:-1]
