"""Shadow traffic: the drift report against an offline computation, the verdict, the shadow lane's place in the
queue, and an in-process engine whose shadow candidate never changes a live answer and is shed first."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from enginekit import EngineKit, by_folder, until
from fakes import HashHandler, vector_for
from settingskit import make_settings

from inferd.core.agreement import overlap_at_k
from inferd.core.batcher import BatchQueue, QueueFull
from inferd.core.capabilities import Capabilities
from inferd.core.errors import ModelLoadError, NoShadow, ShadowRefused, SpaceChanged
from inferd.core.scheduler import Policy
from inferd.core.shadow import (
    DriftReport,
    aggregate,
    shadow_lane,
    shadow_policy,
    verdict,
)
from inferd.core.shadow_slot import sampled
from inferd.core.tasks.embedding_task import COSINE_EDGES
from inferd.settings import CanarySettings, GateSettings, ShadowSettings

GATE = GateSettings()


# -- the report, against an offline computation ------------------------------------------------------------


def offline_embedding(a: np.ndarray, b: np.ndarray, window: int, k: int) -> dict[str, Any]:
    """The figures computed the plain way: a loop over texts in arrival order, windows as lists."""
    def unit(v: np.ndarray) -> np.ndarray:
        return v / np.linalg.norm(v)

    cos = [float(unit(x) @ unit(y)) for x, y in zip(a, b, strict=True)]
    overlaps = []
    for i in range(len(a)):
        lo = max(0, i - window)
        if i - lo >= k:
            wa = [unit(a[j]) for j in range(lo, i)]
            wb = [unit(b[j]) for j in range(lo, i)]
            na = set(np.argsort([-(unit(a[i]) @ w) for w in wa], kind="stable")[:k].tolist())
            nb = set(np.argsort([-(unit(b[i]) @ w) for w in wb], kind="stable")[:k].tolist())
            overlaps.append(len(na & nb) / k)
    return {"cos": cos, "overlaps": overlaps}


def test_embedding_figures_equal_an_offline_computation() -> None:
    rng = np.random.default_rng(3)
    a = rng.normal(size=(90, 16))
    b = a + rng.normal(scale=0.3, size=a.shape)
    report = DriftReport("embedding", "v2", window=32, neighbours=5)
    for start in range(0, 90, 6):  # requests of six texts, in order
        report.add(list(a[start:start + 6]), list(b[start:start + 6]), f"req-{start}", tokens=[3] * 6)
    want = offline_embedding(a, b, 32, 5)
    got = report.as_dict()
    assert got["requests"]["computed"] == 15 and got["items"] == 90
    assert got["cosine"]["mean"] == pytest.approx(np.mean(want["cos"]), abs=1e-6)
    assert got["cosine"]["min"] == pytest.approx(min(want["cos"]), abs=1e-6)
    assert got["cosine"]["percentiles"]["p50"] == pytest.approx(np.percentile(want["cos"], 50), abs=1e-6)
    assert got["cosine"]["histogram"]["counts"] == np.histogram(want["cos"], bins=COSINE_EDGES)[0].tolist()
    assert got["neighbours"]["count"] == len(want["overlaps"])
    assert got["neighbours"]["mean"] == pytest.approx(np.mean(want["overlaps"]), abs=1e-6)
    worst = got["most_drifted"]
    assert len(worst) == 10 and worst[0]["cosine"] == pytest.approx(min(want["cos"]), abs=1e-6)
    assert "input" not in worst[0] and worst[0]["request_id"].startswith("req-") and worst[0]["tokens"] == 3


def test_the_same_vectors_agree_fully_and_other_sizes_are_another_space() -> None:
    rng = np.random.default_rng(4)
    a = rng.normal(size=(40, 8))
    same = DriftReport("embedding", "v2", neighbours=5)
    same.add(list(a), list(a))
    assert same.figures()["cosine_min"] == pytest.approx(1.0) and same.figures()["overlap_mean"] == 1.0
    other = DriftReport("embedding", "v2", neighbours=5)
    other.add(list(a), list(rng.normal(size=(40, 12))))
    assert other.figures()["cosine_mean"] == 0.0


def test_repeated_texts_computed_in_other_batches_are_no_disagreement() -> None:
    # The same model on both sides, fed requests that repeat two texts: each copy differs by float noise only,
    # so which copy a model ranks first is row order (it once gave overlap 0.66, min 0.0, and refused promotion).
    rng = np.random.default_rng(6)
    texts = rng.normal(size=(2, 16))

    def computed(rows: np.ndarray) -> list[np.ndarray]:
        return list(rows + rng.normal(scale=1e-7, size=rows.shape))

    report = DriftReport("embedding", "v2", window=64, neighbours=10)
    for n in range(120):
        batch = texts[[n % 2, (n + 1) % 2, n % 2]]
        report.add(computed(batch), computed(batch))
    f = report.figures()
    assert f["cosine_min"] == pytest.approx(1.0) and f["overlap_mean"] == 1.0
    assert report.as_dict()["neighbours"]["min"] == 1.0
    assert verdict("embedding", report.items, f, GATE, 100).ok
    # The accuracy gate's overlap over a probe set with repeated texts is the same figure.
    probe = texts[[0, 1] * 12]
    assert overlap_at_k(np.asarray(computed(probe)), np.asarray(computed(probe))) == 1.0
    # A rerank request listing a document twice: the copies tie, under both models.
    scores = rng.random(6)[[0, 1, 2, 2, 3, 4, 5, 5]]
    ranked = DriftReport("rerank", "v2")
    for _ in range(5):
        ranked.add([[x] for x in computed(scores)], [[x] for x in computed(scores)])
    assert ranked.figures()["spearman_mean"] == 1.0 and ranked.figures()["top3_agreement"] == 1.0
    # Still a disagreement where the candidate's order really differs.
    other = DriftReport("embedding", "v2", window=64, neighbours=10)
    a = rng.normal(size=(60, 16))
    other.add(list(a), list(a[rng.permutation(60)]))
    assert other.figures()["overlap_mean"] < 0.5


def test_rerank_and_classification_figures_equal_an_offline_computation() -> None:
    from scipy.stats import spearmanr

    rng = np.random.default_rng(5)
    report = DriftReport("rerank", "v2")
    spearmans, tops, deltas = [], [], []
    for _ in range(6):
        sa = rng.random(8)
        sb = sa + rng.normal(scale=0.2, size=8)
        report.add([[x, x] for x in sa], [[x, x] for x in sb])
        spearmans.append(spearmanr(sa, sb).statistic)
        tops.append(len(set(np.argsort(-sa)[:3]) & set(np.argsort(-sb)[:3])) / 3)
        deltas.append(np.abs(sa - sb).max())
    f = report.figures()
    assert f["spearman_mean"] == pytest.approx(np.mean(spearmans), abs=1e-6)
    assert f["top3_agreement"] == pytest.approx(np.mean(tops), abs=1e-6)
    assert f["score_delta_max"] == pytest.approx(max(deltas), abs=1e-6)

    labels = ["neg", "neu", "pos"]
    pa = rng.dirichlet([1, 1, 1], size=50)
    pb = rng.dirichlet([1, 1, 1], size=50)
    pb[:25] = pa[:25]
    cls = DriftReport("classification", "v2", labels=labels)
    cls.add(list(pa), list(pb))
    agree = pa.argmax(1) == pb.argmax(1)
    assert cls.figures()["label_agreement"] == pytest.approx(agree.mean(), abs=1e-6)
    assert cls.figures()["probability_delta_max"] == pytest.approx(np.abs(pa - pb).max(), abs=1e-6)
    confusion = {(c["active"], c["shadow"]): c["count"] for c in cls.as_dict()["confusion"]}
    for x in range(3):
        for y in range(3):
            expected = int(((pa.argmax(1) == x) & (pb.argmax(1) == y)).sum())
            assert confusion.get((labels[x], labels[y]), 0) == expected


def test_inputs_are_listed_only_when_the_operator_logs_inputs() -> None:
    report = DriftReport("embedding", "v2", log_inputs=True)
    report.add([[1.0, 0.0]], [[0.0, 1.0]], "r1", [2], ["secret words"])
    assert report.as_dict()["most_drifted"][0]["input"] == "secret words"


def test_the_verdict_needs_enough_traffic_and_every_figure_within_the_gates_bounds() -> None:
    few = verdict("embedding", 10, {"cosine_mean": 1.0, "cosine_min": 1.0, "overlap_mean": 1.0}, GATE, 100)
    assert few.code == "shadow_insufficient" and "10 items" in few.reasons[0]
    ok = verdict("embedding", 500, {"cosine_mean": 0.9999, "cosine_min": 0.999, "overlap_mean": 0.99}, GATE, 100)
    assert ok.ok
    drifted = verdict("embedding", 500, {"cosine_mean": 0.2, "cosine_min": 0.1, "overlap_mean": 0.3}, GATE, 100)
    assert drifted.code == "shadow_drifted"
    assert any("cosine_mean 0.200000 < 0.995 (model.gate.int8_cosine_mean)" in r for r in drifted.reasons)
    assert verdict("rerank", 500, {"spearman_mean": 0.5, "top3_agreement": 1.0}, GATE, 100).code == "shadow_drifted"
    assert verdict("classification", 500, {"label_agreement": 1.0}, GATE, 100).ok
    unmeasured = verdict("embedding", 500, {"cosine_mean": 1.0, "cosine_min": 1.0, "overlap_mean": None}, GATE, 100)
    assert unmeasured.code == "shadow_insufficient"


def test_the_shadow_report_measures_and_judges_as_the_accuracy_gate() -> None:
    from inferd.core.tasks import classification_task

    # A multi-label classifier: one of four label decisions differs for 10 of 40 texts. Both count decisions
    # (the shadow once counted texts with any differing label: 0.75 against the gate's 0.9375).
    rng = np.random.default_rng(8)
    pa = rng.random((40, 4))
    pb = pa.copy()
    pb[:10, 0] = 1.0 - pb[:10, 0]
    report = DriftReport("classification", "v2", multi_label=True)
    report.add(list(pa), list(pb))
    assert report.figures()["label_agreement"] == pytest.approx(1 - 10 / 160)
    assert classification_task.label_figures(pa, pb, True)["label_agreement"] == pytest.approx(1 - 10 / 160)
    # A NaN figure passes no bound, in the shadow's verdict as in the gate's judge.
    nan = verdict("embedding", 500, {"cosine_mean": float("nan"), "cosine_min": 1.0, "overlap_mean": 1.0}, GATE, 100)
    assert nan.code == "shadow_drifted" and "cosine_mean nan < 0.995" in nan.reasons[0]


def test_aggregating_workers_sums_the_counts_and_takes_the_worst_figures() -> None:
    def report(computed: int, items: int, cos: float, delta: float) -> dict[str, Any]:
        return {"task": "embedding", "items": items, "figures": {"cosine_min": cos, "score_delta_max": delta},
                "requests": {"sampled": computed + 1, "computed": computed, "shed": 1, "failed": 0}}

    merged = aggregate([report(10, 40, 0.99, 0.1), report(5, 20, 0.5, 0.05)])
    assert merged["items"] == 60 and merged["requests"] == {"sampled": 17, "computed": 15, "shed": 2, "failed": 0}
    assert merged["figures"] == {"cosine_min": 0.5, "score_delta_max": 0.1}


def test_sampling_by_routing_key_is_stable_and_near_the_weight() -> None:
    keys = [f"user-{i}" for i in range(4000)]
    chosen = [k for k in keys if sampled(0.1, k, 0.99)]
    assert chosen == [k for k in keys if sampled(0.1, k, 0.0)]  # the draw is ignored for a key
    assert 300 < len(chosen) < 500
    assert not sampled(0.0, None, 0.0) and sampled(1.0, None, 0.999)


# -- the shadow lane -----------------------------------------------------------------------------------------


class Slot:
    """The one model slot these items share, as the scheduler sees it (core/scheduler.py Slot)."""

    capabilities = Capabilities()


SLOT = Slot()


class Item:
    def __init__(self, tokens: int, priority: int = 0, slot: object = SLOT) -> None:
        self.tokens, self.priority, self.enqueued, self.deadline = tokens, priority, 0.0, math.inf
        self.seq, self.slot, self.gone = 0, slot, False


def test_a_shadow_lane_runs_only_while_no_live_lane_holds_work() -> None:
    queue = BatchQueue()
    queue.add_lane("m", Policy(max_wait_ms=0.0), 8)
    queue.add_lane(shadow_lane("m"), Policy(max_wait_ms=0.0), 2, shadow=True)
    live, mirrored = Item(5), Item(5, priority=-1000)
    queue.put([mirrored], shadow_lane("m"))
    queue.put([live], "m")
    first = queue.take(timeout=1)
    assert first is not None and first.batch == [live]
    second = queue.take(timeout=1)
    assert second is not None and second.batch == [mirrored] and second.lane == "m#shadow"
    queue.put([Item(1), Item(1)], shadow_lane("m"))
    with pytest.raises(QueueFull):
        queue.put([Item(1)], shadow_lane("m"))  # bounded: the third is refused (shed by admission)


def test_shadow_batches_are_capped_by_the_shadow_settings_and_never_wait() -> None:
    live = Policy(max_batch_size=32, max_batch_tokens=8192, max_wait_ms=5.0, sort_window=64)
    capped = shadow_policy(live, ShadowSettings(max_batch_size=4, max_batch_tokens=100))
    assert (capped.max_batch_size, capped.max_batch_tokens, capped.max_wait_ms, capped.sort_window) == (4, 100, 0, 64)
    # A live policy already below the caps keeps its own limits.
    small = shadow_policy(Policy(max_batch_size=2, max_batch_tokens=50), ShadowSettings(max_batch_size=4))
    assert (small.max_batch_size, small.max_batch_tokens) == (2, 50)
    queue = BatchQueue()
    queue.add_lane("m", live, 64)
    queue.add_lane(shadow_lane("m"), capped, 64, shadow=True)
    assert queue.lane_rules(shadow_lane("m")) == (capped, 64) and queue.lane_rules("nope") is None
    queue.put([Item(10) for _ in range(10)], shadow_lane("m"))
    queue.put([Item(150)], shadow_lane("m"))  # alone over the token cap: it runs on its own
    sizes = []
    while len(queue):
        decision = queue.take(timeout=1)
        assert decision is not None and decision.lane == "m#shadow"
        sizes.append(len(decision.batch))
    assert sizes == [4, 4, 2, 1]


# -- an engine with a shadow candidate -----------------------------------------------------------------------


class ShiftedHandler(HashHandler):
    """Another model: every vector is the fake's, rotated, so its space differs."""

    def postprocess(self, outputs: list[str]) -> list[list[float]]:
        return [list(reversed(vector_for(t))) for t in outputs]


def engine_with(tmp_path: Path, shadow: ShadowSettings | None = None, canary: CanarySettings | None = None,
                **batching: Any) -> tuple[EngineKit, dict[str, HashHandler]]:
    """An engine serving folder ``active``; ``same`` (the same space) and ``shifted`` (another) to load beside it."""
    handlers = {"active": HashHandler(), "same": HashHandler(), "shifted": ShiftedHandler()}
    for name in handlers:
        (tmp_path / name).mkdir(exist_ok=True)
    settings = make_settings(tmp_path / "active", batching=batching, shadow=shadow or ShadowSettings(),
                             canary=canary or CanarySettings())
    return EngineKit(settings, by_folder(handlers)), handlers


def test_shadow_never_changes_a_live_answer_and_reports_the_drift(tmp_path: Path) -> None:
    kit, handlers = engine_with(tmp_path)
    engine = kit.engine
    manager = engine.manager
    manager.set_shadow(str(tmp_path / "shifted"), "v2", 1.0)
    texts = [f"text number {i} about cats" for i in range(12)]

    async def scenario() -> None:
        for k in range(0, 12, 3):
            result = await engine.process(engine.request(texts[k:k + 3]))
            assert result.outputs == [vector_for(t) for t in texts[k:k + 3]] and result.version == "1"
        shadow = manager.shadow
        assert shadow is not None
        await until(lambda: shadow.report.computed == 4)
        report = shadow.report.as_dict()
        want = [float(np.dot(vector_for(t), list(reversed(vector_for(t)))) / np.dot(vector_for(t), vector_for(t)))
                for t in texts]
        assert report["cosine"]["mean"] == pytest.approx(np.mean(want), abs=1e-6)
        assert report["requests"] == {"sampled": 4, "computed": 4, "shed": 0, "failed": 0}
        assert kit.sample("inferd_shadow_requests_total", model="all-MiniLM-L6-v2", outcome="computed") == 4
        # Shadow batches stay out of the live metrics: no batch series for the candidate's version.
        assert kit.sample("inferd_batch_size_count", model="all-MiniLM-L6-v2", version="v2") == 0
        assert handlers["shifted"].batches  # it did compute

    kit.run(scenario)


def test_the_candidate_computes_a_request_in_batches_no_larger_than_the_shadow_cap(tmp_path: Path) -> None:
    kit, handlers = engine_with(tmp_path, shadow=ShadowSettings(max_batch_size=4))
    engine = kit.engine
    engine.manager.set_shadow(str(tmp_path / "same"), "v2", 1.0)
    texts = [f"text {i}" for i in range(10)]

    async def scenario() -> None:
        assert (await engine.process(engine.request(texts))).outputs == [vector_for(t) for t in texts]
        shadow = engine.manager.shadow
        assert shadow is not None
        await until(lambda: shadow.report.computed == 1)
        assert [len(b) for b in handlers["active"].batches] == [10]  # the live batch: the model's own limit
        assert sorted(len(b) for b in handlers["same"].batches) == [2, 4, 4]
        assert shadow.report.as_dict()["cosine"]["count"] == 10

    kit.run(scenario)


def test_shadow_work_is_shed_first_when_its_lane_is_full_and_never_refuses_live_work(tmp_path: Path) -> None:
    kit, handlers = engine_with(tmp_path)
    engine = kit.engine
    manager = engine.manager
    manager.set_shadow(str(tmp_path / "same"), "v2", 1.0)

    async def scenario() -> None:
        active = handlers["active"]
        active.gates["g"] = handlers["same"].gates["g"] = threading.Event()
        held = asyncio.ensure_future(engine.process(engine.request(["hold:g"])))
        await until(lambda: any("hold:g" in b for b in active.batches))
        # The worker is held: live requests queue; each answered one mirrors into the shadow lane (bound 256),
        # which cannot run while live work waits.
        live = [asyncio.ensure_future(engine.process(engine.request([f"t{i}"]))) for i in range(6)]
        await asyncio.sleep(0.05)
        active.gates["g"].set()
        results = await asyncio.gather(held, *live)
        assert [r.outputs for r in results[1:]] == [[vector_for(f"t{i}")] for i in range(6)]
        shadow = manager.shadow
        assert shadow is not None
        await until(lambda: shadow.report.computed == 7)
        # Every shadow batch ran after the live batches it was queued beside.
        order = [t for b in handlers["active"].batches + handlers["same"].batches for t in b]
        assert len(order) == 14
        assert kit.sample("inferd_requests_rejected_total", reason="overloaded") == 0

    kit.run(scenario)


def test_shadow_work_that_does_not_fit_its_lane_is_shed_and_counted(tmp_path: Path) -> None:
    kit, _ = engine_with(tmp_path, max_queue=1024)
    engine = kit.engine
    engine.settings = engine.admission.settings = engine.settings.model_copy(
        update={"limits": engine.settings.limits.model_copy(update={"max_items_per_request": 400})})
    manager = engine.manager
    manager.set_shadow(str(tmp_path / "same"), "v2", 1.0)

    async def scenario() -> None:
        # 300 texts: the live answer is exact; the mirror cannot fit the shadow lane's 256 and is shed.
        batch = [f"x{i}" for i in range(300)]
        assert (await engine.process(engine.request(batch))).outputs == [vector_for(t) for t in batch]
        shadow = manager.shadow
        assert shadow is not None
        await until(lambda: shadow.report.shed == 1)
        assert shadow.report.computed == 0
        assert kit.sample("inferd_shadow_requests_total", model="all-MiniLM-L6-v2", outcome="shed") == 1
        assert kit.sample("inferd_requests_rejected_total", reason="overloaded") == 0

    kit.run(scenario)


def test_promotion_follows_the_verdict_unless_forced(tmp_path: Path) -> None:
    kit, _ = engine_with(tmp_path)
    engine = kit.engine
    manager = engine.manager
    with pytest.raises(NoShadow):
        manager.promote_shadow()
    manager.set_shadow(str(tmp_path / "shifted"), "v2", 1.0)

    async def scenario() -> None:
        with pytest.raises(ShadowRefused) as few:
            manager.promote_shadow(min_items=10)
        assert few.value.code == "shadow_insufficient"
        for i in range(12):
            await engine.process(engine.request([f"sentence {i}"]))
        shadow = manager.shadow
        assert shadow is not None
        await until(lambda: shadow.report.computed == 12)
        with pytest.raises(ShadowRefused) as drifted:
            manager.promote_shadow(min_items=10)
        assert drifted.value.code == "shadow_drifted" and "cosine_mean" in str(drifted.value)
        slot = manager.promote_shadow(force=True, min_items=10)
        assert manager.active is slot and manager.shadow is None and slot.version == "v2"

    kit.run(scenario)


def test_a_promoted_canary_starts_the_shadow_s_report_afresh(tmp_path: Path) -> None:
    """The report compares the shadow with the active model: a canary promoted to active is another baseline, as a
    reload is, so the comparisons made against the old one must not count towards the shadow's verdict."""
    kit, _ = engine_with(tmp_path)
    engine = kit.engine
    manager = engine.manager
    manager.set_shadow(str(tmp_path / "shifted"), "v2", 1.0)

    async def scenario() -> None:
        for i in range(3):
            await engine.process(engine.request([f"sentence {i}"]))
        shadow = manager.shadow
        assert shadow is not None
        await until(lambda: shadow.report.computed == 3)
        manager.set_canary(str(tmp_path / "same"), "c1", 0.5)
        manager.promote()
        assert manager.active.version == "c1" and manager.shadow is shadow
        assert shadow.report.computed == 0 and shadow.report.as_dict()["requests"]["sampled"] == 0

    kit.run(scenario)


class HeldHandler(HashHandler):
    """A candidate whose passes wait for ``release`` (set by the test): a comparison in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.release, self.entered = threading.Event(), threading.Event()

    def infer(self, batch: list[Any]) -> list[str]:
        self.entered.set()
        assert self.release.wait(10), "the test never released the candidate"
        return super().infer(batch)


def test_a_comparison_in_flight_across_a_reload_joins_the_old_report_not_the_new(tmp_path: Path) -> None:
    held = HeldHandler()
    handlers = {"active": HashHandler(), "same": HashHandler(), "held": held}
    for name in handlers:
        (tmp_path / name).mkdir()
    kit = EngineKit(make_settings(tmp_path / "active"), by_folder(handlers))
    engine, manager = kit.engine, kit.engine.manager
    manager.set_shadow(str(tmp_path / "held"), "s1", 1.0)

    async def scenario() -> None:
        await engine.process(engine.request(["compared against the first active model"]))
        shadow = manager.shadow
        assert shadow is not None
        old = shadow.report
        await asyncio.to_thread(held.entered.wait, 10)
        await asyncio.to_thread(manager.reload, str(tmp_path / "same"), "v2")
        assert shadow.report is not old  # afresh against the new active model
        held.release.set()
        await until(lambda: old.computed == 1)
        assert shadow.report.computed == 0 and shadow.report.as_dict()["requests"]["sampled"] == 0

    kit.run(scenario)


def test_a_canary_of_another_embedding_space_is_refused_unless_forced(tmp_path: Path) -> None:
    kit, _ = engine_with(tmp_path)
    engine = kit.engine
    manager = engine.manager

    async def scenario() -> None:
        with pytest.raises(SpaceChanged, match="shadow it instead"):
            await asyncio.to_thread(manager.set_canary, str(tmp_path / "shifted"), "v2", 0.5)
        assert manager.canary is None
        same = await asyncio.to_thread(manager.set_canary, str(tmp_path / "same"), "v3", 0.5)
        assert manager.canary is same
        manager.rollback()
        forced = await asyncio.to_thread(manager.set_canary, str(tmp_path / "shifted"), "v4", 0.5, None, True)
        assert manager.canary is forced

    kit.run(scenario)


def test_a_configured_canary_of_another_embedding_space_fails_the_start_unless_forced(tmp_path: Path) -> None:
    shifted = CanarySettings(path=str(tmp_path / "shifted"), version="v2", weight=0.2)
    with pytest.raises(ModelLoadError, match=r"canary.path .*shifted: the canary's embedding space differs.*"
                                             r"canary.force: true"):
        engine_with(tmp_path, canary=shifted)
    forced, _ = engine_with(tmp_path, canary=shifted.model_copy(update={"force": True}))
    assert [(role, slot.version) for role, slot in forced.engine.manager.slots()] == [("active", "1"),
                                                                                      ("canary", "v2")]
    same_kit, _ = engine_with(tmp_path, canary=CanarySettings(path=str(tmp_path / "same"), version="v3",
                                                              weight=0.2))
    same = same_kit.engine
    assert same.manager.canary is not None and same.manager.canary.version == "v3"


def test_outputs_beyond_a_dense_vector_are_compared_by_it_or_counted_as_not_compared() -> None:
    from inferd.core.outputs import SparseVector, TextOutputs

    v = np.ones(4, dtype=np.float32)
    sparse = SparseVector(np.array([1]), np.array([1.0], dtype=np.float32))
    report = DriftReport("embedding", "v2", neighbours=5)
    assert report.add([TextOutputs(dense=v, sparse=sparse)], [TextOutputs(dense=-v, sparse=sparse)])["cosine"] == [-1.0]
    assert report.add([TextOutputs(sparse=sparse)], [TextOutputs(sparse=sparse)]) == {}
    out = report.as_dict()
    assert out["requests"]["uncompared"] == 1 and out["items"] == 1 and "dense vectors only" in out["uncompared"]
