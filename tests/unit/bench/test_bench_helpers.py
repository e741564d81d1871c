"""The benchmarks' pure helpers: overhead arithmetic, sweep parsing, result merging, the
trainer breakdown, the report's table filling, and that the API benchmark sends the same
content to the Atropos routes and to the native routes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.api.bodies import atropos_group, encode_bodies, native_group
from bench.common import overhead, parse_list, parse_points, pct, run_child, write_result
from bench.report.build import fill, fill_pages
from bench.trainer.breakdown import breakdown

pytestmark = pytest.mark.unit


def test_overhead_uses_medians_and_pairs() -> None:
    r = overhead([100.0, 110.0, 90.0], [95.0, 99.0, 90.0])
    assert r["direct_median"] == 100.0 and r["through_median"] == 95.0
    assert r["overhead"] == pytest.approx(0.05)
    assert r["overhead_pair_min"] == pytest.approx(0.0)
    assert r["overhead_pair_max"] == pytest.approx(0.1)


def test_overhead_rejects_unpaired_input() -> None:
    with pytest.raises(ValueError):
        overhead([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        overhead([], [])


def test_parse_sweeps() -> None:
    assert parse_list("4, 8,16") == [4, 8, 16]
    assert parse_list("tiny,base", str) == ["tiny", "base"]
    assert parse_points("8:4,16:1") == [(8, 4), (16, 1)]
    with pytest.raises(ValueError):
        parse_points("8")
    with pytest.raises(ValueError):
        parse_list(" , ")


def test_pct() -> None:
    assert pct([3.0], 99) == 3.0
    assert pct(list(range(1, 102)), 50) == pytest.approx(51.0)
    with pytest.raises(ValueError):
        pct([], 50)


def test_write_result_merges_keys(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    write_result(out, "a", {"x": 1})
    write_result(out, "b", {"x": 2})
    write_result(out, "a", {"x": 3})
    assert json.loads(out.read_text()) == {"a": {"x": 3}, "b": {"x": 2}}


def test_breakdown_fractions_sum_to_one() -> None:
    rows = [
        {"wait_s": 1.0, "step_s": 6.0, "checkpoint_s": 1.0, "sync_s": 2.0, "staleness_mean": 1},
        {"wait_s": 0.0, "step_s": 4.0, "checkpoint_s": 1.0, "sync_s": 1.0, "staleness_mean": 0},
    ]
    b = breakdown(rows)
    assert b["wall_s"] == 16.0 and b["steps"] == 2
    assert b["wait_frac"] == pytest.approx(1 / 16)
    fracs = (b["wait_frac"], b["step_frac"], b["checkpoint_frac"], b["sync_frac"])
    assert sum(fracs) == pytest.approx(1.0)
    assert b["step_time_median_s"] == pytest.approx(8.0)
    assert b["staleness_mean"] == pytest.approx(0.5)


def test_fill_replaces_only_the_marked_table() -> None:
    doc = "intro\n<!-- table:a -->\nold\n<!-- /table:a -->\nmiddle\n<!-- table:b -->\nkeep\n<!-- /table:b -->\n"
    out = fill(doc, "a", "| new |\n")
    assert "| new |" in out and "old" not in out
    assert "keep" in out and out.startswith("intro\n") and "middle" in out
    assert fill(out, "a", "| newer |").count("<!-- table:a -->") == 1


def test_each_table_goes_to_the_page_holding_its_markers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text("# A\n<!-- table:x -->\nold\n<!-- /table:x -->\n")
    b.write_text("# B, no markers\n")
    assert fill_pages([a, b], {"x": "| x |", "y": "| y |"}) == [a]
    assert "| x |" in a.read_text() and b.read_text() == "# B, no markers\n"
    assert "table:y" in capsys.readouterr().err  # no page holds y's markers
    assert fill_pages([a, b], {"x": "| x |"}) == []  # nothing new: nothing rewritten


def test_a_childs_result_is_read_from_the_file_it_wrote() -> None:
    """run_child starts ``python -m MODULE`` (with ``env`` on top of this environment) and reads
    the JSON file the child wrote; a child that wrote none fails the point (whatever its stdout
    said)."""
    import os

    got = run_child("tests.unit.bench_child", {"point": 3})
    assert got["point"] == 3 and got["pid"] != os.getpid() and got["env"] is None
    got = run_child("tests.unit.bench_child", {"point": 4}, env={"BENCH_CHILD_ENV": "set"})
    assert got["env"] == "set" and "BENCH_CHILD_ENV" not in os.environ  # the child's alone
    with pytest.raises(SystemExit, match="failed"):
        run_child("tests.unit.bench_child", {"fail": True})


def test_atropos_and_native_payloads_carry_the_same_content() -> None:
    """What the API benchmark sends to the Atropos routes is, once our API converts it, what
    it sends to the native route: the two measure the same work."""
    from api import atropos_wire
    from api.atropos_convert import to_native
    from api.protocol import ScoredGroup

    posted = atropos_wire.prepare(atropos_group(5, 4, 32), "reject")
    converted = to_native(posted.payload, "g", "bench", 0)
    ours = ScoredGroup.model_validate_json(converted).sequences
    native = ScoredGroup.model_validate(native_group(5, 4, 32)).sequences
    assert [s.model_dump() for s in ours] == [s.model_dump() for s in native]
    assert all(sum(seq.mask) == 16 for seq in native)  # half the sequence is the completion
    # every group is distinct, so content-hash group ids never collapse two of them
    assert atropos_group(1, 2, 8) != atropos_group(2, 2, 8)
    assert len(encode_bodies("atropos", 10, 2, 8, per_push=4)) == 3


def test_bridge_table_compares_each_mode_with_the_floors_of_its_own_run() -> None:
    from bench.sync.tables import table

    def mode(key: str, label: str, sync_s: float, floors: dict | None) -> dict:
        med = {
            "sync_s": sync_s,
            "transfer_s": 0.002,
            "server_pause_s": 0.01,
            "client_gap_s": 0.02,
            "median_token_gap_s": 0.002,
            "bytes": 2**20,
        }
        m = {"key": key, "label": label, "median": med, "best": med}
        return m | ({"floors": floors} if floors is not None else {})

    old = {"memcpy_s": 0.001, "apply_floor_s": 0.019}  # an earlier run: floor 20 ms
    res = {
        "params": 4e6,
        "memcpy_s": 0.002,  # the latest run: floor 40 ms
        "apply_floor_s": 0.038,
        "modes": [
            mode("broadcast", "kept", 0.030, old),
            mode("reload", "new", 0.060, {"memcpy_s": 0.002, "apply_floor_s": 0.038}),
            mode("single_copy", "no floors recorded", 0.080, None),
        ],
    }
    text = table({"tiny": res})
    rows = {ln.split(" | ")[1]: ln for ln in text.splitlines() if ln.startswith("| tiny (")}
    assert rows["kept"].endswith("| 2.0x | 1.50x |")  # 2 ms / 1 ms; 30 ms / 20 ms
    assert rows["new"].endswith("| - | 1.50x |")  # 60 / 40
    assert rows["no floors recorded"].endswith("| 1.0x | 2.00x |")  # falls back to the latest
    assert "earlier run, against that run's floors (ms): tiny kept: memcpy 1.0, apply 19.0" in text
    # a run that measured LoRA only has no memcpy floor: no ratio, no crash
    lora_only = {"params": 4e6, "apply_floor_s": 0.02, "modes": [mode("lora", "LoRA", 0.05, None)]}
    assert table({"tiny": lora_only}).count("| - | - |") == 1


def test_bridge_table_names_the_rounds_a_box_freeze_hit() -> None:
    from bench.sync.tables import freeze_note, table

    def rnd(sync_s: float, gap_s: float, freeze_s: float | None) -> dict:
        r = {"sync_s": sync_s, "client_gap_s": gap_s}
        return r | ({"box_freeze_s": freeze_s} if freeze_s is not None else {})

    med = {
        "sync_s": 0.1,
        "transfer_s": None,
        "server_pause_s": 0.0,
        "client_gap_s": 0.02,
        "median_token_gap_s": 0.002,
        "bytes": 2**20,
    }
    rounds = [
        rnd(9.0, 9.0, 8.9),
        rnd(0.04, 0.02, 0.001),
        rnd(3.0, 2.9, 2.8),
        rnd(0.06, 0.03, 0.002),
        rnd(0.05, 0.01, None),
    ]
    m = {"key": "lora", "label": "LoRA", "median": med, "best": med, "rounds": rounds}
    # the first round is the warm-up: not counted
    assert freeze_note(m) == (
        "1 of 4 rounds hit a box freeze (an idle probe process stopped 2.8-2.8 s: the whole "
        "machine, not the bridge); the other rounds: sync median 50.0 ms, largest token gap "
        "20.0 ms."
    )
    assert freeze_note(m | {"rounds": rounds[:2]}) is None
    res = {"params": 4e6, "memcpy_s": 0.001, "apply_floor_s": 0.02, "modes": [m]}
    assert "\n- tiny LoRA: 1 of 4 rounds hit a box freeze" in table({"tiny": res})


def _stop_outside_its_lock(probe) -> None:
    """SIGSTOP the probe's process where it does not hold its state's lock (stopped inside
    its update, it would block the test's reset for good): stopped ("T" in /proc), the lock
    free, or continued and stopped again, a bounded number of times."""
    import os
    import signal
    import time

    from launch.lifeline import is_stopped

    pid, lock = probe._proc.pid, probe._state.get_lock()
    for _ in range(100):
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60  # bounded: a probe that died fails, not hangs
        while not is_stopped(pid):
            assert time.monotonic() < deadline and probe._proc.is_alive(), "probe not stopped"
            time.sleep(0.01)
        if lock.acquire(False):
            lock.release()
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError("the probe was stopped holding its lock 100 times")


def test_freeze_probe_counts_a_stop_inside_its_window_only() -> None:
    import os
    import signal
    import time

    from bench.sync.probes import FreezeProbe

    probe = FreezeProbe()
    try:
        time.sleep(0.1)  # the probe loops once its constructor returns
        opened = probe.reset()
        time.sleep(0.2)
        # nothing stopped it: at most the window itself (a loaded box oversleeps, by chance)
        assert probe.largest() <= time.monotonic() - opened
        # the probe process stopped for ~1.3 s, 0.3 s of it after the window opened (what a
        # freeze of the whole VM looks like to it): only the part inside the window counts,
        # bounded by the times this test measured, not by what a loaded box allows. The window
        # opens only once the kernel reports the probe stopped (a signal is delivered later).
        _stop_outside_its_lock(probe)
        time.sleep(1.0)
        opened = probe.reset()
        time.sleep(0.3)
        continued = time.monotonic()
        os.kill(probe._proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60  # a loaded box may take a while to run it again
        while probe.largest() < continued - opened and time.monotonic() < deadline:
            pass
        largest = probe.largest()
        assert continued - opened <= largest <= time.monotonic() - opened
    finally:
        probe.close()
