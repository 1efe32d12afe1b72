"""The Dockerfile, read (no Docker engine here, and none is pretended): no weights copied in, the locked torch
is the one pyproject pins, a non-root user, a health check on a real route, and the stop timeout documented.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
from settingskit import make_settings

from inferd.api.app import create_app

from .dockerfile import Instruction, comments, copy_sources, last, parse
from .k8s_objects import ROOT, SHUTDOWN_MARGIN_S

DOCKERFILE = ROOT / "Dockerfile"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".onnx", ".gguf", ".h5")
# Where weights would sit in the build context if someone put them there.
WEIGHT_PATHS = ["models/all-MiniLM-L6-v2/model.safetensors", "models/x/pytorch_model.bin",
                "weights.safetensors", "src/inferd/model.pt", "checkpoints/model.onnx"]


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse(DOCKERFILE)


def dockerignore() -> list[str]:
    return [line.strip() for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified to what .dockerignore uses: the last matching pattern wins, `!` re-includes,
    a pattern matches the path or any of its parent folders, `**/` matches any depth."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        candidates = [pat] + ([pat[3:]] if pat.startswith("**/") else [])
        hit = any(fnmatch.fnmatchcase(p, c) or fnmatch.fnmatchcase(p.rsplit("/", 1)[-1], c)
                  if "/" not in c else fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates)
        if hit:
            verdict = not negate
    return verdict


def test_no_weights_are_copied_into_the_image(instructions: list[Instruction]) -> None:
    copies = [i for i in instructions if i.name in ("COPY", "ADD")]
    assert copies, "the Dockerfile copies nothing: the parser is wrong"
    for copy in copies:
        for source in copy_sources(copy):
            name = source.rstrip("/")
            assert name not in (".", "models") and not name.startswith("models/"), f"{copy.name} {copy.args}"
            assert not name.endswith(WEIGHT_SUFFIXES), f"{copy.name} {copy.args} copies weights"
    assert not any(i.name == "ADD" and "://" in i.args for i in instructions), "no downloads at build time"
    assert not any(i.name == "RUN" and re.search(r"\b(wget|curl|huggingface-cli|snapshot_download)\b", i.args)
                   for i in instructions), "no model downloads at build time"


def test_dockerignore_keeps_model_files_out_of_the_build_context() -> None:
    patterns = dockerignore()
    for path in WEIGHT_PATHS:
        assert ignored(path, patterns), f".dockerignore lets {path} into the build context"
    # ...and still sends what the image needs.
    for path in ("src/inferd/cli.py", "configs/base.yaml", "requirements.txt", "pyproject.toml"):
        assert not ignored(path, patterns), f".dockerignore drops {path}, which the Dockerfile copies"


def test_the_dockerignore_matcher_can_say_no() -> None:
    assert not ignored("models/x.safetensors", ["*.bin"])
    assert ignored("models/x.safetensors", ["models/"])
    assert not ignored("models/x.safetensors", ["models/", "!models/x.safetensors"])


def pin(line_source: str, package: str) -> str | None:
    match = re.search(rf"^\s*\"?{package}==([^\s\";,]+)", line_source, re.MULTILINE)
    return match.group(1) if match else None


def test_the_locked_torch_is_the_one_pyproject_pins(instructions: list[Instruction]) -> None:
    # The image installs requirements.txt (the lock); pyproject's pin is what `pip install .` would demand.
    assert any(i.name == "RUN" and "-r requirements.txt" in i.args for i in instructions)
    locked = pin((ROOT / "requirements.txt").read_text(encoding="utf-8"), "torch")
    pinned = pin((ROOT / "pyproject.toml").read_text(encoding="utf-8"), "torch")
    assert locked and pinned, (locked, pinned)
    assert locked == pinned, f"requirements.txt locks torch=={locked}, pyproject.toml pins torch=={pinned}"


def image_uid(instructions: list[Instruction]) -> int:
    user = last(instructions, "USER")
    assert user is not None, "the image runs as root: no USER"
    name = user.args.split(":")[0]
    assert name.isdigit(), "USER must be numeric: Kubernetes runAsNonRoot cannot verify a user name"
    return int(name)


def test_the_image_runs_as_a_non_root_user(instructions: list[Instruction]) -> None:
    uid = image_uid(instructions)
    assert uid != 0
    # The user is created before it is used.
    created = [i for i in instructions if i.name == "RUN" and f"--uid {uid}" in i.args]
    assert created and instructions.index(created[0]) < instructions.index(last(instructions, "USER"))


def serve_port(instructions: list[Instruction]) -> int:
    cmd = last(instructions, "CMD")
    assert cmd is not None
    words = cmd.words()
    return int(words[words.index("--port") + 1]) if "--port" in words else make_settings(layered="prod").server.port


def test_the_health_check_probes_a_route_inferd_serves(instructions: list[Instruction]) -> None:
    check = last(instructions, "HEALTHCHECK")
    assert check is not None, "no HEALTHCHECK"
    url = re.search(r"https?://(?:127\.0\.0\.1|localhost):(\d+)(/[\w/]*)", check.args)
    assert url, check.args
    assert int(url.group(1)) == serve_port(instructions)
    expose = last(instructions, "EXPOSE")
    assert expose is not None and int(expose.args.split("/")[0]) == serve_port(instructions)
    paths = set(create_app(make_settings(layered="prod")).openapi()["paths"])
    assert url.group(2) in paths and url.group(2) == "/health/live"
    # The start period covers a model load (the Kubernetes startupProbe budget says the same, 300 s there).
    start = re.search(r"--start-period=(\d+)s", check.args)
    assert start and int(start.group(1)) >= 60


def stop_timeouts(text: str) -> list[int]:
    found = re.findall(r"--stop-timeout[ =](\d+)|docker stop -t (\d+)|stop_grace_period: (\d+)s", text)
    return [int(next(g for g in groups if g)) for groups in found]


@pytest.mark.parametrize("where", ["Dockerfile", "docs/docker.md"])
def test_the_stop_timeout_covers_the_drain(where: str) -> None:
    # `docker stop` sends SIGKILL after 10 s by default, while inferd drains for up to drain_timeout_s.
    text = comments(DOCKERFILE) if where == "Dockerfile" else (ROOT / where).read_text(encoding="utf-8")
    timeouts = stop_timeouts(text)
    assert len(timeouts) >= 3, f"{where} should show --stop-timeout, docker stop -t and stop_grace_period"
    drain = make_settings(layered="prod").server.drain_timeout_s
    assert all(t > drain + SHUTDOWN_MARGIN_S for t in timeouts), (timeouts, drain)
    stop = last(parse(DOCKERFILE), "STOPSIGNAL")
    assert stop is not None and stop.args in ("SIGTERM", "15")


def test_the_dockerfile_parser_joins_continuations(tmp_path: Path) -> None:
    f = tmp_path / "Dockerfile"
    f.write_text("FROM x\n# c\nRUN a \\\n  # inner\n  && b\nCOPY [\"m odels\", \"/d\"]\n", encoding="utf-8")
    got = parse(f)
    assert [(i.name, i.args) for i in got[:2]] == [("FROM", "x"), ("RUN", "a && b")]
    assert copy_sources(got[2]) == ["m odels"]
