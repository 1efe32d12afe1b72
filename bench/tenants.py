"""Tenants (issue 33): the fair share under a flood, and what the bookkeeping costs a request.

Fair share: two servers side by side, the fake model at a fixed cost per token (tests/fakes.py PacedHandler, one
token per character, 2 ms each) so the queue drains at a known pace. ``tenants``: a flooder (share 1, 1,000 tokens
per minute) and chat (share 3); ``fifo``: the same two keys as ``server.api_keys``, one tenant, today's ranking.
Each round holds the worker, queues the flood (tenants: 10x its budget sent, what the budget admits queued, the
rest 429; fifo: as many as tenants admitted), then chat's requests, and releases it: chat's latency, the flood's,
and how many flood requests the model ran before chat's last (from the model's record).

Bookkeeping: the same calls admission makes per request (resolve the key, admit, charge and place on the fair
clock, settle, leave, the rate-limit headers), in-process, against the old key check alone.

    .venv/bin/python bench/tenants.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import signal
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

import httpx
import yaml

from inferd.api.security import key_matches
from inferd.bench.procs import ROOT, start_inferd
from inferd.core.tenants import Tenancy
from inferd.settings import Settings

TEXT, BUDGET, SECONDS_PER_TOKEN, CHAT_REQUESTS = 50, 1000, 0.002, 10
FLOOD, CHAT = "key-flood", "key-chat"


def tenants_file(path: Path, flood: str) -> None:
    """The flooder under a new name (and key) each round: a kept tenant keeps its bucket across a SIGHUP."""
    path.write_text(yaml.safe_dump({"tenants": [
        {"name": flood, "keys": [f"key-{flood}"], "tokens_per_minute": BUDGET, "share": 1},
        {"name": "chat", "keys": [CHAT], "share": 3}]}))


def bookkeeping(n: int = 20_000) -> dict[str, float]:
    tenancy = Tenancy(Settings.model_validate({"server": {"tenants": [
        {"name": "flood", "keys": [FLOOD], "tokens_per_minute": 10**9, "requests_per_second": 10**6,
         "max_concurrent": 10**6, "share": 1},
        {"name": "chat", "keys": [CHAT], "share": 3}]}}))

    def one() -> None:
        tenant = tenancy.resolve(FLOOD)
        assert tenant is not None
        priority = tenant.admit("m", 0)
        now = time.monotonic()
        tenant.queue("m", 40, now, priority, 1.0)
        tenant.done("m", 40, True, 0.004, 8, 1)
        tenant.leave()
        tenant.headers(now)

    per_request = min(timeit.repeat(one, number=n, repeat=5)) / n
    old = min(timeit.repeat(lambda: key_matches(FLOOD, (FLOOD, CHAT)), number=n, repeat=5)) / n
    return {"tenant_bookkeeping_us": per_request * 1e6, "old_key_check_us": old * 1e6}


def start(tmp: Path, name: str, env: dict[str, str]) -> object:
    (tmp / name / "gates").mkdir(parents=True)
    return start_inferd(tmp / name, tmp, 1, {
        "INFERD__MODEL__TASK": "fakes:PacedHandler", "FAKE_SECONDS_PER_TOKEN": str(SECONDS_PER_TOKEN),
        "INFERD__MODEL__NAME": "fake", "INFERD__BATCHING__MAX_BATCH_SIZE": "2", "INFERD__BATCHING__MAX_WAIT_MS": "0",
        "INFERD__SERVER__ADMIN_KEY": "admin", "FAKE_RECORD": str(tmp / name / "record.jsonl"),
        "FAKE_GATE_DIR": str(tmp / name / "gates"),
        "PYTHONPATH": f"{ROOT / 'src'}:{ROOT / 'tests'}", **env}, name=name)


def ran(record: Path) -> list[str]:
    return [t for line in record.read_text().splitlines() if line for t in json.loads(line)["texts"]]


def round_of(server: object, tmp: Path, name: str, r: int, flood_count: int, flood_key: str) -> dict[str, float]:
    url = server.url  # type: ignore[attr-defined]
    http = httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64))

    def post(key: str, text: str) -> tuple[int, float]:
        t0 = time.perf_counter()
        status = http.post("/v1/embeddings", json={"input": text},
                           headers={"Authorization": f"Bearer {key}"}).status_code
        return status, time.perf_counter() - t0

    def in_flight() -> int:
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in http.get("/metrics").text.splitlines()
                       if line.startswith("inferd_requests_in_flight")))

    gate = f"r{r}"
    flood = [f"{name} {r} flood {i:04d} ".ljust(TEXT, "f") for i in range(flood_count)]
    chat = [f"{name} {r} chat {i:04d} ".ljust(TEXT, "c") for i in range(CHAT_REQUESTS)]
    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        held = pool.submit(post, CHAT, f"hold:{gate}")
        while f"hold:{gate}" not in ran(tmp / name / "record.jsonl"):
            time.sleep(0.01)
        sent = [pool.submit(post, flood_key, t) for t in flood]
        while sum(f.done() for f in sent) + in_flight() - 1 < len(sent):
            time.sleep(0.01)
        chats = [pool.submit(post, CHAT, t) for t in chat]
        while in_flight() - 1 - sum(1 for f in sent if not f.done()) < len(chat):
            time.sleep(0.01)
        (tmp / name / "gates" / gate).touch()
        held.result()
        flood_results = [f.result() for f in sent]
        chat_results = [f.result() for f in chats]
    http.close()
    admitted = {t for t, (status, _) in zip(flood, flood_results, strict=True) if status == 200}
    order = ran(tmp / name / "record.jsonl")
    last_chat = max(order.index(t) for t in chat)
    chat_ms = sorted(s * 1e3 for _, s in chat_results)
    flood_ms = sorted(s * 1e3 for status, s in flood_results if status == 200)
    return {"admitted": len(admitted), "refused": sum(1 for s, _ in flood_results if s == 429),
            "flood_before_chat_last": sum(1 for t in order[:last_chat] if t in admitted),
            "chat_p99_ms": chat_ms[-1], "flood_p50_ms": statistics.median(flood_ms), "flood_p99_ms": flood_ms[-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(json.dumps(bookkeeping()), flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tenants_file(tmp / "tenants.yaml", "flood-start")
        servers = {"tenants": start(tmp, "tenants", {"INFERD__SERVER__TENANTS_FILE": str(tmp / "tenants.yaml")}),
                   "fifo": start(tmp, "fifo", {"INFERD__SERVER__API_KEYS": f"{FLOOD},{CHAT}"})}
        try:
            for name in servers:  # the fair clock's seconds per token, measured from answers
                for i in range(8):
                    httpx.post(servers[name].url + "/v1/embeddings", json={"input": f"warm {i}".ljust(TEXT, "w")},
                               headers={"Authorization": f"Bearer {CHAT}"}, timeout=60)
            for r in range(args.rounds):
                key = f"key-flood-{r}"
                # A full budget each round: a new flooding tenant (SIGHUP).
                tenants_file(tmp / "tenants.yaml", f"flood-{r}")
                servers["tenants"].proc.send_signal(signal.SIGHUP)  # type: ignore[attr-defined]
                while httpx.post(servers["tenants"].url + "/v1/embeddings", json={"input": ""},  # type: ignore[attr-defined]
                                 headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 401:
                    time.sleep(0.05)
                fair = round_of(servers["tenants"], tmp, "tenants", r, 10 * BUDGET // TEXT, key)
                print(json.dumps({"round": r, "server": "tenants", **fair}), flush=True)
                fifo = round_of(servers["fifo"], tmp, "fifo", r, fair["admitted"], FLOOD)
                print(json.dumps({"round": r, "server": "fifo", **fifo}), flush=True)
        finally:
            for server in servers.values():
                server.stop()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
