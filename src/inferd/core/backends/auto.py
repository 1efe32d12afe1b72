"""``model.backend: auto``: serve at once on torch, then switch to the fastest runtime the accuracy gate passes.

torch needs no export, so it serves from the first seconds. Meanwhile, on a background thread, the candidates this
machine offers are judged one after the other, fastest first, and the first one the gate passes replaces torch
through the manager's hot swap (a new slot loaded beside the serving one, the pointer swapped, the old slot freed
when its last request lets go: no request is dropped):

- OpenVINO mixed precision, where the CPU multiplies bf16 in hardware (avx512_bf16 or amx_bf16): bf16 with every
  float operation that becomes an integer kept in float32 (backends/precision.py; all-mpnet-base-v2's
  relative-position buckets, which plain bf16 gets wrong), and the attention's products of two activations; a graph
  without such operations is plain bf16;
- OpenVINO bf16, the same without the float32 islands (MiniLM 363.6 texts/s against torch's 181-204 on a 2-core
  EPYC with AVX512-BF16: docs/backends.md, "backend: auto");
- OpenVINO static int8 (float32 parts), where the CPU has int8 dot products (avx512_vnni, avx_vnni, amx_int8; without
  them int8 is no faster and less exact: backends/base.py ``INT8_DOT_FLAGS``);
- OpenVINO float32, which computes what torch computes (the float32 gate), on every CPU;
- on a GPU: torch float16 (the exported runtimes run on the CPU).

A candidate's export and verdict are the backend factory's cache entries (factory.py: keyed by the model folder's
content, the CPU's kernel flags, the libraries' and inferd's versions), so a warm start judges nothing again: a
refused candidate is refused from its stored figures in milliseconds and a passed one opens its cached graph. What
serves and why each other candidate was refused or skipped is ``describe()`` (/info's ``auto``, the log, the
metrics' ``inferd_auto_candidate``). A machine or model where nothing passes stays on torch, saying why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import util
from pathlib import Path
from typing import Any

import torch

from inferd import __version__
from inferd.core.backends.base import INT8_DOT_FLAGS, NATIVE_BF16_FLAGS, cpu_flags, kernel_flags
from inferd.core.backends.cache_entries import FORMAT, check_entry
from inferd.core.backends.factory import default_cache_dir, folder_digest, versions
from inferd.core.backends.gate_verdict import LESS_PRECISE
from inferd.core.description import runtime_label
from inferd.core.spec import ModelSpec

log = logging.getLogger(__name__)

# How long a candidate waits for another model change (an admin reload) to finish before it tries again.
BUSY_RETRY_S = 1.0


@dataclass(frozen=True)
class Candidate:
    """One runtime auto may switch to: the ``model.backend``, ``model.dtype`` and ``model.quantize`` of its load."""

    backend: str
    dtype: str
    quantize: str = "none"

    @property
    def name(self) -> str:
        """As ``model.auto_candidates`` names it: openvino-bfloat16, openvino-float32-int8, torch-float16."""
        return runtime_label(self.backend, self.dtype, self.quantize)

    def runtime(self) -> dict[str, str]:
        return {"backend": self.backend, "dtype": self.dtype, "quantize": self.quantize}


OV_BF16 = Candidate("openvino", "bfloat16")
# bf16 with the graph's index arithmetic and attention products kept in float32 (backends/precision.py):
# all-mpnet-base-v2's bf16 loss is its relative-position bucket arithmetic (bf16 cosine min 0.9958, mixed 0.99982 on
# a Xeon with AMX), and on an EPYC without AMX its attention's products too (index arithmetic alone 0.99733, with
# the attention 0.99979): docs/backends.md, "A base-size model on bf16".
OV_MIXED = Candidate("openvino", "mixed")
OV_INT8 = Candidate("openvino", "float32", "int8")
OV_FP32 = Candidate("openvino", "float32")
TORCH_FP16 = Candidate("torch", "float16")
# mixed before plain bf16: it is bf16 wherever that is exact enough (a BERT's graph keeps nothing in float32: no index
# arithmetic, and its attention is one ScaledDotProductAttention operation, not two MatMuls; so the two compile
# alike), and where plain bf16 is refused it passes without the refused judgement first: on all-mpnet-base-v2
# that judgement cost 70 of the cold start's 147 s (bench/RESULTS.md, "backend auto").
ALL = (OV_MIXED, OV_BF16, OV_INT8, OV_FP32, TORCH_FP16)


def candidates(flags: set[str], cuda: bool, wanted: Sequence[str] = (),
               openvino_installed: bool | None = None) -> tuple[list[Candidate], dict[str, str]]:
    """The candidates for this machine, fastest first, and why each other one is not tried (by name).

    ``wanted``: ``model.auto_candidates`` (empty: all); an unknown name is refused here, naming the known ones."""
    known = {c.name: c for c in ALL}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"model.auto_candidates {unknown}: choose among {', '.join(known)}")
    if openvino_installed is None:
        openvino_installed = util.find_spec("openvino") is not None
    skipped: dict[str, str] = {}
    if cuda:
        for c in (OV_BF16, OV_MIXED, OV_INT8, OV_FP32):
            skipped[c.name] = "the model runs on a GPU; OpenVINO runs on the CPU"
    else:
        skipped[TORCH_FP16.name] = "float16 is for a GPU; this model runs on the CPU"
        if not openvino_installed:
            for c in (OV_BF16, OV_MIXED, OV_INT8, OV_FP32):
                skipped[c.name] = "the openvino package is not installed (pip install 'inferd[fast]')"
        else:
            if not any(f in flags for f in NATIVE_BF16_FLAGS):
                for c in (OV_BF16, OV_MIXED):
                    skipped[c.name] = (f"the CPU has no native bf16 ({' or '.join(NATIVE_BF16_FLAGS)}): bf16 is "
                                       "emulated there, slower than float32")
            if not any(f in flags for f in INT8_DOT_FLAGS):
                skipped[OV_INT8.name] = (f"the CPU has no int8 dot products ({', '.join(INT8_DOT_FLAGS)}): static "
                                         "int8 runs no faster than float32 there and loses accuracy")
    for name in known:
        if wanted and name not in wanted and name not in skipped:
            skipped[name] = "not in model.auto_candidates"
    order = [known[w] for w in wanted] if wanted else list(ALL)
    return [c for c in order if c.name not in skipped], skipped


def follows_from(refused: str, reason: str) -> dict[str, str]:
    """The candidates a refusal settles too, by name, with why: mixed refused as less precise than the bound (not
    for a wrong graph) refuses plain bf16, which rounds all mixed rounds and more. Its judgement cost all-mpnet-base-v2
    59 s on a cold start where both were refused (bench/RESULTS.md, "what `auto` settles on for all-mpnet-base-v2
    on this EPYC")."""
    if refused == OV_MIXED.name and LESS_PRECISE in reason:
        return {OV_BF16.name: f"{OV_MIXED.name} was refused as {LESS_PRECISE}; plain bf16 rounds what it rounds and "
                              "more"}
    return {}


def by_name(name: str) -> Candidate:
    return next(c for c in ALL if c.name == name)


def device_type(spec: ModelSpec) -> str:
    """The kind of device the model's torch load runs on (``cuda``, ``cpu``, ``mps``): ``auto`` is CUDA where there
    is one, as the load resolves it."""
    if spec.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(spec.device).type


# -- the remembered choice: a warm start loads the passed candidate at once, without torch first ------------------


def _choice_file(spec: ModelSpec) -> Path:
    """Where the choice for this model, machine and settings is kept: keyed by all a verdict depends on (the model's
    content, the device the model runs on, the CPU's kernel flags, inferd's and the runtimes' versions, the cache's
    format, the gate and the candidates asked for). The device: a GPU node sharing a cache prepared on a CPU one has
    other candidates (torch float16, no OpenVINO), so it must not adopt the CPU's choice."""
    key = {"format": FORMAT, "model": folder_digest(spec.path), "device": device_type(spec),
           "cpu": kernel_flags(cpu_flags()), "inferd": __version__,
           "libraries": versions("openvino"), "gate": spec.gate.model_dump(),
           "candidates": list(spec.settings.auto_candidates), "max_seq_length": spec.max_seq_length,
           "task": spec.task, "pooling": spec.pooling, "calibration_file": spec.calibration_file}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    root = Path(spec.cache_dir).expanduser() if spec.cache_dir else default_cache_dir()
    return root / f"auto-{digest}.json"


def remember(spec: ModelSpec, name: str, entry: str | None, others: Sequence[Verdict] = ()) -> None:
    """Keep the candidate that passed for this model and its cache entry, with the verdicts on the ``others`` (why
    they were refused or skipped: a warm start's /info says so too); best effort: a read-only cache keeps nothing,
    and the next start judges again."""
    try:
        file = _choice_file(spec)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{os.getpid()}")
        kept = [{"candidate": v.candidate, "state": v.state, "reason": v.reason} for v in others if v.candidate != name]
        tmp.write_text(json.dumps({"candidate": name, "entry": _relative(entry, file.parent), "others": kept}))
        os.replace(tmp, file)
    except OSError as exc:
        log.info("backend auto: the choice of %s is not kept (%s)", name, exc)


def _relative(entry: str | None, root: Path) -> str | None:
    """The entry's path from the cache's root where it lies inside it (it does, unless a runtime keeps its own): a
    cache prepared at one path (an image build's, a host's) and mounted at another (a pod's volume) still finds its
    entries, where an absolute path would send the start back to torch and a judging."""
    if entry is None:
        return None
    try:
        return str(Path(entry).resolve().relative_to(root.resolve()))
    except ValueError:
        return entry


def remembered(spec: ModelSpec) -> str | None:
    """The candidate a previous start chose for this model, machine and settings, if its cache entry is still there
    and whole (else loading it would export in the foreground: the start goes through torch and judges instead, and
    the judging builds the entry again). The entry's files are hashed here and again by its load: 0.05 s each for
    MiniLM (cache_entries.damage)."""
    try:
        kept = json.loads(_choice_file(spec).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict):
        return None
    name, entry = kept.get("candidate"), kept.get("entry")
    if name not in {c.name for c in ALL} or not entry or not isinstance(entry, str):
        return None
    folder = _choice_file(spec).parent / entry  # an absolute path (an older file's) stays itself
    meta, problem = check_entry(folder)
    if meta is None:
        if problem is not None:
            log.warning("backend auto: not starting on %s, chosen by an earlier start: its cache entry %s is broken "
                        "(%s); starting on torch and judging again", name, folder, problem)
        return None
    return str(name)


def earlier_verdicts(spec: ModelSpec) -> list[Verdict]:
    """The verdicts on the other candidates kept with the remembered choice (``remember``); none where not kept."""
    try:
        kept = json.loads(_choice_file(spec).read_text())
        return [Verdict(str(v["candidate"]), str(v["state"]), v.get("reason")) for v in kept.get("others") or ()]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []


def not_judged(verdicts: Sequence[Verdict], chosen: str) -> list[Verdict]:
    """``verdicts`` as kept with ``chosen``: one still pending was not judged, as the one chosen passed first."""
    return [Verdict(v.candidate, "skipped", f"not judged: {chosen}, ranked faster, passed first")
            if v.state in ("pending", "judging") else v for v in verdicts if v.candidate != chosen]


@dataclass
class Verdict:
    candidate: str
    state: str  # pending | judging | serving | refused | skipped | abandoned
    reason: str | None = None
    seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "state": self.state, "reason": self.reason, "seconds": self.seconds}


class ModelChangeBusy(Exception):
    """Another model change holds the manager's change lock: the candidate waits and tries again."""


# Switch the serving model to a candidate's runtime (``Rollout.switch_runtime``): returns when it serves,
# raises ModelChangeBusy when another change is loading, or any other exception when the candidate is refused.
Switch = Callable[[dict[str, str]], object]
# Told each time a verdict changes (the app publishes them as metrics).
OnVerdict = Callable[[list[Verdict]], None]


class AutoUpgrade:
    """The background judge of one model's candidates; ``start`` runs it for a load on torch, ``stop`` ends it."""

    def __init__(self, wanted: Sequence[str] = (), flags: set[str] | None = None,
                 on_verdict: OnVerdict | None = None, openvino_installed: bool | None = None) -> None:
        self._wanted = tuple(wanted)
        self._flags = cpu_flags() if flags is None else flags
        self._openvino = openvino_installed
        self._on_verdict: OnVerdict = on_verdict or (lambda verdicts: None)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.verdicts: list[Verdict] = []
        self.serving = runtime_label("torch", "float32", "none")
        self.state = "idle"  # idle | judging | done | stopped
        self.started_at: float | None = None
        self.finished_at: float | None = None

    @property
    def wanted(self) -> tuple[str, ...]:
        """The candidates asked for (model.auto_candidates; empty: every one this machine offers)."""
        return self._wanted

    def start(self, serving: str, switch: Switch, cuda: bool = False) -> None:
        """Judge the candidates for the load now serving on ``serving`` (a runtime name; ``cuda``: on a GPU), in
        the background; ``switch`` replaces that load (and only it: a model changed since is not switched back)."""
        self.stop()
        try:
            todo, skipped = candidates(self._flags, cuda, self._wanted, self._openvino)
        except Exception:
            # Called from the first load's thread, whose caller at start is a background task that nobody awaits:
            # raised from here it would be lost, the model serving on torch without a word of why.
            log.exception("backend auto: the candidates could not be chosen; %s keeps serving", serving)
            with self._lock:
                self.serving, self.state = serving, "done"
                self.started_at = self.finished_at = time.monotonic()
            return
        for c in [c for c in todo if c.name == serving]:  # torch float16 configured on a GPU: nothing to switch to
            todo.remove(c)
            skipped[c.name] = "serving already"
        with self._lock:
            self._stop = threading.Event()
            self.serving, self.state = serving, "judging"
            self.started_at, self.finished_at = time.monotonic(), None
            self.verdicts = [Verdict(c.name, "pending") for c in todo]
            self.verdicts += [Verdict(name, "skipped", why) for name, why in skipped.items()]
        self._told()
        if not todo:
            self._finish(f"no candidate for this machine: stays on {serving}")
            return
        thread = threading.Thread(target=self._run, args=(todo, switch, self._stop), name="inferd-auto", daemon=True)
        self._thread = thread
        thread.start()

    def adopt(self, serving: str, why: str, earlier: Sequence[Verdict] = ()) -> None:
        """The load started on ``serving`` at once (a previous start's choice, ``remembered``): nothing to judge;
        ``earlier``: that start's verdicts on the others, said as its."""
        self.stop()
        with self._lock:
            self.serving, self.state = serving, "done"
            self.started_at = self.finished_at = time.monotonic()
            self.verdicts = [Verdict(serving, "serving", why),
                             *(Verdict(v.candidate, v.state, f"{v.reason} (an earlier start's verdict)")
                               for v in earlier if v.candidate != serving)]
        self._told()

    def stop(self) -> None:
        """End the judging (shutdown, or a new model): a candidate loading now is abandoned at its end."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=0.1)  # it may be inside an export: the event stops it before it switches
        with self._lock:
            if self.state == "judging":
                self.state = "stopped"

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the judging ended within ``timeout`` (for ``inferd prepare`` and tests)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self.state in ("done", "stopped")

    def _verdict(self, name: str) -> Verdict:
        return next(v for v in self.verdicts if v.candidate == name)

    def _told(self) -> None:
        with self._lock:
            verdicts = list(self.verdicts)
        self._on_verdict(verdicts)

    def _run(self, todo: list[Candidate], switch: Switch, stop: threading.Event) -> None:
        try:
            self._judge(todo, switch, stop)
        except Exception:
            # A refusal is caught per candidate; this is anything else (a verdict's listener, a bug): a thread's
            # exception goes to stderr, not the log, so it is logged here and the judging ends saying so.
            log.exception("backend auto: the judging stopped on an error; %s keeps serving", self.serving)
            with self._lock:  # not told: the listener may be what failed
                self.state, self.finished_at = "done", time.monotonic()

    def _judge(self, todo: list[Candidate], switch: Switch, stop: threading.Event) -> None:
        for candidate in todo:
            if stop.is_set():
                return
            verdict = self._verdict(candidate.name)
            if verdict.state == "skipped":  # settled by an earlier refusal (follows_from)
                continue
            verdict.state = "judging"
            self._told()
            started = time.monotonic()
            log.info("backend auto: judging %s (serving %s meanwhile)", candidate.name, self.serving)
            while True:
                try:
                    if stop.is_set():
                        return
                    switch(candidate.runtime())
                except ModelChangeBusy:
                    stop.wait(BUSY_RETRY_S)
                    continue
                except Exception as exc:  # a refusal of any kind keeps the serving runtime and names why
                    verdict.state, verdict.reason = "refused", str(exc)
                    verdict.seconds = round(time.monotonic() - started, 3)
                    log.warning("backend auto: %s refused, %s keeps serving: %s", candidate.name, self.serving, exc)
                    for name, why in follows_from(candidate.name, str(exc)).items():
                        later = next((v for v in self.verdicts if v.candidate == name and v.state == "pending"), None)
                        if later is not None:
                            later.state, later.reason = "skipped", why
                    self._told()
                    break
                else:
                    verdict.state, verdict.seconds = "serving", round(time.monotonic() - started, 3)
                    for later in self.verdicts:
                        if later.state == "pending":
                            later.state, later.reason = "skipped", f"{candidate.name} passed first (faster)"
                    previous, self.serving = self.serving, candidate.name
                    self._finish(f"switched from {previous} to {candidate.name} after "
                                 f"{time.monotonic() - (self.started_at or started):.1f} s")
                    return
        self._finish(f"every candidate was refused or skipped: stays on {self.serving}")

    def _finish(self, said: str) -> None:
        with self._lock:
            self.state, self.finished_at = "done", time.monotonic()
        log.info("backend auto: %s", said, extra={"serving": self.serving})
        self._told()

    def describe(self) -> dict[str, Any]:
        """What serves, and each candidate's verdict with its reason (for /info and the admin API)."""
        with self._lock:
            took = (None if self.started_at is None or self.finished_at is None
                    else round(self.finished_at - self.started_at, 3))
            return {"serving": self.serving, "state": self.state, "judging_seconds": took,
                    "candidates": [v.as_dict() for v in self.verdicts]}
