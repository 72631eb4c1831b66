"""The per-tick DP trace: rows from hand-made gathered values, the background writer, reading a
folder back, the Perfetto JSON (validated against the trace-event format) and the script that
writes it and the PNG timeline (no processes besides the script)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from atom.dp.dp_trace import (
    TRACE_COLUMNS,
    TraceWriter,
    generation_folder,
    read_trace,
    tick_row,
    to_perfetto,
)
from atom.dp.prefill_policy import Decision, DecisionReason
from atom.dp.sync import BatchShape, ControlState, GatheredBatchShape, GatheredControl

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "dp_trace.py"
PREFILL = BatchShape(num_tokens=65, num_seqs=2, has_prefill=True, num_prefill_tokens=64,
                     num_decode_seqs=1)
DECODE = BatchShape(num_tokens=4, num_seqs=4, num_decode_seqs=4)
DUMMY = BatchShape(num_tokens=0, num_seqs=0, is_dummy=True)


def tick(t: int, shapes: list[BatchShape], reason: DecisionReason) -> list[tuple]:
    """Both ranks' rows of tick ``t`` (the step takes 10 ms, starting every 20 ms)."""
    gathered = GatheredControl.from_states([
        ControlState(has_work=True, num_admittable=r, num_prefill_tokens=64 * r,
                     has_pending_prefill=bool(r), num_running_decodes=4 - 3 * r,
                     kv_usage_ppm=250_000 * (r + 1), tick=t, collective_count=3 * t,
                     collective_hash=-t) for r in range(2)])
    decision = Decision(reason, num_consecutive_holds=int(reason.holds))
    start_ns = 20_000_000 * t
    return [tick_row(dp_rank=r, gathered=gathered, decision=decision,
                     shapes=GatheredBatchShape.from_shapes(shapes), start_ns=start_ns,
                     synced_ns=start_ns + 1_000_000, end_ns=start_ns + 11_000_000)
            for r in range(2)]


TICKS = [tick(0, [PREFILL, PREFILL], DecisionReason.ALLOW_ALL),
         tick(1, [DECODE, DUMMY], DecisionReason.HOLD_DECODE_INTERVAL),
         tick(2, [DECODE, PREFILL], DecisionReason.DISABLED)]


@pytest.fixture
def trace_dir(tmp_path):
    writers = [TraceWriter(tmp_path, dp_rank=r, dp_size=2, policy="delayer") for r in range(2)]
    for rows in TICKS:
        for writer, row in zip(writers, rows):
            writer.write(row)
    for writer in writers:
        writer.close()
    return tmp_path


def test_rows_round_trip_through_the_writer(trace_dir):
    traces = read_trace(trace_dir)
    assert [t.dp_rank for t in traces] == [0, 1]
    assert traces[0].header["columns"] == list(TRACE_COLUMNS)
    rows = traces[1].rows
    assert [r["tick"] for r in rows] == [0, 1, 2]
    first = rows[0]
    assert (first["num_admittable"], first["num_prefill_tokens"], first["kv_usage_ppm"],
            first["collective_count"], first["collective_hash"]) == (1, 64, 500_000, 0, 0)
    assert (first["sync_us"], first["step_us"], first["start_us"]) == (1000, 10_000, 0)
    assert [(r["allow"], r["reason"]) for r in rows] == [
        (1, "allow_all"), (0, "hold_decode_interval"), (1, "disabled")]
    assert [(r["step_is_dummy"], r["step_num_prefill_tokens"], r["mixed"]) for r in rows] == [
        (0, 64, 0), (1, 0, 0), (0, 64, 1)]


def test_a_later_generation_writes_a_folder_of_its_own_with_its_events(trace_dir):
    membership = {"event": "membership_change", "tick": 0, "generation": 1, "dp_size": 1,
                  "num_collectives": 5}
    writer = TraceWriter(trace_dir, dp_rank=0, dp_size=1, policy="none", generation=1)
    writer.write_event(membership)
    writer.write(TICKS[0][0])
    writer.close()
    assert writer.path == trace_dir / "gen1" / "dp0.jsonl" == generation_folder(trace_dir, 1) / \
        "dp0.jsonl"
    (later,) = read_trace(generation_folder(trace_dir, 1))
    assert (later.header["generation"], later.header["dp_size"]) == (1, 1)
    assert later.events == [membership] and [r["tick"] for r in later.rows] == [0]
    first = read_trace(trace_dir)  # the first group's trace is untouched
    assert [(t.header["generation"], len(t.rows), t.events) for t in first] == [(0, 3, [])] * 2


def test_read_trace_rejects_missing_ranks_and_foreign_files(tmp_path):
    TraceWriter(tmp_path, dp_rank=1, dp_size=2, policy="none").close()
    with pytest.raises(ValueError, match="expected ranks 0..1"):
        read_trace(tmp_path)
    (tmp_path / "dp0.jsonl").write_text('{"format": "something else"}\n')
    with pytest.raises(ValueError, match="not an atom-dp-trace"):
        read_trace(tmp_path)
    with pytest.raises(ValueError, match="no dp<rank>.jsonl"):
        read_trace(tmp_path / "empty")


def test_a_write_error_stops_the_trace_but_not_the_caller(tmp_path, caplog):
    writer = TraceWriter(tmp_path, dp_rank=0, dp_size=1, policy="none")

    def full_disk(_):
        raise OSError(28, "No space left on device")

    writer._file.write = full_disk
    with caplog.at_level("ERROR", logger="atom.dp.dp_trace"):
        for rows in TICKS:
            writer.write(rows[0])
        writer.close()
    assert writer._failed and "No space left" in caplog.text


def validate_trace_events(doc: dict) -> list[dict]:
    """The trace-event format's rules this JSON relies on; returns the events."""
    events = doc["traceEvents"]
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(e), e
        assert isinstance(e["ts"], int) and e["ts"] >= 0, e
        assert e["ph"] in ("X", "i", "C", "M"), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0, e
        if e["ph"] == "i":
            assert e["s"] in ("g", "p", "t"), e
    return events


def test_perfetto_json_has_a_track_per_rank_and_marks_holds_and_mixed_steps(trace_dir):
    doc = json.loads(json.dumps(to_perfetto(read_trace(trace_dir))))  # what a file holds
    events = validate_trace_events(doc)
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {"dp0", "dp1"}
    steps = [(e["tid"], e["name"]) for e in events if e.get("cat") == "step"]
    assert steps == [(0, "prefill"), (0, "decode"), (0, "decode"),
                     (1, "prefill"), (1, "dummy"), (1, "prefill (mixed)")]
    holds = [(e["tid"], e["name"]) for e in events if e["ph"] == "i"]
    assert holds == [(0, "hold: hold_decode_interval"), (1, "hold: hold_decode_interval")]
    sync = next(e for e in events if e.get("cat") == "sync")
    step = next(e for e in events if e.get("cat") == "step")
    # after rank 0's 1 ms sync; each writer measured its own wall - perf offset, which can
    # differ by tens of µs on a busy machine, so the origin may be the other rank's
    assert (step["tid"], step["ts"] - sync["ts"], step["dur"]) == (0, 1000, 10_000)


def test_script_writes_perfetto_json_and_png(trace_dir, tmp_path):
    out_json, out_png = tmp_path / "out" / "trace.json", tmp_path / "out" / "timeline.png"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(trace_dir), "--perfetto",
                           str(out_json), "--png", str(out_png)],
                          capture_output=True, text=True, timeout=300)  # liveness only
    assert proc.returncode == 0, proc.stderr
    assert "dp1: 3 steps, prefill 1, prefill (mixed) 1, decode 0, dummy 1" in proc.stdout
    assert "decisions (delayer): " in proc.stdout
    validate_trace_events(json.loads(out_json.read_text()))
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_png_is_titled_by_the_folder_and_has_a_seconds_axis(trace_dir):
    """The title names the folder, not the absolute path; the top axis maps ticks to seconds
    since the first tick (dp0's rows), both ways, past the rows too."""
    import importlib.util

    import numpy as np

    spec = importlib.util.spec_from_file_location("dp_trace_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    traces = read_trace(trace_dir)
    assert script.default_title(str(trace_dir.resolve()), traces) == \
        f"{trace_dir.name} (policy delayer)"
    rows = traces[0].rows
    forward, inverse = script.tick_to_seconds(rows)
    ticks = np.array([row["tick"] for row in rows], dtype=float)
    seconds = [(row["start_us"] - rows[0]["start_us"]) / 1e6 for row in rows]
    np.testing.assert_allclose(forward(ticks), seconds, atol=1e-6)
    wide = np.linspace(ticks[0] - 5, ticks[-1] + 5, 50)
    assert np.all(np.diff(forward(wide)) > 0)  # monotonic, also outside the rows
    np.testing.assert_allclose(inverse(forward(wide)), wide, atol=1e-6)
