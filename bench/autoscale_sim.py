"""The HPA of deploy/k8s replayed against a real inferd: would it follow a load step, too late, or flap?

Run: .venv/bin/python bench/autoscale_sim.py   (about 3.5 minutes: start-up and calibration, then 160 s of load)

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

from inferd.bench.http import CLIENT_ERRORS, LeanClient
from inferd.bench.procs import free_port
from inferd.bench.stats import percentile
from inferd.corpus import texts as corpus_texts

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
    texts: float  # cumulative texts computed (inferd_batch_size_sum)
    rss: float


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    sent: list[tuple[float, float, int]] = field(default_factory=list)  # (send time, latency s, status)
    ready: list[tuple[float, int, int, float]] = field(default_factory=list)  # (t, ready, replicas, per pod/s)
    mu: list[tuple[float, float]] = field(default_factory=list)  # (t, texts per busy second)
    served: list[tuple[float, dict[str, float | None]]] = field(default_factory=list)  # a ready pod's, per sync
    overflow: int = 0


def scrape(text: str) -> tuple[float, float, float, float]:
    queue = busy = texts = rss = 0.0
    for line in text.splitlines():
        if line.startswith("inferd_queue_depth "):
            queue = float(line.split()[1])
        elif line.startswith("inferd_inference_duration_seconds_sum"):
            busy += float(line.split()[-1])
        elif line.startswith("inferd_batch_size_sum"):
            texts += float(line.split()[-1])
        elif line.startswith("process_resident_memory_bytes "):
            rss = float(line.split()[1])
    return queue, busy, texts, rss


def service_rate(samples: list[Sample], seconds: float = 10.0) -> float | None:
    """Texts the worker computes per second of forward pass, over the last ``seconds``: what the pod can serve
    at full load right now. On a shared machine it drops when other processes take the CPU."""
    if len(samples) < 2:
        return None
    last = samples[-1]
    first = next((s for s in samples if s.t >= last.t - seconds), samples[0])
    busy = last.busy_s - first.busy_s
    return (last.texts - first.texts) / busy if busy >= 1.0 else None


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
    """Cluster load from "start:pods,start:pods,...": from each second on, that many pods' worth of work, a pod's
    worth being its service rate at that moment (texts per second of forward pass, measured over the last 10 s).
    On a machine shared with other work the server gets a varying share of the CPU; offering the load in its own
    units keeps the experiment about a pod with its own cores, which is what the Deployment asks for."""

    def __init__(self, spec: str) -> None:
        self.steps = sorted((float(a), float(b)) for a, b in (p.split(":") for p in spec.split(",")))

    def pods(self, t: float) -> float:
        return next(r for s, r in reversed(self.steps) if t >= s)


async def sampler(url: str, run: Run, t0: float, duration: float) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        while (now := time.monotonic() - t0) < duration:
            r = await client.get(url + "/metrics")
            run.samples.append(Sample(now, *scrape(r.text)))
            mu = service_rate(run.samples)
            if mu is not None:
                run.mu.append((now, mu))
            await asyncio.sleep(max(0.0, math.floor(now) + 1 - (time.monotonic() - t0)))


async def autoscaler(m: Manifests, fleet: Fleet, run: Run, t0: float, duration: float) -> None:
    controller = Controller(m.hpa)
    while (now := time.monotonic() - t0) < duration:
        await asyncio.sleep(SYNC_S - now % SYNC_S)
        now = time.monotonic() - t0
        step = m.scrape_s
        scrapes = [s for s in run.samples if s.t % step < 1.0]  # the samples falling on scrape ticks
        decision = controller.sync(now, len(fleet.pods), pod_values(m, fleet, scrapes, now))
        run.served.append((now, {name: served_value(w, scrapes, now) for name, w in m.windows.items()}))
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
        per_pod = profile.pods(scheduled) * run.mu[-1][1] / max(1, fleet.ready(scheduled))
        scheduled += rng.expovariate(per_pod)
        if scheduled >= duration:
            break
        delay = scheduled - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        run.ready.append((scheduled, fleet.ready(scheduled), len(fleet.pods), per_pod))
        if len(tasks) >= MAX_IN_FLIGHT:
            run.overflow += 1
            continue
        task = asyncio.create_task(send(scheduled, rng.choice(texts)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    await client.aclose()


async def calibrate(url: str, seconds: float, concurrency: int) -> float:
    """The first service rate (texts per second of forward pass), from a closed loop of ``concurrency`` users."""
    before = scrape(httpx.get(url + "/metrics", timeout=5).text)
    client = LeanClient(url)
    texts = corpus_texts(500, 7)
    done = 0
    stop = time.monotonic() + seconds

    async def user(i: int) -> None:
        nonlocal done
        while time.monotonic() < stop:
            status, _ = await client.request("POST", "/predict", orjson.dumps({"texts": [texts[(done + i) % 500]]}))
            done += status == 200

    await asyncio.gather(*(user(i) for i in range(concurrency)))
    await client.aclose()
    after = scrape(httpx.get(url + "/metrics", timeout=5).text)
    return (after[2] - before[2]) / max(after[1] - before[1], 1e-9)


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
    for (start, pods), end in zip(profile.steps, bounds[1:], strict=True):
        sent = [(lat, st) for t, lat, st in run.sent if start <= t < end]
        ok = [lat for lat, st in sent if st == 200]
        queue = [s.queue for s in run.samples if start <= s.t < end]
        mu = [v for t, v in run.mu if start <= t < end]
        phases.append({"from_s": start, "to_s": end, "pods_of_load": pods, "requests": len(sent),
                       "mean_service_rate": round(sum(mu) / len(mu), 1) if mu else None,
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
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "generator_overflow": run.overflow}


def plot(run: Run, profile: Profile, m: Manifests, summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_load, ax_q, ax_r) = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    ts = [s.t for s in run.samples]
    ax_load.plot([t for t, _ in run.mu], [v for _, v in run.mu], color="gray", lw=1,
                 label="a pod's service rate now (texts per busy second, 10 s)")
    offered = run.ready[::10]
    ax_load.plot([t for t, *_ in offered], [v for *_, v in offered], ".", ms=3,
                 label="offered to each ready pod (texts/s)")
    ax_load.set_ylabel("texts/s")
    ax_load.set_ylim(bottom=0)
    ax_units = ax_load.twinx()
    ax_units.step([s for s, _ in profile.steps] + [ts[-1]], [r for _, r in profile.steps] + [profile.steps[-1][1]],
                  where="post", color="tab:red", lw=1.5, label="cluster load (pods' worth)")
    ax_units.set_ylim(0, max(r for _, r in profile.steps) * 1.3)
    ax_units.set_ylabel("pods' worth", color="tab:red")
    lines = ax_load.get_legend_handles_labels()[0] + ax_units.get_legend_handles_labels()[0]
    ax_load.legend(lines, [str(x.get_label()) for x in lines], loc="upper left", fontsize=7)
    queue_target = next(t.average for t in m.hpa.targets if t.name == "inferd_queue_depth")
    ax_q.plot(ts, [s.queue for s in run.samples], lw=0.8, color="tab:blue", alpha=0.6,
              label="inferd_queue_depth (1 s samples)")
    served = [(t, v["inferd_queue_depth"]) for t, v in run.served if v.get("inferd_queue_depth") is not None]
    ax_q.plot([t for t, _ in served], [v for _, v in served], "o-", color="tab:blue", ms=4,
              label="queue depth the adapter serves (30 s avg)")
    ax_q.axhline(queue_target, color="tab:blue", ls="--", lw=1, label=f"queue target {queue_target:g}")
    ax_q.set_yscale("symlog", linthresh=1.0)
    ax_q.set_ylim(bottom=0)
    ax_q.set_ylabel("texts waiting per pod")
    ax_b = ax_q.twinx()
    for target in m.hpa.targets:
        if target.name == "inferd_queue_depth":
            continue
        pts = [(t, v[target.name]) for t, v in run.served if v.get(target.name) is not None]
        ax_b.plot([t for t, _ in pts], [v for _, v in pts], "s-", color="tab:green", ms=4,
                  label=f"{target.name} the adapter serves (1 m rate)")
        ax_b.axhline(target.average, color="tab:green", ls="--", lw=1, label=f"busy target {target.average:g}")
    ax_b.set_ylim(0, 1.25)
    ax_b.set_ylabel("busy ratio", color="tab:green")
    lines = ax_q.get_legend_handles_labels()[0] + ax_b.get_legend_handles_labels()[0]
    ax_q.legend(lines, [str(x.get_label()) for x in lines], loc="upper left", fontsize=7)
    ax_r.step([r[0] for r in run.ready], [r[2] for r in run.ready], where="post", lw=2, label="replicas (HPA)")
    ax_r.step([r[0] for r in run.ready], [r[1] for r in run.ready], where="post", lw=2, label="ready replicas")
    top = m.hpa.max_replicas + 2
    for target, marker in zip(m.hpa.targets, ("x", "+"), strict=False):
        pts = [(d.t, d.proposals[target.name]) for d in run.decisions if d.proposals[target.name] is not None]
        # Proposals beyond the axis (a backlog's) are drawn on its top edge: only maxReplicas matters then.
        ax_r.plot([t for t, _ in pts], [min(v, top - 0.3) for _, v in pts], marker, ms=8,
                  label=f"proposal from {target.name}")
    ax_r.set_ylim(0, top)
    ax_r.axhline(m.hpa.max_replicas, color="gray", ls=":", lw=1, label="maxReplicas")
    ax_r.set_ylabel("replicas")
    ax_r.set_xlabel("seconds")
    ax_r.legend(loc="upper left", fontsize=7)
    fig.suptitle(f"HPA of deploy/k8s/overlays/cpu replayed against a real inferd (scale-up delay "
                 f"{summary['scale_up_delay_s']} s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def simulate(url: str, m: Manifests, profile: Profile, fleet: Fleet, duration: float, seed: int,
                   first_rate: float) -> Run:
    run = Run()
    run.mu.append((0.0, first_rate))
    t0 = time.monotonic()
    await asyncio.gather(sampler(url, run, t0, duration), autoscaler(m, fleet, run, t0, duration),
                         load(url, profile, fleet, run, t0, duration, seed))
    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--overlay", type=Path, default=ROOT / "deploy/k8s/overlays/cpu")
    p.add_argument("--adapter", type=Path, default=ROOT / "deploy/k8s/prometheus-adapter")
    p.add_argument("--profile", default="0:0.8,15:2.0,115:0.8",
                   help="cluster load from each second on, in pods' worth (see Profile)")
    p.add_argument("--calibrate-s", type=float, default=10.0, help="closed loop measuring the first service rate")
    p.add_argument("--duration", type=float, default=160.0, help="seconds of load (bounded)")
    p.add_argument("--pull-s", type=float, default=20.0,
                   help="image pull + scheduling of a new pod, assumed (no registry here)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--plot", type=Path, default=ROOT / "deploy/k8s/autoscale_sim.png")
    p.add_argument("--json", type=Path, default=ROOT / "bench/out/autoscale_sim.json")
    args = p.parse_args(argv)
    m = read_manifests(args.overlay, args.adapter)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    proc, url, timings = start_server(args.json.with_suffix(".server.log"))
    try:
        timings["first_service_rate"] = asyncio.run(calibrate(url, args.calibrate_s, 4))
        profile = Profile(args.profile)
        time.sleep(5)  # let the calibration's last batches leave the queue before the first scrape
        # A new pod: pulled, then started and loaded as this server was, then seen by one readiness probe.
        fleet = Fleet([Pod(-1e9, -1e9, -1e9) for _ in range(m.hpa.min_replicas)], args.pull_s,
                      timings["ready_s"] + m.readiness_period_s)
        run = asyncio.run(simulate(url, m, profile, fleet, args.duration, args.seed,
                                   timings["first_service_rate"]))
    finally:
        stop_server(proc)
    summary = summarise(run, profile, args.duration, timings, m, fleet)
    summary["load_average_at_start"] = load_at_start
    args.json.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    plot(run, profile, m, summary, args.plot)
    print(f"server: live after {timings['live_s']:.1f} s, ready after {timings['ready_s']:.1f} s, "
          f"model load {timings['model_load_s']:.2f} s; scale-up delay {summary['scale_up_delay_s']} s "
          f"(pull {args.pull_s:g} s assumed); max RSS {summary['max_rss_mib']} MiB; load average "
          f"{load_at_start} at start, {summary['load_average']} at end (2 cores, shared)")
    print("| from s | to s | pods' worth | service rate | requests | errors | P50 ms | P99 ms | max queue |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ph in summary["phases"]:
        print(f"| {ph['from_s']:g} | {ph['to_s']:g} | {ph['pods_of_load']:g} | {ph['mean_service_rate']} | "
              f"{ph['requests']} | {ph['errors']} | {ph['p50_ms']} | {ph['p99_ms']} | {ph['max_queue']:g} |")
    print("HPA syncs (t: current -> replicas, proposals):")
    for d in run.decisions:
        print(f"  {d.t:6.1f}: {d.current} -> {d.replicas}  {d.proposals}")
    print(f"plot: {args.plot}  figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
