"""The scheduling policy ``next_batch`` as a pure function, and the bounded BatchQueue around it."""

from __future__ import annotations

import itertools
import math
import threading
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferd.core.batcher import BatchQueue, QueueClosed, QueueFull
from inferd.core.capabilities import Capabilities
from inferd.core.lanes import Lane, ReadyBatch, choose_lane
from inferd.core.scheduler import Decision, Policy, next_batch

_seq = itertools.count()


@dataclass(eq=False)
class Slot:
    """A model slot as the scheduler sees it (core/scheduler.py Slot): its identity and its capabilities."""

    capabilities: Capabilities = field(default_factory=Capabilities)


MAIN, OTHER = Slot(), Slot()
_named: dict[str, Slot] = {}


def slot(name: str) -> Slot:
    """One slot per name, as each lane's model has one."""
    return _named.setdefault(name, Slot())


@dataclass(eq=False)
class Item:
    tokens: int
    priority: int = 0
    enqueued: float = 0.0
    deadline: float = math.inf
    slot: Slot = MAIN
    gone: bool = False
    seq: int = field(default_factory=lambda: next(_seq))


def policy(**kw: float | bool) -> Policy:
    base = {"max_batch_size": 32, "max_batch_tokens": 8192, "max_wait_ms": 0.0, "sort_window": 128,
            "ageing_ms": 1000.0}
    base.update(kw)
    return Policy(**base)  # type: ignore[arg-type]


def cost(batch: list[Item]) -> int:
    return max(it.tokens for it in batch) * len(batch)


def test_empty_queue_decides_nothing_and_waits_for_input():
    d = next_batch([], 5.0, policy(max_wait_ms=2))
    assert d.empty and d.wait is None


def test_batch_size_is_capped():
    items = [Item(10) for _ in range(10)]
    d = next_batch(items, 1.0, policy(max_batch_size=4))
    assert len(d.batch) == 4


def test_padded_token_budget_is_longest_times_count():
    # 100 x 3 = 300 fits 350; a fourth would make 400.
    items = [Item(100) for _ in range(6)]
    d = next_batch(items, 1.0, policy(max_batch_tokens=350))
    assert len(d.batch) == 3
    # A short head with long companions: each long one raises the padded cost of the whole batch.
    mixed = [Item(10), Item(100), Item(100), Item(100)]
    d = next_batch(mixed, 1.0, policy(max_batch_tokens=250))
    assert cost(d.batch) <= 250 and len(d.batch) == 2


def test_length_grouping_takes_the_nearest_lengths_to_the_head():
    head = Item(10)
    others = [Item(200), Item(12), Item(300), Item(9), Item(11), Item(250)]
    d = next_batch([head, *others], 1.0, policy(max_batch_size=4))
    assert d.batch[0] is head
    assert sorted(it.tokens for it in d.batch) == [9, 10, 11, 12]


def test_a_long_head_is_not_starved_by_short_companions():
    # The oldest item leads its batch whatever its length; short items group around it later.
    long_head = Item(400, enqueued=0.0)
    shorts = [Item(5, enqueued=0.1) for _ in range(8)]
    d = next_batch([*shorts, long_head], 1.0, policy(max_batch_size=4, max_batch_tokens=1000))
    assert d.batch[0] is long_head and cost(d.batch) <= 1000


def test_min_padding_efficiency_keeps_a_far_length_out_of_the_batch():
    # 40 + 36 + 200 real tokens padded to 200 x 3 = 0.46: with a 0.8 floor the 200-token text waits.
    head, near, far = Item(40), Item(36), Item(200)
    d = next_batch([head, near, far], 1.0, policy(min_padding_efficiency=0.8))
    assert d.batch == [head, near]
    assert sum(it.tokens for it in d.batch) >= 0.8 * cost(d.batch)
    # With no floor the same queue is one batch; the far item is not lost, it leads the next batch.
    assert len(next_batch([head, near, far], 1.0, policy(min_padding_efficiency=0.0)).batch) == 3
    assert next_batch([far], 1.0, policy(min_padding_efficiency=0.8)).batch == [far]


def test_grouping_only_looks_inside_the_sort_window():
    head, far, near_but_late = Item(10), Item(100), Item(10)
    d = next_batch([head, far, near_but_late], 1.0, policy(sort_window=2, max_batch_size=2))
    assert d.batch == [head, far]


def test_higher_priority_runs_first():
    low, high = Item(10, priority=0), Item(10, priority=5)
    d = next_batch([low, high], 1.0, policy(max_batch_size=1))
    assert d.batch == [high]


def test_background_work_never_rides_in_a_batch_led_by_live_work():
    """A batch job's lines (the lowest priority) fill batches of their own: a live request leads its batch with the
    other live requests only, not with up to max_batch_size - 1 job lines it would then wait for."""
    job = [Item(10, priority=-100, enqueued=0.0) for _ in range(40)]
    live = [Item(10, priority=0, enqueued=1.0), Item(12, priority=-99, enqueued=1.0)]
    d = next_batch([*job, *live], 1.0, policy())
    assert d.batch == live
    # Alone (or once they lead), background items batch together as any others do.
    d = next_batch(job, 1.0, policy())
    assert d.batch == job[:32]


def test_background_batches_stay_small_while_live_requests_arrive():
    """A live request that arrives while a job's batch runs waits for it: background batches keep to
    background_live_batch_tokens while live requests came within background_quiet_s, to background_max_batch_tokens
    after that quiet (or with no live request ever)."""
    job = [Item(10, priority=-100, enqueued=0.0) for _ in range(40)]
    p = policy(background_live_batch_tokens=40, background_max_batch_tokens=200, background_quiet_s=1.0)
    assert next_batch(job, 5.0, p, last_live=4.5).batch == job[:4]
    assert next_batch(job, 5.0, p, last_live=3.9).batch == job[:20]  # quiet for over a second
    assert next_batch(job, 5.0, p, last_live=None).batch == job[:20]  # never any live work
    # Padded tokens: the longest line times the count.
    mixed = [Item(100, priority=-100), *(Item(10, priority=-100) for _ in range(20))]
    small = next_batch(mixed, 5.0, policy(background_live_batch_tokens=300, background_quiet_s=1.0), last_live=4.9)
    assert small.batch[0] is mixed[0] and cost(small.batch) <= 300 and len(small.batch) == 3
    # Live work keeps the full bounds, beside background work too.
    live = [Item(10, enqueued=0.0) for _ in range(40)]
    assert next_batch([*job, *live], 5.0, p, last_live=5.0).batch == live[:32]


def test_a_job_s_batches_on_a_runner_that_widens_keep_the_bound_of_a_job_alone_beside_live_requests():
    """Where a job's batch runs on every thread and live batches on their own instances beside it (an OpenVINO graph
    of several instances), no live request waits for it: the tighter bound is for runners where one would."""
    wide = Slot(Capabilities(can_use_all_threads=True))
    job = [Item(10, priority=-100, enqueued=0.0, slot=wide) for _ in range(40)]
    p = policy(background_live_batch_tokens=40, background_max_batch_tokens=200, background_quiet_s=1.0)
    assert next_batch(job, 5.0, p, last_live=4.5).batch == job[:20]
    narrow = [Item(10, priority=-100, enqueued=0.0) for _ in range(40)]
    assert next_batch(narrow, 5.0, p, last_live=4.5).batch == narrow[:4]


def test_the_queue_notes_live_puts_and_background_batches_shrink_after_one():
    queue = BatchQueue()
    queue.add_lane("m", policy(background_live_batch_tokens=30, background_quiet_s=60.0), max_queue=100)
    queue.put([Item(10, priority=-100) for _ in range(10)], "m")
    assert len(queue.take(timeout=1.0).batch) == 10  # background only so far: full batches
    queue.put([Item(10, priority=-100) for _ in range(10)], "m")
    queue.put([Item(10, priority=0)], "m")
    assert [it.priority for it in queue.take(timeout=1.0).batch] == [0]
    assert len(queue.take(timeout=1.0).batch) == 3  # a live request just came: the job's batches are small


def test_fifo_within_a_priority_level():
    items = [Item(10, enqueued=0.0) for _ in range(5)]
    order = []
    pending = list(reversed(items))  # the order in the list must not matter, only seq
    while pending:
        d = next_batch(pending, 1.0, policy(max_batch_size=1))
        order += d.batch
        pending = [it for it in pending if it not in d.batch]
    assert order == items
    late, early = Item(10, enqueued=0.5), Item(10, enqueued=0.2)
    assert late.seq < early.seq  # the time waited, not the seq, decides between different ages
    assert next_batch([late, early], 1.0, policy(max_batch_size=1)).batch == [early]


def test_ageing_lets_old_low_priority_work_overtake_fresh_high_priority():
    low = Item(10, priority=0, enqueued=0.0)
    high = Item(10, priority=2, enqueued=1.0)
    p = policy(max_batch_size=1, ageing_ms=1000)
    assert next_batch([low, high], 1.0, p).batch == [high]  # aged 1 < 2
    high.enqueued = 3.0
    assert next_batch([low, high], 3.0, p).batch == [low]  # aged 3 > 2


def test_low_priority_completes_under_a_stream_of_high_priority_work():
    low = Item(10, priority=-3, enqueued=0.0)
    p = policy(max_batch_size=1, ageing_ms=100)
    pending: list[Item] = [low]
    now = 0.0
    for step in range(200):
        now = step * 0.01
        pending.append(Item(10, priority=5, enqueued=now))  # new urgent work every step
        d = next_batch(pending, now, p)
        if low in d.batch:
            break
        pending = [it for it in pending if it not in d.batch]
    else:
        pytest.fail("the low-priority item never ran")
    # 8 levels at one level per 100 ms: it wins once it has waited about 0.8 s.
    assert 0.7 <= now <= 1.0


def test_passed_deadlines_expire_and_never_join_a_batch():
    late, due_now, fine = Item(10, deadline=0.5), Item(10, deadline=1.0), Item(10, deadline=2.0)
    d = next_batch([late, due_now, fine], 1.0, policy())
    assert d.expired == [late, due_now]
    assert d.batch == [fine]


def test_gone_items_are_dropped_before_they_run():
    gone, here = Item(10, gone=True, deadline=0.0), Item(10)
    d = next_batch([gone, here], 1.0, policy())
    assert d.dropped == [gone] and d.expired == [] and d.batch == [here]


def test_an_oversize_head_runs_alone_at_once():
    big = Item(5000, enqueued=0.0)
    small = [Item(10, enqueued=0.1) for _ in range(3)]
    d = next_batch([big, *small], 0.2, policy(max_batch_tokens=4096, max_wait_ms=50))
    assert d.batch == [big] and d.wait is None


def test_an_oversize_item_does_not_hold_others_back():
    small = [Item(10, enqueued=0.0) for _ in range(3)]
    big = Item(5000, enqueued=0.01)
    p = policy(max_batch_tokens=4096, max_wait_ms=50)
    # With max_wait, the small ones wait for companions; the oversize one cannot be one, so it is not
    # counted: they run when the oldest has waited max_wait, not later.
    d = next_batch([*small, big], 0.02, p)
    assert d.batch == [] and d.wait == pytest.approx(0.03)
    d = next_batch([*small, big], 0.05, p)
    assert d.batch == small
    assert next_batch([big], 0.05, p).batch == [big]


def test_max_wait_holds_a_partial_batch_for_companions():
    first = Item(10, enqueued=1.0)
    p = policy(max_wait_ms=2)
    d = next_batch([first], 1.0005, p)
    assert d.batch == [] and d.wait == pytest.approx(0.0015)
    assert next_batch([first], 1.002, p).batch == [first]


def test_adaptive_wait_runs_a_lone_request_when_no_companion_is_due():
    first = Item(10, enqueued=1.0)
    p = policy(max_wait_ms=2)
    # Requests come 20 ms apart: the next one is due at 1.020, long after the wait would end (1.002).
    assert next_batch([first], 1.0001, p, arrival_gap=0.020).batch == [first]
    # 0.5 ms apart: one is due within the wait, so the batch waits for it as before.
    d = next_batch([first], 1.0001, p, arrival_gap=0.0005)
    assert d.batch == [] and d.wait == pytest.approx(0.0019)
    # Off, or no estimate yet: the plain max_wait.
    assert next_batch([first], 1.0001, policy(max_wait_ms=2, adaptive_wait=False), arrival_gap=0.020).batch == []
    assert next_batch([first], 1.0001, p, arrival_gap=None).batch == []


def test_a_lane_estimates_the_gap_between_requests():
    lane = Lane("m", policy(), 8)
    for t in (0.0, 0.010, 0.020, 0.030):
        lane.note_arrival(t)
    assert lane.arrival_gap == pytest.approx(0.010)
    lane.note_arrival(100.0)  # a long pause counts as ARRIVAL_GAP_CAP_S (1 s), weighted 0.2
    assert lane.arrival_gap == pytest.approx(0.2 * 1.0 + 0.8 * 0.010)
    for i in range(1, 30):  # a burst 1 ms apart brings it back down
        lane.note_arrival(100.0 + i * 0.001)
    assert lane.arrival_gap < 0.002


def test_no_waiting_when_max_wait_is_zero():
    assert next_batch([Item(10, enqueued=1.0)], 1.0, policy(max_wait_ms=0)).batch


def test_no_waiting_when_the_batch_is_full():
    items = [Item(10, enqueued=1.0) for _ in range(4)]
    d = next_batch(items, 1.0, policy(max_batch_size=4, max_wait_ms=100))
    assert len(d.batch) == 4 and d.wait is None


def test_no_waiting_when_the_token_budget_is_full():
    items = [Item(100, enqueued=1.0) for _ in range(3)]
    d = next_batch(items, 1.0, policy(max_batch_tokens=200, max_wait_ms=100))
    assert len(d.batch) == 2 and d.wait is None


def test_waiting_never_outlasts_a_deadline():
    item = Item(10, enqueued=1.0, deadline=1.001)
    d = next_batch([item], 1.0, policy(max_wait_ms=50))
    assert d.batch == [] and d.wait == pytest.approx(0.001)
    assert next_batch([item], 1.001, policy(max_wait_ms=50)).expired == [item]


def test_a_batch_holds_one_slot_only():
    a1, b1, a2, b2 = Item(10, slot=MAIN), Item(10, slot=OTHER), Item(10, slot=MAIN), Item(10, slot=OTHER)
    d = next_batch([a1, b1, a2, b2], 1.0, policy())
    assert d.batch == [a1, a2]
    assert next_batch([b1, b2], 1.0, policy()).batch == [b1, b2]


# -- properties ----------------------------------------------------------------------------------------

policies = st.builds(
    Policy,
    max_batch_size=st.integers(1, 16),
    max_batch_tokens=st.integers(16, 2048),
    max_wait_ms=st.sampled_from([0.0, 0.5, 2.0, 10.0]),
    sort_window=st.integers(1, 64),
    ageing_ms=st.sampled_from([1.0, 100.0, 1000.0]),
    min_padding_efficiency=st.sampled_from([0.0, 0.5, 0.8, 1.0]),
)


@st.composite
def workloads(draw: st.DrawFn) -> list[Item]:
    n = draw(st.integers(0, 60))
    out = []
    for _ in range(n):
        enqueued = draw(st.floats(0.0, 0.05))
        timeout = draw(st.one_of(st.just(math.inf), st.floats(0.0001, 0.05)))
        out.append(Item(
            tokens=draw(st.integers(1, 3000)), priority=draw(st.integers(-3, 3)), enqueued=enqueued,
            deadline=enqueued + timeout, slot=draw(st.sampled_from([MAIN, OTHER])),
            gone=draw(st.integers(0, 9)) == 0))
    return out


def check_decision(d: Decision, p: Policy, now: float) -> None:
    if d.batch:
        assert len(d.batch) <= p.max_batch_size
        if len(d.batch) > 1:  # only a lone item may exceed the budget (the over-long one)
            assert cost(d.batch) <= p.max_batch_tokens
            assert sum(it.tokens for it in d.batch) >= p.min_padding_efficiency * cost(d.batch)
        assert len({id(it.slot) for it in d.batch}) == 1
        assert all(not it.gone and it.deadline > now for it in d.batch)
    assert all(it.deadline <= now for it in d.expired)
    assert all(it.gone for it in d.dropped)


@settings(max_examples=300, deadline=None)
@given(items=workloads(), p=policies)
def test_every_item_ends_in_exactly_one_outcome_and_no_batch_breaks_a_limit(items: list[Item], p: Policy):
    outcomes: dict[int, str] = {}
    pending = list(items)
    now = 0.05
    for _ in range(10 * len(items) + 50):
        if not pending:
            break
        d = next_batch(pending, now, p)
        check_decision(d, p, now)
        for kind, chosen in (("batch", d.batch), ("expired", d.expired), ("dropped", d.dropped)):
            for it in chosen:
                assert id(it) not in outcomes, "an item was decided twice"
                outcomes[id(it)] = kind
        if d.empty:
            # Nothing ran, so the policy must say when to look again: the model never idles for ever.
            assert d.wait is not None and d.wait > 0
            now += d.wait
        taken = {id(it) for it in (*d.batch, *d.expired, *d.dropped)}
        pending = [it for it in pending if id(it) not in taken]
    assert not pending, "the scheduler stopped making progress"
    assert set(outcomes) == {id(it) for it in items}


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 8), max_size=20), max_queue=st.integers(8, 24),
       p=policies.map(lambda p: Policy(p.max_batch_size, p.max_batch_tokens, 0.0, p.sort_window, p.ageing_ms)))
def test_queue_accepts_or_refuses_whole_requests_and_loses_nothing(sizes: list[int], max_queue: int, p: Policy):
    queue = lanes_queue(m=(p, max_queue, 1.0))
    accepted: list[Item] = []
    refused = 0
    for n in sizes:
        request = [Item(10, seq=queue.next_seq()) for _ in range(n)]
        try:
            queue.put(request, "m")
            accepted += request
        except QueueFull:
            refused += n
            assert len(queue) + n > max_queue  # refused only when it really does not fit
        assert len(queue) <= max_queue
    ran: list[Item] = []
    while (d := queue.take(timeout=0)) is not None:
        check_decision(d, p, 0.0)
        ran += d.batch
    assert sorted(map(id, ran)) == sorted(map(id, accepted))
    assert len(ran) + refused == sum(sizes)


def test_the_queue_claims_each_batch_it_hands_out_under_its_lock():
    # The engine's claim takes the batch's model reference: it must run while no remove() can interleave.
    claimed: list[list[Item]] = []
    queue: BatchQueue

    def claim(batch: list[Item]) -> None:
        other: list[bool] = []  # can another thread (the event loop's remove) take the lock now?

        def try_lock() -> None:
            other.append(queue._cond.acquire(blocking=False))
            if other[-1]:
                queue._cond.release()

        probe = threading.Thread(target=try_lock)
        probe.start()
        probe.join()
        assert other == [False]
        claimed.append(list(batch))

    queue = BatchQueue(claim=claim)
    queue.add_lane("m", policy(max_batch_size=2), 16)
    items = [Item(5, seq=queue.next_seq()) for _ in range(3)]
    queue.put(items, "m")
    first, second = queue.take(timeout=0), queue.take(timeout=0)
    assert first is not None and second is not None
    assert claimed == [first.batch, second.batch] and sum(map(len, claimed)) == 3
    assert queue.remove(items) == 0  # all handed out, each with its claim


def test_a_posted_chore_reaches_the_taker_even_with_nothing_queued():
    queue = BatchQueue()
    ran: list[str] = []
    queue.post(lambda: ran.append("freed"))
    decision = queue.take(timeout=1.0)
    assert decision is not None and decision.empty and len(decision.posted) == 1
    decision.posted[0]()
    assert ran == ["freed"] and queue.take_posted() == []


def test_the_padding_floor_follows_the_slot_a_backend_without_padding_cost_has_none():
    # The same 0.46 mix: a slot that says padding costs it nothing (varlen) batches it; one that pads does not.
    free, paying = Slot(Capabilities(pads=False)), Slot(Capabilities(pads=True))
    items = [Item(40, slot=free), Item(36, slot=free), Item(200, slot=free)]
    assert len(next_batch(items, 1.0, policy(min_padding_efficiency=0.8)).batch) == 3
    items = [Item(40, slot=paying), Item(36, slot=paying), Item(200, slot=paying)]
    assert len(next_batch(items, 1.0, policy(min_padding_efficiency=0.8)).batch) == 2
    # The token budget still holds without a floor.
    items = [Item(40, slot=free), Item(36, slot=free), Item(200, slot=free)]
    assert len(next_batch(items, 1.0, policy(min_padding_efficiency=0.8, max_batch_tokens=450)).batch) == 2


# -- lanes: one queue per model, chosen between by priority, then fair share -------------------------------

def test_choose_lane_ranks_priority_then_least_served_then_deadline_then_order():
    assert choose_lane([ReadyBatch(0, 5.0, 1.0), ReadyBatch(1, 9.0, 9.0)]) == 1  # priority first
    assert choose_lane([ReadyBatch(0, 5.0, 1.0), ReadyBatch(0, 2.0, 9.0)]) == 1  # then the least served
    assert choose_lane([ReadyBatch(0, 2.0, 9.0), ReadyBatch(0, 2.0, 1.0)]) == 1  # then the nearest deadline
    assert choose_lane([ReadyBatch(0, 2.0, 1.0), ReadyBatch(0, 2.0, 1.0)]) == 0  # then configuration order


def lanes_queue(**lanes: tuple[Policy, int, float]) -> BatchQueue:
    queue = BatchQueue()
    for name, (p, max_queue, share) in lanes.items():
        queue.add_lane(name, p, max_queue, share)
    return queue


def test_a_flooded_lane_cannot_starve_another_and_shares_follow_device_time():
    """Lane a holds 50 batches when b's work arrives: b waits one batch at most (it starts level with a, not with
    credit for its idle time), then, charged equal device time per batch, a and b alternate while both have
    work; a lane of share 2 gets two batches for each of the other's."""
    queue = lanes_queue(a=(policy(max_batch_size=4), 512, 1.0), b=(policy(max_batch_size=4), 512, 1.0))
    queue.put([Item(5, slot=slot("a"), seq=queue.next_seq()) for _ in range(200)], "a")
    first = queue.take(timeout=0)
    assert first is not None and first.lane == "a"
    queue.charge("a", 0.010)
    queue.put([Item(5, slot=slot("b"), seq=queue.next_seq()) for _ in range(8)], "b")  # levelled: no idle credit
    order = []
    for _ in range(6):
        d = queue.take(timeout=0)
        assert d is not None
        order.append(d.lane)
        queue.charge(d.lane, 0.010)
    assert order == ["a", "b", "a", "b", "a", "a"]  # b's two batches interleaved, then a alone
    assert queue.depth("a") == 200 - 4 * 5 and queue.depth("b") == 0

    weighted = lanes_queue(big=(policy(max_batch_size=1), 64, 2.0), small=(policy(max_batch_size=1), 64, 1.0))
    weighted.put([Item(5, slot=slot("big"), seq=weighted.next_seq()) for _ in range(30)], "big")
    weighted.put([Item(5, slot=slot("small"), seq=weighted.next_seq()) for _ in range(30)], "small")
    runs = []
    for _ in range(30):
        d = weighted.take(timeout=0)
        assert d is not None
        runs.append(d.lane)
        weighted.charge(d.lane, 0.010)
    assert runs.count("big") == 20 and runs.count("small") == 10


def test_priority_between_lanes_comes_before_fairness():
    queue = lanes_queue(a=(policy(max_batch_size=2), 64, 1.0), b=(policy(max_batch_size=2), 64, 1.0))
    queue.charge("b", 100.0)  # b has had far more of the device ...
    queue.put([Item(5, slot=slot("a"), seq=queue.next_seq()) for _ in range(2)], "a")
    queue.put([Item(5, priority=5, slot=slot("b"), seq=queue.next_seq())], "b")
    d = queue.take(timeout=0)
    assert d is not None and d.lane == "b"  # ... but its request asked for a higher priority


def test_each_lane_keeps_its_own_rules_and_bound():
    queue = lanes_queue(small=(policy(max_batch_size=2), 4, 1.0), big=(policy(max_batch_size=8), 64, 1.0))
    with pytest.raises(QueueFull):
        queue.put([Item(5, slot=slot("small")) for _ in range(5)], "small")
    queue.put([Item(5, slot=slot("big"), seq=queue.next_seq()) for _ in range(8)], "big")  # the other's bound holds
    d = queue.take(timeout=0)
    assert d is not None and (d.lane, len(d.batch)) == ("big", 8)
    queue.put([Item(5, slot=slot("small"), seq=queue.next_seq()) for _ in range(4)], "small")
    d = queue.take(timeout=0)
    assert d is not None and (d.lane, len(d.batch)) == ("small", 2)
    assert queue.max_queue("small") == 4 and queue.max_queue("big") == 64 and len(queue) == 2


def test_a_retired_lane_takes_nothing_new_runs_what_it_holds_then_goes():
    queue = lanes_queue(a=(policy(max_batch_size=2), 64, 1.0), b=(policy(), 64, 1.0))
    queue.put([Item(5, slot=slot("a"), seq=queue.next_seq()) for _ in range(3)], "a")
    queue.retire_lane("a")
    with pytest.raises(QueueClosed):
        queue.put([Item(5, slot=slot("a"))], "a")
    taken = [queue.take(timeout=0), queue.take(timeout=0)]
    assert [len(d.batch) for d in taken if d is not None] == [2, 1]  # nothing accepted is dropped
    assert queue.lane_names() == ["b"]
    queue.add_lane("a", policy(), 8)  # the model is back (SIGHUP): its lane serves again
    queue.put([Item(5, slot=slot("a"), seq=queue.next_seq())], "a")
    assert queue.depth("a") == 1


def test_the_shadow_taker_wakes_when_another_taker_empties_the_live_lanes():
    # The shadow instance holds its batch back while live work waits; the live lanes are not its own, so it has
    # no wait of its own to look again: the taker that empties them must wake it (it slept until the next put).
    queue = BatchQueue()
    queue.add_lane("m", policy(max_batch_size=4), 16)
    queue.add_lane("m#shadow", policy(max_batch_size=4), 16, shadow=True)
    queue.put([Item(5, seq=queue.next_seq())], "m#shadow")
    queue.put([Item(5, seq=queue.next_seq())], "m")
    got: list[object] = []
    shadow = threading.Thread(target=lambda: got.append(queue.take(timeout=60.0, lanes=lambda lane: lane.shadow)))
    shadow.start()
    live = queue.take(timeout=0, lanes=lambda lane: not lane.shadow)
    assert live is not None and live.lane == "m"
    shadow.join(5.0)  # woken, it takes its batch at once; unwoken, it sleeps its 60 s
    alive = shadow.is_alive()
    queue.close()
    shadow.join()
    assert not alive and got[0] is not None and got[0].lane == "m#shadow"


def _waiting(queue: BatchQueue, n: int) -> None:
    give_up = time.monotonic() + 5
    while len(queue._idle) < n:  # noqa: SLF001
        assert time.monotonic() < give_up, "the takers never began to wait"
        time.sleep(0.001)


def test_a_put_wakes_one_taker_of_its_lane_and_what_it_leaves_wakes_the_next():
    # Each wake-up is a thread the OS must run on the event loop's cores: a put wakes one waiting taker that
    # serves its lane, not every taker of every model; the batch limit leaves work behind, and the taker that
    # takes it wakes another of the lane's takers for the rest.
    queue = BatchQueue()
    queue.add_lane("a", policy(max_batch_size=1), 16)
    queue.add_lane("b", policy(max_batch_size=1), 16)
    got: list[object] = []
    takers = [threading.Thread(target=lambda accept=accept: got.append(queue.take(timeout=30.0, lanes=accept)))
              for accept in (lambda lane: lane.name == "a", lambda lane: lane.name == "a",
                             lambda lane: lane.name == "b")]
    for t in takers:
        t.start()
    _waiting(queue, 3)
    with queue._cond:  # noqa: SLF001 (the lock: no taker runs between the put and the look)
        queue.put([Item(5, seq=queue.next_seq()), Item(5, seq=queue.next_seq())], "a")
        woken = [(t.lanes(queue._lanes["a"]), t.woken) for t in queue._idle]  # noqa: SLF001
    assert sorted(woken) == [(False, False), (True, False), (True, True)]
    for t in takers[:2]:
        t.join(5.0)
    assert [d.lane for d in got] == ["a", "a"]  # both of lane a's takers ran, one batch each; b's slept on
    assert takers[2].is_alive()
    queue.close()
    takers[2].join(5.0)
    assert got[-1] is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "shadow", "retire", "put", "drain"]),
                          st.sampled_from(["a", "b", "c"]), st.integers(1, 100)), max_size=25))
def test_the_largest_bound_is_the_largest_model_lane_s_as_lanes_change(steps: list[tuple[str, str, int]]):
    # What InferenceEngine.limits reads per request without the lock: it must match a scan after every change.
    queue = BatchQueue()
    for op, name, bound in steps:
        if op == "add":
            queue.add_lane(name, policy(), bound)
        elif op == "shadow":
            queue.add_lane(f"{name}#shadow", policy(), bound, shadow=True)
        elif op == "retire":
            queue.retire_lane(name)
        elif op == "put" and queue.lane_rules(name) is not None:
            queue.put([Item(1, slot=slot(name), seq=queue.next_seq())], name)  # a retired lane with work stays
        elif op == "drain":
            queue.drain_all()
        rules = [queue.lane_rules(n) for n in queue.lane_names() if not n.endswith("#shadow")]
        assert queue.largest_bound == max((r[1] for r in rules if r is not None), default=0)
