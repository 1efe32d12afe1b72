"""The HPA of deploy/k8s replayed against a real inferd: would it follow a load step, too late, or flap?

Run: .venv/bin/python bench/autoscale_sim.py   (about 3 minutes: 20-40 s start-up, then the load)

No cluster runs here, so the cluster is simulated around one real ``inferd serve`` (the default MiniLM, the prod
configuration, on 127.0.0.1), which plays "a typical ready pod": the load generator offers it the cluster's load
divided by the number of ready replicas (a Service spreads evenly), Poisson arrivals of one text each, for a
bounded time. Every second the script samples inferd_queue_depth and the worker's busy seconds from /metrics.
Every ServiceMonitor interval (from the built manifests) those samples become "scrapes"; every 15 s (the HPA's
sync period) the metric values prometheus-adapter would serve are computed from the scrapes with the windows of
its rules, and bench/hpa_model.py decides as the HPA would, with the targets, tolerance, stabilisation windows
and policies read from the built cpu overlay. A replica the HPA adds becomes ready after image pull + process
start + model load + one readiness period: the pull is an assumption (--pull-s, not measurable here), the rest
is measured on this machine when the script starts its server. A starting replica reports queue depth 0 (its
/metrics answers while the model loads) and no busy ratio (no batch ran yet), as a real one would.

Writes a plot (default deploy/k8s/autoscale_sim.png) and the figures as JSON (bench/out/autoscale_sim.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml
from hpa_model import Controller, Decision, HpaSpec, spec_from_manifest

from inferd.bench.corpus import texts as corpus_texts
from inferd.bench.http import CLIENT_ERRORS, LeanClient
from inferd.bench.procs import free_port
from inferd.bench.stats import percentile

ROOT = Path(__file__).resolve().parents[1]
SYNC_S = 15.0  # kube-controller-manager --horizontal-pod-autoscaler-sync-period
MAX_IN_FLIGHT = 4000  # a bound on the load generator; reaching it is reported, never silent


@dataclass(frozen=True)
class Window:
    kind: str  # avg (avg_over_time) | rate
    seconds: float


@dataclass(frozen=True)
class Manifests:
    hpa: HpaSpec
    scrape_s: float
    windows: dict[str, Window]
    readiness_period_s: float


def kubectl() -> str:
    found = os.environ.get("INFERD_KUBECTL") or shutil.which("kubectl")
    if not found:
        sys.exit("no kubectl: set INFERD_KUBECTL or put kubectl on PATH (see .ci/run)")
    return found


def build(folder: Path) -> list[dict[str, Any]]:
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind)


def _seconds(duration: str) -> float:
    value, unit = re.fullmatch(r"(\d+)([sm])", duration).groups()  # type: ignore[union-attr]
    return float(value) * (60 if unit == "m" else 1)


def read_manifests(overlay: Path, adapter: Path) -> Manifests:
    docs = build(overlay)
    hpa = spec_from_manifest(_one(docs, "HorizontalPodAutoscaler"))
    scrape_s = _seconds(_one(docs, "ServiceMonitor")["spec"]["endpoints"][0]["interval"])
    pod = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    rules = yaml.safe_load(_one(build(adapter), "ConfigMap")["data"]["config.yaml"])["rules"]
    windows = {}
    for target in hpa.targets:
        rule = next(r for r in rules if r["name"].get("as") == target.name)
        query = rule["metricsQuery"]
        windows[target.name] = Window("rate" if "rate(" in query else "avg",
                                      _seconds(re.search(r"\[(\d+[sm])\]", query).group(1)))  # type: ignore[union-attr]
    return Manifests(hpa, scrape_s, windows, float(pod["readinessProbe"]["periodSeconds"]))


@dataclass
class Pod:
    created: float
    started: float  # image pulled, process running, /metrics answering
    ready: float


@dataclass
class Fleet:
    pods: list[Pod]
    pull_s: float
    start_to_ready_s: float

    def ready(self, now: float) -> int:
        return sum(p.ready <= now for p in self.pods)

    def scale_to(self, n: int, now: float) -> None:
        while len(self.pods) < n:
            started = now + self.pull_s
            self.pods.append(Pod(now, started, started + self.start_to_ready_s))
        # A ReplicaSet deletes pods that are not ready first, then the newest.
        self.pods.sort(key=lambda p: (p.ready <= now, -p.created), reverse=True)
        del self.pods[n:]


@dataclass
class Sample:
    t: float
    queue: float
    busy_s: float  # cumulative seconds of forward pass (inferd_inference_duration_seconds_sum)
    rss: float


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    sent: list[tuple[float, float, int]] = field(default_factory=list)  # (send time, latency s, status)
    ready: list[tuple[float, int, int]] = field(default_factory=list)  # (t, ready replicas, replicas)
    overflow: int = 0


def scrape(text: str) -> tuple[float, float, float]:
    queue = busy = rss = 0.0
    for line in text.splitlines():
        if line.startswith("inferd_queue_depth "):
            queue = float(line.split()[1])
        elif line.startswith("inferd_inference_duration_seconds_sum"):
            busy += float(line.split()[-1])
        elif line.startswith("process_resident_memory_bytes "):
            rss = float(line.split()[1])
    return queue, busy, rss


def served_value(window: Window, scrapes: list[Sample], now: float) -> float | None:
    """What prometheus-adapter would answer for a ready pod: the rule's function over its range."""
    inside = [s for s in scrapes if now - window.seconds < s.t <= now]
    if window.kind == "avg":
        return sum(s.queue for s in inside) / len(inside) if inside else None
    if len(inside) < 2:
        return None
    return (inside[-1].busy_s - inside[0].busy_s) / (inside[-1].t - inside[0].t)


def pod_values(m: Manifests, fleet: Fleet, scrapes: list[Sample], now: float) -> dict[str, list[float | None]]:
    out: dict[str, list[float | None]] = {}
    for name, window in m.windows.items():
        real = served_value(window, scrapes, now)
        values: list[float | None] = []
        for pod in fleet.pods:
            if pod.started > now:
                continue  # Pending: the HPA ignores it
            if pod.ready <= now:
                values.append(real)
            elif window.kind == "avg" and now - pod.started >= m.scrape_s:
                values.append(0.0)  # loading: its queue is empty and scraped
            else:
                values.append(None)  # not scraped yet, or no batch ran yet (no busy series)
        out[name] = values
    return out


class Profile:
    """Cluster load from "start:pods,start:pods,..." (seconds from the load's start; load in pods' worth of the
    capacity measured at start, so the run means the same on a busy machine as on an idle one), in texts/s."""

    def __init__(self, spec: str, capacity: float) -> None:
        self.steps = sorted((float(a), float(b) * capacity) for a, b in (p.split(":") for p in spec.split(",")))

    def rate(self, t: float) -> float:
        return next(r for s, r in reversed(self.steps) if t >= s)


async def sampler(url: str, run: Run, t0: float, duration: float) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        while (now := time.monotonic() - t0) < duration:
            r = await client.get(url + "/metrics")
            run.samples.append(Sample(now, *scrape(r.text)))
            await asyncio.sleep(max(0.0, math.floor(now) + 1 - (time.monotonic() - t0)))


async def autoscaler(m: Manifests, fleet: Fleet, run: Run, t0: float, duration: float) -> None:
    controller = Controller(m.hpa)
    while (now := time.monotonic() - t0) < duration:
        await asyncio.sleep(SYNC_S - now % SYNC_S)
        now = time.monotonic() - t0
        step = m.scrape_s
        scrapes = [s for s in run.samples if s.t % step < 1.0]  # the samples falling on scrape ticks
        decision = controller.sync(now, len(fleet.pods), pod_values(m, fleet, scrapes, now))
        fleet.scale_to(decision.replicas, now)
        run.decisions.append(decision)


async def load(url: str, profile: Profile, fleet: Fleet, run: Run, t0: float, duration: float, seed: int) -> None:
    rng = random.Random(seed)
    texts = corpus_texts(500, seed)
    client = LeanClient(url)
    tasks: set[asyncio.Task[None]] = set()

    async def send(scheduled: float, text: str) -> None:
        body = orjson.dumps({"texts": [text]})
        try:
            status, _ = await client.request("POST", "/predict", body)
        except CLIENT_ERRORS:
            status = 0
        run.sent.append((scheduled, time.monotonic() - t0 - scheduled, status))

    scheduled = 0.0
    while True:
        per_pod = profile.rate(scheduled) / max(1, fleet.ready(scheduled))
        scheduled += rng.expovariate(per_pod)
        if scheduled >= duration:
            break
        delay = scheduled - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        run.ready.append((scheduled, fleet.ready(scheduled), len(fleet.pods)))
        if len(tasks) >= MAX_IN_FLIGHT:
            run.overflow += 1
            continue
        task = asyncio.create_task(send(scheduled, rng.choice(texts)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    await client.aclose()


async def calibrate(url: str, seconds: float, concurrency: int) -> float:
    """Texts/s one server answers in a closed loop of ``concurrency`` users (moderate batching)."""
    client = LeanClient(url)
    texts = corpus_texts(500, 7)
    done = 0
    stop = time.monotonic() + seconds

    async def user(i: int) -> None:
        nonlocal done
        while time.monotonic() < stop:
            status, _ = await client.request("POST", "/predict", orjson.dumps({"texts": [texts[(done + i) % 500]]}))
            done += status == 200

    started = time.monotonic()
    await asyncio.gather(*(user(i) for i in range(concurrency)))
    await client.aclose()
    return done / (time.monotonic() - started)


def start_server(log: Path) -> tuple[subprocess.Popen[bytes], str, dict[str, float]]:
    """inferd serve with the prod configuration and the default model; times its start and load."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERD") and k != "MODEL_PATH"}
    env.update({"INFERD_ENV": "prod", "INFERD_CONFIG_DIR": str(ROOT / "configs"), "INFERD__SERVER__HOST": "127.0.0.1",
                "INFERD__SERVER__PORT": str(port), "INFERD__SERVER__LOG_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "inferd.cli", "serve"], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    timings: dict[str, float] = {}
    while "ready_s" not in timings:
        if proc.poll() is not None or time.monotonic() - t0 > 300:
            stop_server(proc)
            sys.exit(f"inferd did not become ready:\n{log.read_text(errors='replace')[-3000:]}")
        for path, key in (("/health/live", "live_s"), ("/health/ready", "ready_s")):
            if key not in timings:
                try:
                    if httpx.get(url + path, timeout=2).status_code == 200:
                        timings[key] = time.monotonic() - t0
                except httpx.HTTPError:
                    pass
        time.sleep(0.1)
    text = httpx.get(url + "/metrics", timeout=5).text
    timings["model_load_s"] = float(re.search(r"^inferd_model_load_seconds\{[^}]*\} (\S+)", text, re.M).group(1))  # type: ignore[union-attr]
    return proc, url, timings


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def summarise(run: Run, profile: Profile, duration: float, timings: dict[str, float], m: Manifests,
              fleet: Fleet) -> dict[str, Any]:
    bounds = [s for s, _ in profile.steps] + [duration]
    phases = []
    for (start, rate), end in zip(profile.steps, bounds[1:], strict=True):
        sent = [(lat, st) for t, lat, st in run.sent if start <= t < end]
        ok = [lat for lat, st in sent if st == 200]
        queue = [s.queue for s in run.samples if start <= s.t < end]
        phases.append({"from_s": start, "to_s": end, "cluster_texts_per_s": rate, "requests": len(sent),
                       "errors": sum(st != 200 for _, st in sent),
                       "p50_ms": round(percentile(ok, 50) * 1e3) if ok else None,
                       "p99_ms": round(percentile(ok, 99) * 1e3) if ok else None,
                       "max_queue": max(queue, default=0)})
    changes = [(round(d.t), d.current, d.replicas) for d in run.decisions if d.replicas != d.current]
    return {"timings": {k: round(v, 2) for k, v in timings.items()},
            "scale_up_delay_s": round(fleet.pull_s + fleet.start_to_ready_s, 1),
            "hpa": asdict(m.hpa), "scrape_s": m.scrape_s,
            "windows": {k: asdict(v) for k, v in m.windows.items()},
            "phases": phases, "replica_changes": changes,
            "decisions": [{"t": round(d.t, 1), "current": d.current, "proposals": d.proposals,
                           "recommended": d.recommended, "replicas": d.replicas} for d in run.decisions],
            "max_rss_mib": round(max(s.rss for s in run.samples) / 2**20) if run.samples else None,
            "generator_overflow": run.overflow}


def plot(run: Run, profile: Profile, m: Manifests, summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_load, ax_q, ax_r) = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    ts = [s.t for s in run.samples]
    ax_load.step([s for s, _ in profile.steps] + [ts[-1]], [r for _, r in profile.steps] + [profile.steps[-1][1]],
                 where="post", label="cluster load (texts/s)")
    per_pod = [(t, profile.rate(t) / max(1, ready)) for t, ready, _ in run.ready[::20]]
    ax_load.plot([t for t, _ in per_pod], [v for _, v in per_pod], ".", ms=3, label="offered to each ready pod")
    ax_load.set_ylabel("texts/s")
    ax_load.legend(loc="upper right", fontsize=8)
    queue_target = next(t.average for t in m.hpa.targets if t.name == "inferd_queue_depth")
    ax_q.plot(ts, [s.queue for s in run.samples], lw=1, label="inferd_queue_depth (1 s samples)")
    ax_q.axhline(queue_target, color="gray", ls="--", lw=1, label=f"HPA target {queue_target:g}")
    ax_q.set_yscale("symlog", linthresh=1.0)
    ax_q.set_ylabel("texts waiting per pod")
    busy = [(b.t, (b.busy_s - a.busy_s) / (b.t - a.t)) for a, b in zip(run.samples, run.samples[5:], strict=False)]
    ax_b = ax_q.twinx()
    ax_b.plot([t for t, _ in busy], [v for _, v in busy], color="tab:green", lw=1, alpha=0.7, label="worker busy (5 s)")
    ax_b.set_ylim(0, 1.2)
    ax_b.set_ylabel("busy ratio", color="tab:green")
    lines = ax_q.get_legend_handles_labels()[0] + ax_b.get_legend_handles_labels()[0]
    ax_q.legend(lines, [str(x.get_label()) for x in lines], loc="upper right", fontsize=8)
    ax_r.step([t for t, _, _ in run.ready], [n for _, _, n in run.ready], where="post", label="replicas (HPA)")
    ax_r.step([t for t, _, _ in run.ready], [r for _, r, _ in run.ready], where="post", label="ready replicas")
    for target in m.hpa.targets:
        pts = [(d.t, d.proposals[target.name]) for d in run.decisions if d.proposals[target.name] is not None]
        ax_r.plot([t for t, _ in pts], [v for _, v in pts], "x", label=f"proposal from {target.name}")
    top = max([m.hpa.max_replicas] + [v for d in run.decisions for v in d.proposals.values() if v is not None])
    ax_r.set_ylim(0, top + 1)
    ax_r.axhline(m.hpa.max_replicas, color="gray", ls=":", lw=1)
    ax_r.set_ylabel("replicas")
    ax_r.set_xlabel("seconds")
    ax_r.legend(loc="upper right", fontsize=8)
    fig.suptitle(f"HPA of deploy/k8s/overlays/cpu replayed against a real inferd (scale-up delay "
                 f"{summary['scale_up_delay_s']} s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def simulate(url: str, m: Manifests, profile: Profile, fleet: Fleet, duration: float, seed: int) -> Run:
    run = Run()
    t0 = time.monotonic()
    await asyncio.gather(sampler(url, run, t0, duration), autoscaler(m, fleet, run, t0, duration),
                         load(url, profile, fleet, run, t0, duration, seed))
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--overlay", type=Path, default=ROOT / "deploy/k8s/overlays/cpu")
    p.add_argument("--adapter", type=Path, default=ROOT / "deploy/k8s/prometheus-adapter")
    p.add_argument("--profile", default="0:0.8,20:2.4,95:0.8",
                   help="cluster load from each second on, in pods' worth of the measured capacity")
    p.add_argument("--calibrate-s", type=float, default=10.0, help="seconds of closed loop measuring capacity")
    p.add_argument("--duration", type=float, default=150.0, help="seconds of load (bounded)")
    p.add_argument("--pull-s", type=float, default=20.0,
                   help="image pull + scheduling of a new pod, assumed (no registry here)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--plot", type=Path, default=ROOT / "deploy/k8s/autoscale_sim.png")
    p.add_argument("--json", type=Path, default=ROOT / "bench/out/autoscale_sim.json")
    args = p.parse_args(argv)
    m = read_manifests(args.overlay, args.adapter)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    proc, url, timings = start_server(args.json.with_suffix(".server.log"))
    try:
        timings["capacity_texts_per_s"] = asyncio.run(calibrate(url, args.calibrate_s, 8))
        profile = Profile(args.profile, timings["capacity_texts_per_s"])
        # A new pod: pulled, then started and loaded as this server was, then seen by one readiness probe.
        fleet = Fleet([Pod(-1e9, -1e9, -1e9) for _ in range(m.hpa.min_replicas)], args.pull_s,
                      timings["ready_s"] + m.readiness_period_s)
        run = asyncio.run(simulate(url, m, profile, fleet, args.duration, args.seed))
    finally:
        stop_server(proc)
    summary = summarise(run, profile, args.duration, timings, m, fleet)
    args.json.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    plot(run, profile, m, summary, args.plot)
    print(f"server: live after {timings['live_s']:.1f} s, ready after {timings['ready_s']:.1f} s, "
          f"model load {timings['model_load_s']:.2f} s; scale-up delay {summary['scale_up_delay_s']} s "
          f"(pull {args.pull_s:g} s assumed); max RSS {summary['max_rss_mib']} MiB; capacity "
          f"{timings['capacity_texts_per_s']:.1f} texts/s per pod (closed loop, 8 users)")
    print("| from s | to s | cluster texts/s | requests | errors | P50 ms | P99 ms | max queue |")
    print("|---|---|---|---|---|---|---|---|")
    for ph in summary["phases"]:
        print(f"| {ph['from_s']:g} | {ph['to_s']:g} | {ph['cluster_texts_per_s']:.0f} | {ph['requests']} | "
              f"{ph['errors']} | {ph['p50_ms']} | {ph['p99_ms']} | {ph['max_queue']:g} |")
    print("HPA syncs (t: current -> replicas, proposals):")
    for d in run.decisions:
        print(f"  {d.t:6.1f}: {d.current} -> {d.replicas}  {d.proposals}")
    print(f"plot: {args.plot}  figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
