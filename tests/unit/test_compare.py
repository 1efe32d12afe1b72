"""`inferd bench --compare`: the round order, the verdict rule, the paired ratios and the venv key."""

from __future__ import annotations

import math

import pytest

from inferd.bench import compare
from inferd.bench.run import build_parser


def test_rounds_alternate_the_order_so_drift_falls_on_both_sides() -> None:
    names = ["main", "."]
    assert [compare.round_order(names, r) for r in range(4)] == [["main", "."], [".", "main"]] * 2


@pytest.mark.parametrize("ref, other, higher, want", [
    ([100, 102, 101], [90, 95, 99], True, "slower beyond noise"),  # every round of B below every round of A
    ([100, 102, 101], [99, 103, 98], True, "within noise"),  # one round of B above one of A's
    ([100, 102, 101], [103, 110, 104], True, "faster beyond noise"),
    ([10.0, 11.0], [12.0, 13.0], False, "slower beyond noise"),  # latency: higher is worse
    ([10.0, 11.0], [8.0, 9.5], False, "faster beyond noise"),
    ([], [1.0], True, "no data"),
])
def test_verdict_needs_every_round_beyond_every_round(ref: list[float], other: list[float], higher: bool,
                                                      want: str) -> None:
    assert compare.verdict(ref, other, higher) == want


def test_the_chance_of_a_false_verdict_is_one_ordering_in_c_2n_n() -> None:
    """The docstring's figure: identical servers give 'slower beyond noise' with probability 1/C(2n, n)."""
    import itertools

    n = 4
    values = list(range(2 * n))  # distinct figures, every assignment to A and B equally likely
    slower = sum(compare.verdict([values[i] for i in range(2 * n) if i not in b], [values[i] for i in b], True)
                 == "slower beyond noise" for b in itertools.combinations(range(2 * n), n))
    assert slower == 1 and math.comb(2 * n, n) == 70


def test_figures_pair_each_round_with_the_references_same_round() -> None:
    rounds = {"main": [{"texts_per_s": 100.0, "server_cpu_ms_per_text": 10.0, "open_p50_ms": 10.0,
                        "open_p99_ms": 20.0},
                       {"texts_per_s": 80.0, "server_cpu_ms_per_text": 10.5, "open_p50_ms": 12.0, "open_p99_ms": 30.0}],
              ".": [{"texts_per_s": 90.0, "server_cpu_ms_per_text": 9.0, "open_p50_ms": 11.0, "open_p99_ms": 22.0},
                    {"texts_per_s": 76.0, "server_cpu_ms_per_text": 9.5, "open_p50_ms": 12.0, "open_p99_ms": None}]}
    figs = compare.compare_figures(rounds, ["main", "."])
    tps = figs["."]["texts_per_s"]
    assert tps["ratio"] == {"median": 0.925, "min": 0.9, "max": 0.95}  # 90/100 and 76/80, not 76/100
    assert tps["verdict"] == "within noise"  # 90 lies above main's 80
    assert figs["main"]["texts_per_s"]["verdict"] == "reference"
    assert figs["."]["server_cpu_ms_per_text"]["verdict"] == "faster beyond noise"  # less CPU is better
    assert figs["."]["open_p99_ms"]["ratio"]["median"] == 1.1  # a missing round is left out of the pairs
    md = compare.markdown({"command": "inferd bench --compare main,.", "revisions": {
        "main": {"sha": "a" * 40}, ".": {"sha": "working tree"}}, "rounds": rounds, "open_rate": 40.0,
        "concurrency": 32, "duration_s": 10.0, "open_duration_s": 10.0, "figures": figs})
    assert "| . (working tree) | texts_per_s | 83.0 | 76.0–90.0 | 0.925 (0.9–0.95) | within noise |" in md
    assert "main: 100.0, 80.0; .: 90.0, 76.0" in md


def test_revisions_with_the_same_locks_share_a_venv() -> None:
    assert compare.venv_key(["torch==2.13.0\n"]) == compare.venv_key(["torch==2.13.0\n"])
    assert compare.venv_key(["torch==2.13.0\n"]) != compare.venv_key(["torch==2.13.0\n", "pytest==8\n"])
    assert compare.venv_key(["a\n", "b\n"]) != compare.venv_key(["a\nb\n"])


def test_the_cli_takes_a_list_of_revisions_and_refuses_one() -> None:
    args = build_parser().parse_args(["--compare", "08a2169, main ,.", "--compare-rounds", "3"])
    assert args.compare == ["08a2169", "main", "."] and args.compare_rounds == 3
    args = build_parser().parse_args(["--compare", "main"])
    with pytest.raises(SystemExit, match="two or more"):
        compare.compare_revisions(args, print, None, "")  # type: ignore[arg-type]
