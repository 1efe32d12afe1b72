"""Opening a backend: export, quantise, judge and cache once; later starts load the cached graph.

A cache entry is a folder under ``model.cache_dir`` named by a key over everything that could change the
graph or its accuracy: the model folder's content digest, the task and the head it reads (an encoder's
hidden states, or a classification head's logits), the backend, dtype and quantisation, the
calibration texts, the length limit, the CPU's kernel flags, and the versions of inferd and of the libraries
that export and run it. The entry holds the graph and ``meta.json`` with the gate's figures, so a warm start
needs neither torch weights nor a new comparison: the stored figures are judged against the current
``model.gate.*`` thresholds. ``meta.json`` records each graph file's size and sha256 too, checked at every open: an
entry that fails the check, or whose meta.json cannot be read, is moved aside and built again, never served
(core/backends/cache_entries.py).
Entries are written to a temporary folder and renamed into place, so concurrent starts never see half a
graph, and one process builds an entry at a time (``cache_entries.entry_lock``: a fleet sharing a cache exports a
model once);
the model folder itself is only read (read-only model folders work).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from inferd import __version__
from inferd.core.backends import gate, gate_figures, gate_inputs, gate_verdict
from inferd.core.backends.base import (
    TASK_HEADS,
    BackendError,
    BackendOptions,
    Runner,
    check_options,
    cpu_flags,
    gate_kind,
    kernel_flags,
    quantize_warning,
    resolve_dtype,
)
from inferd.core.backends.cache_entries import (
    EXPORT_RECORD,
    FORMAT,
    META,
    check_entry,
    checked,
    discard,
    entry_lock,
    manifest,
)
from inferd.core.backends.torch import TorchRunner, load_model
from inferd.core.backends.varlen import VarlenRunner, choose

log = logging.getLogger(__name__)

_LIBRARIES = {"torch": ("torch", "transformers"),
              "onnx": ("torch", "transformers", "onnx", "onnxruntime"),
              "openvino": ("torch", "transformers", "openvino", "nncf")}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inferd"


# Digests already read in this process, by folder and its files' sizes and modification times: backend auto opens
# one model on several candidates in turn, and an all-mpnet-base-v2 folder is 420 MB to hash each time.
_DIGESTS: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def folder_digest(path: Path) -> str:
    """sha256 over every file's relative path and content (hidden files and folders aside); read once per process
    while no file's size or modification time changes."""
    files = [(f, f.relative_to(path)) for f in sorted(p for p in path.rglob("*") if p.is_file())]
    files = [(f, rel) for f, rel in files if not any(part.startswith(".") for part in rel.parts)]
    stamp = tuple((str(rel), (st := f.stat()).st_size, st.st_mtime_ns) for f, rel in files)
    known = _DIGESTS.get((str(path.resolve()), stamp))
    if known is not None:
        return known
    h = hashlib.sha256()
    for file, rel in files:
        h.update(str(rel).encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    _DIGESTS[(str(path.resolve()), stamp)] = digest = h.hexdigest()
    return digest


def versions(backend: str) -> dict[str, str]:
    out = {}
    for lib in _LIBRARIES[backend]:
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            out[lib] = "missing"
    return out


def folder_graph(path: Path, backend: str) -> Path | None:
    """A graph for this backend that the model folder already holds (served as is, not exported)."""
    from inferd.core.backends import onnx, openvino

    names = openvino.FOLDER_GRAPHS if backend == "openvino" else onnx.FOLDER_GRAPHS
    return next((path / n for n in names if (path / n).is_file()), None)


def entry_key(model_digest: str, options: BackendOptions, dtype: str, max_seq_length: int,
              calibration: str, flags: set[str] | None = None) -> dict[str, Any]:
    """What the entry depends on. ``cpu``: the kernel-deciding CPU flags, since the gate's figures depend on
    the kernels (a cache copied from a CPU with int8 dot products to one without is judged again)."""
    return {"format": FORMAT, "model": model_digest, "task": options.task, "head": options.head,
            "backend": options.backend, "dtype": dtype,
            "quantize": options.quantize, "calibration": calibration, "max_seq_length": max_seq_length,
            "gate_texts": options.gate.texts, "calibration_texts": options.gate.calibration_texts,
            "libraries": versions(options.backend), "inferd": __version__,
            "cpu": kernel_flags(cpu_flags() if flags is None else flags)}


def entry_folder(root: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return root / f"{key['task']}-{key['backend']}-{key['quantize']}-{key['dtype']}-{digest}"


# What the OpenVINO export depends on: not the dtype nor the quantisation (its IR holds float32 weights and no
# precision; the dtype is a compile hint, and static int8 quantises a copy of it).
_EXPORT_KEY = ("format", "model", "task", "head", "max_seq_length", "libraries", "inferd")


def shared_export(root: Path, key: dict[str, Any], model: torch.nn.Module, head: str) -> Path:
    """This model's OpenVINO IR, exported once for every dtype and quantisation of it (backend auto judges bf16,
    int8 and float32 in turn: one export, not three); built under its own lock, renamed into place. Its files are
    checked against their record each time it is reused: each entry links them, so a damaged export would spread."""
    from inferd.core.backends import openvino as ov

    digest = hashlib.sha256(json.dumps({k: key[k] for k in _EXPORT_KEY}, sort_keys=True).encode()).hexdigest()[:24]
    folder = root / f"export-{key['task']}-{key['head']}-{digest}"
    if checked(folder, EXPORT_RECORD)[0] is not None:
        return folder / ov.GRAPH
    with entry_lock(folder):
        record, problem = checked(folder, EXPORT_RECORD)  # another process exported it while this one waited
        if record is None:
            if problem is not None:
                discard(folder, problem)
            work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=root))
            try:
                ov.export(model, work, head)
                files = manifest(work)
                (work / EXPORT_RECORD).write_text(json.dumps({"format": FORMAT, "files": files}, indent=2))
                os.rename(work, folder)
            except BaseException:
                shutil.rmtree(work, ignore_errors=True)
                raise
    return folder / ov.GRAPH


def linked(graph: Path, folder: Path) -> Path:
    """The graph's files (model.xml and its weights) in ``folder``: hard links where the filesystem allows (the entry
    stays whole on its own; nothing writes them), else copies."""
    folder.mkdir(parents=True, exist_ok=True)
    for file in graph.parent.glob(f"{graph.stem}.*"):
        try:
            os.link(file, folder / file.name)
        except OSError:
            shutil.copy2(file, folder / file.name)
    return folder / graph.name


def _texts(options: BackendOptions) -> tuple[list[str], list[str], str]:
    """(gate texts, calibration texts, an id for the cache key)."""
    if options.calibration_file is not None:
        texts = gate_inputs.read_calibration_file(options.calibration_file)
        digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
        # The operator's own texts serve both purposes: they are what the model will see.
        return texts, texts, f"file:{digest}"
    return (gate_inputs.builtin_texts(options.gate.texts),
            gate_inputs.builtin_texts(options.gate.calibration_texts, gate_inputs.CALIBRATION_SEED), "builtin:1")


def task_model(path: Path, safetensors: bool, head: str, probe: gate_inputs.GatedTask) -> torch.nn.Module:
    """The model a runner runs and an export traces: the folder's, under the task's head module for the heads a
    task defines (backends/base.py TASK_HEADS)."""
    model = load_model(path, safetensors, head)
    if head not in TASK_HEADS:
        return model
    module = probe.head_module(model)
    if module is None:
        raise BackendError(f"the {head} head is the task's own module, and this task defines none (head_module)")
    return module.eval()


def open_runner(backend: str, graph: Path, head: str, dtype: str, quantize: str, threads: int,
                info: dict[str, Any] | None = None, compile_cache: Path | None = None, streams: int = 1) -> Runner:
    if backend == "openvino":
        from inferd.core.backends.openvino import OpenVINORunner

        return OpenVINORunner(graph, head, dtype, quantize, threads, info, compile_cache, streams)
    from inferd.core.backends.onnx import OnnxRunner

    return OnnxRunner(graph, head, dtype, quantize, threads, info, streams=streams)


def _convert(model: torch.nn.Module, options: BackendOptions, work: Path, given: Path | None,
             samples: list[dict[str, Any]]) -> Path:
    """Export (unless the folder held a graph), then quantise; returns the graph to serve."""
    if options.backend == "openvino":
        from inferd.core.backends import openvino as ov

        source = given or ov.export(model, work if options.quantize == "none" else work / "fp32", options.head)
        if options.quantize == "none":
            return source
        graph = ov.read(source)
        names = [i.get_any_name() for i in graph.inputs]
        if options.quantize == "int8-weights":
            return ov.save(ov.compress_weights(graph), work)
        return ov.save(ov.quantize_static(graph, gate_inputs.only_inputs(samples, names), len(samples)), work)
    from inferd.core.backends import onnx

    source = given or onnx.export(model, work if options.quantize == "none" else work / "fp32", options.head)
    if options.quantize == "none":
        return source
    import onnx as onnx_lib

    names = [i.name for i in onnx_lib.load(str(source), load_external_data=False).graph.input]
    return onnx.quantize_static(source, work, gate_inputs.only_inputs(samples, names))


def build(path: Path, entry: Path, key: dict[str, Any], options: BackendOptions, probe: gate_inputs.GatedTask,
          safetensors: bool, threads: int) -> dict[str, Any]:
    """Export, quantise and judge into a temporary folder, then rename it into place."""
    started = time.perf_counter()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    except OSError as exc:
        raise BackendError(f"model.cache_dir {entry.parent} is not writable ({exc.strerror}): set "
                           "model.cache_dir to a writable folder, or prepare it with `inferd export`") from exc
    try:
        gate_texts, calibration_texts, _ = _texts(options)
        model = task_model(path, safetensors, options.head, probe)
        reference = TorchRunner(model, torch.device("cpu"), "float32", head=options.head)
        samples = []
        if options.quantize == "int8":
            samples = gate_inputs.calibration_samples(probe, gate_inputs.encode_set(probe, calibration_texts))
        given = folder_graph(path, options.backend) if options.head == "hidden" else None
        if given is None and options.backend == "openvino":
            # Served as it is (linked into the entry), or quantised from a link beside it that goes afterwards.
            given = linked(shared_export(entry.parent, key, model, options.head),
                           work if options.quantize == "none" else work / "export")
        graph = _convert(model, options, work, given, samples)
        exported = time.perf_counter() - started
        candidate = open_runner(options.backend, graph, options.head, key["dtype"], options.quantize, threads)
        try:
            figures = gate.measure(probe, reference, candidate, gate_texts)
        finally:
            candidate.close()
            reference.close()
        shutil.rmtree(work / "fp32", ignore_errors=True)
        shutil.rmtree(work / "export", ignore_errors=True)  # quantised from it: the entry keeps its own graph
        in_folder = not graph.is_relative_to(work)
        meta = {"format": FORMAT, "key": key, "graph": str(graph if in_folder else graph.relative_to(work)),
                # What an open checks (``damage``). A graph the model folder holds is not recorded: the folder's
                # content digest, read at every start, is the entry's key already.
                "files": manifest(work), "from_model_folder": in_folder,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "export_seconds": round(exported, 3), "build_seconds": round(time.perf_counter() - started, 3),
                "gate": {"kind": gate_kind(key["dtype"], options.quantize), "task": options.task,
                         "figures": figures.as_dict()}}
        (work / META).write_text(json.dumps(meta, indent=2))
        try:
            os.rename(work, entry)
        except OSError as exc:
            # Another process finished the same entry first (one that could not take the lock): serve theirs, which
            # is the same graph, if it is whole; a broken one was moved aside under the lock before this build.
            shutil.rmtree(work, ignore_errors=True)
            theirs, problem = check_entry(entry)
            if theirs is None:
                raise BackendError(f"cache entry {entry} could not be put in place ({exc.strerror}); the folder "
                                   f"there is broken ({problem})") from exc
            meta = theirs
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return meta


def check_load(options: BackendOptions, device: torch.device) -> tuple[str, str]:
    """What a load refuses before it loads anything (a combination that cannot work, a dtype the backend cannot run
    there), raised as BackendError; else the dtype it runs at and why. ``inferd prepare`` and ``inferd export`` ask
    it first, so a configuration the server would refuse exits 2 there too."""
    check_options(options, device)
    return resolve_dtype(options.dtype, options.backend, device, quantize=options.quantize)


def open_backend(path: Path, options: BackendOptions, device: torch.device, probe: gate_inputs.GatedTask,
                 safetensors: bool = True) -> Runner:
    """The runner for this model and these options: torch eager, or a cached (exported once) graph."""
    dtype, why = check_load(options, device)
    threads = options.threads or torch.get_num_threads()
    if options.backend == "torch":
        model = task_model(path, safetensors, options.head, probe)
        unpadded, how = choose(options.unpadded, model, device, options.head)
        log.info("backend torch, dtype %s (%s), %s (%s)", dtype, why, "unpadded" if unpadded else "padded", how)
        runner = VarlenRunner if unpadded else TorchRunner
        return runner(model, device, dtype, {"dtype_reason": why, "unpadded": unpadded, "unpadded_reason": how},
                      options.head)
    root = (options.cache_dir or default_cache_dir()).expanduser()
    _, _, calibration = _texts(options) if options.calibration_file else (None, None, "builtin:1")
    digest = folder_digest(path)

    def judged(dtype: str) -> tuple[dict[str, Any], Path, dict[str, Any], str, gate_figures.Figures, list[str]]:
        """The entry for this dtype (built on a miss) and the gate's verdict on it under today's thresholds."""
        key = entry_key(digest, options, dtype, probe.max_seq_length, calibration)
        entry = entry_folder(root, key)
        meta, _ = check_entry(entry)
        cache = "hit"
        if meta is None:
            with entry_lock(entry):
                # Another process built (or repaired) it while this one waited for the lock.
                meta, problem = check_entry(entry)
                cache = "hit" if meta is not None else "miss"
                if meta is None:
                    if problem is not None:
                        discard(entry, problem)
                    log.info("exporting %s for %s (dtype %s, quantize %s) into %s", path, options.backend, dtype,
                             options.quantize, entry)
                    meta = build(path, entry, key, options, probe, safetensors, threads)
        figures = gate_figures.figures_from_dict(meta["gate"]["figures"])
        return key, entry, meta, cache, figures, gate_verdict.judge(figures, meta["gate"]["kind"], options.gate)

    key, entry, meta, cache, figures, failures = judged(dtype)
    if failures and options.dtype == "auto" and options.quantize == "int8" and dtype == "bfloat16":
        # bf16 float parts drifted past the int8 gate on this CPU: the same quantisation in float32 parts.
        # Both verdicts stay cached, so a warm start goes straight to the float32 entry without a new export.
        log.warning("%s static int8 with bf16 float parts refused by the accuracy gate (%s); trying float32 "
                    "float parts", options.backend, "; ".join(failures))
        dtype, why = "float32", f"auto: static int8's bf16 float parts were refused by the gate ({'; '.join(failures)})"
        key, entry, meta, cache, figures, failures = judged(dtype)
    kind = meta["gate"]["kind"]
    label = f"{options.backend} {dtype}" + (f" {options.quantize}" if options.quantize != "none" else "")
    warning = quantize_warning(options.quantize, set(key["cpu"]))
    figures_said = gate_verdict.summary(figures, kind, options.gate)
    if failures:
        raise BackendError(f"{label} refused by the accuracy gate ({kind} thresholds): {'; '.join(failures)}. "
                           f"Cause: {gate_verdict.cause(figures, kind, options.gate)}. "
                           f"Figures against torch fp32: {figures_said}" + (f". Note: {warning}" if warning else ""))
    if warning:
        log.warning("%s: %s", label, warning)
    graph = Path(meta["graph"]) if meta.get("from_model_folder") else entry / meta["graph"]
    compile_cache = entry / "compiled" if os.access(entry, os.W_OK) else None
    info = {"dtype_reason": why, "cache": cache, "cache_entry": str(entry), "cpu": key["cpu"],
            **({"quantize_warning": warning} if warning else {}),
            "export_seconds": meta.get("export_seconds"), "from_model_folder": meta.get("from_model_folder"),
            "gate": {"kind": kind, "passed": True, "figures": figures.as_dict(),
                     "thresholds": {rule.setting: rule.bound
                                    for rule in gate_verdict.held_to(figures, kind, options.gate)}}}
    runner = open_runner(options.backend, graph, options.head, dtype, options.quantize, threads, info, compile_cache,
                         options.streams)
    log.info("backend %s (%s); cache %s %s; gate %s passed: %s; the gate ran %s", label, why, cache, entry, kind,
             figures_said, figures.ran)
    return runner
