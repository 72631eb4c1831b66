"""The per-tick DP trace (``--dp-trace FOLDER``): one compact row per stepping tick per rank.

Every rank writes ``FOLDER/dp<rank>.jsonl``: a header line (a JSON object: format, version,
rank, world size, policy, columns, the clock offset), then one JSON array per stepping tick in
the order of :data:`TRACE_COLUMNS`: the tick and wave, when the tick started and how long its
control sync and its step took (the rank's own clock, µs), this rank's row of the gathered
control vector (the policy inputs, the collective count and hash), the prefill decision and its
reason, this rank's batch shape (prefill tokens, decode sequences, dummy), whether the step ran
as two micro-batches, and whether some rank prefilled (``any_prefill``) while another did not
(``mixed``). A tick that ends a wave runs no step and writes no row. The rows of all ranks
together hold the whole gathered matrix of every tick (each rank contributes its own row).
With EPLB a row also has the last closed window's balancedness, this rank's per-slot routed
tokens of the step and the time its experts computed (:data:`EPLB_COLUMNS`); with speculative
decoding, its verifies and accepted draft tokens of the step (:data:`SPEC_COLUMNS`). Besides rows, a file may hold events (JSON
objects with an ``event`` key, e.g. the ``membership_change`` a group started after a rank
failure writes at its tick 0, or EPLB's ``eplb_window`` at the end of each interval: the
window's balancedness, its load per expert, whether it rebalanced, the new placement; a model
draft's ``drafts`` each tick it drafted: request id → the draft tokens it proposed, which
the simulator replays, :func:`atom.dp.sim.workload.drafts_from_trace`).

Each start of the group (its generation, ``TORCHELASTIC_RESTART_COUNT``: 0 first, + 1 per
recovery or launcher restart) writes a folder of its own: ``FOLDER`` for the first,
``FOLDER/gen<g>`` after; so a recovery never overwrites the trace of the group it replaced,
and every folder is one group's (its ranks, its world size, its clocks).

Writing never blocks a step: :meth:`TraceWriter.write` puts the row tuple on an unbounded
in-memory queue (no lock wait, no I/O); a background thread formats the rows and writes them
through a buffered file, flushing whenever the queue runs empty, so the file is complete while
the ranks are idle. With tracing off the DP loop holds no writer and does nothing per tick.

:func:`read_trace` reads a folder back (every rank's file; with several nodes, each node
writes its own ranks' files: gather them in one folder); :func:`to_perfetto` turns it into a
Chrome trace / Perfetto JSON (``scripts/dp_trace.py`` writes that and a PNG timeline).
"""

from __future__ import annotations

import json
import logging
import pathlib
import queue
import threading
import time
from dataclasses import dataclass

from atom.dp.rank_contract import rank_logger

logger = logging.getLogger(__name__)

TRACE_FORMAT = "atom-dp-trace"
TRACE_VERSION = 2  # 2: events, the generation in the header
# this rank's row of the gathered control vector, as traced
CONTROL_COLUMNS = ("has_work", "num_admittable", "num_prefill_tokens", "has_pending_prefill",
                   "has_partial_prefill", "num_running_decodes", "oldest_waiting_age_ticks",
                   "kv_usage_ppm", "collective_count", "collective_hash")
# this rank's row of the gathered batch shapes, as traced (with a step_ prefix)
SHAPE_COLUMNS = ("num_tokens", "num_seqs", "num_prefill_tokens", "num_decode_seqs", "is_dummy",
                 "num_spec_tokens")  # rows map to the header's columns: older files lack the last
# with EPLB: the last closed window's balancedness, this rank's tokens routed to each
# [MoE layer, physical slot] in the step (flattened; only while the window records) and the µs
# its experts computed in the step (wall clock); else None
EPLB_COLUMNS = ("eplb_balancedness", "eplb_load", "eplb_expert_us")
# with speculative decoding: this rank's verifies (sequences that scored drafts) and accepted
# draft tokens in the step (its scheduler's SpecStats, atom.core.spec_stats); else None
SPEC_COLUMNS = ("spec_num_verifies", "spec_num_accepted_tokens")
TRACE_COLUMNS = ("tick", "wave_id", "start_us", "sync_us", "step_us", *CONTROL_COLUMNS,
                 "allow", "reason", "num_consecutive_holds",
                 *(f"step_{c}" for c in SHAPE_COLUMNS), "tbo", "any_prefill", "mixed",
                 *EPLB_COLUMNS, *SPEC_COLUMNS)  # rows map to the header's columns: older
# files lack the last ones


def spec_counts(scheduler) -> tuple[int, int] | None:
    """The scheduler's running totals of :data:`SPEC_COLUMNS` (None without speculation); a
    step's values are the difference across it."""
    stats = scheduler.spec_stats
    return None if stats is None else (stats.num_verifies, stats.num_accepted_tokens)


def spec_since(scheduler, before: tuple[int, int] | None) -> tuple[int, int] | None:
    """The step's :data:`SPEC_COLUMNS`: :func:`spec_counts` now minus ``before`` (taken
    before the step); None without speculation."""
    after = spec_counts(scheduler)
    return None if after is None else (after[0] - before[0], after[1] - before[1])


def tick_row(*, dp_rank: int, gathered, decision, shapes, start_ns: int, synced_ns: int,
             end_ns: int, eplb=None, spec: tuple[int, int] | None = None) -> tuple:
    """One trace row (:data:`TRACE_COLUMNS`) from a stepping tick's values.

    Args:
        dp_rank: this rank (its row of ``gathered`` and ``shapes`` is traced).
        gathered: the tick's :class:`~atom.dp.sync.GatheredControl`.
        decision: the tick's :class:`~atom.dp.prefill_decision.Decision`.
        shapes: the tick's :class:`~atom.dp.sync.GatheredBatchShape`.
        start_ns, synced_ns, end_ns: ``time.perf_counter_ns()`` at the tick's start, after the
            control sync, and after the step.
        eplb: what has the EPLB columns: an :class:`~atom.dp.eplb.manager.EplbManager` (or the
            simulator's stand-in) with ``last_balancedness``, ``tick_load`` and ``expert_us``;
            None = off.
        spec: this rank's :data:`SPEC_COLUMNS` of the step (:func:`spec_counts` after minus
            before); None = no speculative decoding.
    """
    r = dp_rank
    prefill = shapes.has_prefill.tolist()  # plain Python on [world_size] lists: cheaper than
    any_prefill = any(prefill)  # numpy reductions on tiny arrays (this runs every tick)
    return (gathered.tick.item(r), gathered.wave_id.item(r), start_ns // 1000,
            (synced_ns - start_ns) // 1000, (end_ns - synced_ns) // 1000,
            *[getattr(gathered, c).item(r) for c in CONTROL_COLUMNS],
            decision.allow, decision.reason.value, decision.num_consecutive_holds,
            *[getattr(shapes, c).item(r) for c in SHAPE_COLUMNS],
            all(shapes.tbo_eligible.tolist()), any_prefill, any_prefill and not all(prefill),
            *((None,) * len(EPLB_COLUMNS) if eplb is None
              else (eplb.last_balancedness, eplb.tick_load, eplb.expert_us)),
            *((None,) * len(SPEC_COLUMNS) if spec is None else spec))


def trace_header(*, dp_rank: int, dp_size: int, policy: str, wall_minus_perf_us: int,
                 generation: int = 0) -> str:
    """A trace file's first line (the header object; module docstring). ``wall_minus_perf_us``:
    what to add to a row's ``start_us`` for wall-clock µs since the epoch (the simulator
    writes 0: its rows are on the simulated clock); ``generation``: which start of the group
    (:class:`TraceWriter`)."""
    return json.dumps({"format": TRACE_FORMAT, "version": TRACE_VERSION, "dp_rank": dp_rank,
                       "dp_size": dp_size, "policy": policy, "generation": generation,
                       "columns": list(TRACE_COLUMNS), "wall_minus_perf_us": wall_minus_perf_us})


def format_row(row: tuple) -> str:
    """One row (:func:`tick_row`) as its line of the file (no newline)."""
    return json.dumps(row, separators=(",", ":"))


class TraceWriter:
    """Writes this rank's trace rows from a background thread (module docstring).

    Owns the file and the thread until :meth:`close`. An I/O error stops the trace (logged
    once); the engine keeps running.

    Args:
        folder: the trace folder (created if missing); the file is ``dp<rank>.jsonl``.
        dp_rank, dp_size: this rank and the world size (in the header).
        policy: the prefill policy's name (in the header).
        generation: which start of the group this is (0: ``folder`` itself, else
            ``folder/gen<generation>``; in the header).
    Raises:
        OSError: the file cannot be created.
    """

    def __init__(self, folder: str | pathlib.Path, *, dp_rank: int, dp_size: int, policy: str,
                 generation: int = 0):
        path = generation_folder(folder, generation) / f"dp{dp_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._log = rank_logger(logger, dp_rank)
        self._file = open(path, "w", buffering=1 << 16)
        self._file.write(trace_header(
            dp_rank=dp_rank, dp_size=dp_size, policy=policy, generation=generation,
            wall_minus_perf_us=(time.time_ns() - time.perf_counter_ns()) // 1000) + "\n")
        self._queue: queue.SimpleQueue[tuple | dict | None] = queue.SimpleQueue()
        self._failed = False
        self._thread = threading.Thread(target=self._run, name=f"dp{dp_rank}-trace", daemon=True)
        self._thread.start()

    def write(self, row: tuple) -> None:
        """Queue one row (never blocks)."""
        if not self._failed:
            self._queue.put(row)

    def write_event(self, event: dict) -> None:
        """Queue one event (a JSON object with an ``event`` key; never blocks)."""
        assert "event" in event, event
        if not self._failed:
            self._queue.put(event)

    def _run(self) -> None:
        try:
            while (row := self._queue.get()) is not None:
                self._file.write(format_row(row) + "\n")
                if self._queue.empty():
                    self._file.flush()
        except OSError as e:
            self._failed = True
            self._log.error("DP trace %s stopped: %s", self.path, e)
        finally:
            try:
                self._file.close()
            except OSError as e:
                self._log.error("DP trace %s: %s", self.path, e)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then close the file (waits up to ``timeout_s``)."""
        self._queue.put(None)
        self._thread.join(timeout_s)


@dataclass(frozen=True)
class RankTrace:
    """One rank's trace: its header, its rows (one dict per tick, keyed by column) and its
    events (as written, in file order)."""

    header: dict
    rows: list[dict]
    events: list[dict]

    @property
    def dp_rank(self) -> int:
        return self.header["dp_rank"]


def generation_folder(folder: str | pathlib.Path, generation: int) -> pathlib.Path:
    """Where the ranks of the group's ``generation``-th start write (module docstring)."""
    return pathlib.Path(folder) / f"gen{generation}" if generation else pathlib.Path(folder)


def read_trace(folder: str | pathlib.Path) -> list[RankTrace]:
    """Every rank's trace in ``folder`` (one group's: a later generation's is in
    :func:`generation_folder`), in rank order.

    Raises:
        ValueError: a file is not an atom DP trace of this version, or ranks are missing.
    """
    traces = []
    for path in sorted(pathlib.Path(folder).glob("dp*.jsonl")):
        lines = path.read_text().splitlines()
        header = json.loads(lines[0]) if lines else {}
        if header.get("format") != TRACE_FORMAT or header.get("version") != TRACE_VERSION:
            raise ValueError(f"{path} is not an {TRACE_FORMAT} v{TRACE_VERSION} file")
        columns = header["columns"]
        items = [json.loads(line) for line in lines[1:]]
        traces.append(RankTrace(header, [dict(zip(columns, i)) for i in items
                                         if isinstance(i, list)],
                                [i for i in items if isinstance(i, dict)]))
    traces.sort(key=lambda t: t.dp_rank)
    if not traces:
        raise ValueError(f"no dp<rank>.jsonl trace files in {folder}")
    dp_size = traces[0].header["dp_size"]
    if [t.dp_rank for t in traces] != list(range(dp_size)):
        raise ValueError(f"{folder}: expected ranks 0..{dp_size - 1}, found "
                         f"{[t.dp_rank for t in traces]}")
    return traces


def step_kind(row: dict) -> str:
    """What this rank's step did: ``dummy``, ``prefill`` (it computed prompt tokens; with
    decodes too when ``step_num_decode_seqs`` > 0), or ``decode``."""
    if row["step_is_dummy"]:
        return "dummy"
    return "prefill" if row["step_num_prefill_tokens"] else "decode"


def to_perfetto(traces: list[RankTrace]) -> dict:
    """A Chrome trace / Perfetto JSON object: one track (thread) per rank, with a slice for
    each control sync and each step (named by its kind; ``prefill (mixed)`` when another rank
    did not prefill), an instant event for each held tick, and a KV-usage counter per rank.
    Times are µs since the first traced tick of any rank (wall clock, so ranks on different
    nodes line up as well as their clocks do)."""
    offsets = {t.dp_rank: t.header["wall_minus_perf_us"] for t in traces}
    starts = [row["start_us"] + offsets[t.dp_rank] for t in traces for row in t.rows]
    origin = min(starts, default=0)
    events: list[dict] = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "ts": 0,
                           "args": {"name": f"atom DP ({traces[0].header['policy']})"}}]
    for t in traces:
        tid = t.dp_rank
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "ts": 0,
                       "args": {"name": f"dp{tid}"}})
        for row in t.rows:
            events += _row_events(row, tid, row["start_us"] + offsets[tid] - origin)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"policy": traces[0].header["policy"], "dp_size": len(traces)}}


_CNAMES = {"prefill": "thread_state_running", "prefill (mixed)": "terrible",
           "decode": "good", "dummy": "grey", "sync": "thread_state_sleeping"}


def _row_events(row: dict, tid: int, ts: int) -> list[dict]:
    kind = step_kind(row)
    name = f"{kind} (mixed)" if kind == "prefill" and row["mixed"] else kind
    args = {c: row[c] for c in TRACE_COLUMNS if c not in ("start_us", "sync_us", "step_us")}
    events = [
        {"ph": "X", "name": "sync", "cat": "sync", "pid": 0, "tid": tid, "ts": ts,
         "dur": row["sync_us"], "cname": _CNAMES["sync"], "args": {"tick": row["tick"]}},
        {"ph": "X", "name": name, "cat": "step", "pid": 0, "tid": tid,
         "ts": ts + row["sync_us"], "dur": row["step_us"], "cname": _CNAMES[name], "args": args},
        {"ph": "C", "name": f"dp{tid} kv usage", "pid": 0, "tid": tid, "ts": ts,
         "args": {"kv_usage": row["kv_usage_ppm"] / 1e6}},
    ]
    if not row["allow"]:
        events.append({"ph": "i", "s": "t", "name": f"hold: {row['reason']}", "cat": "hold",
                       "pid": 0, "tid": tid, "ts": ts + row["sync_us"],
                       "args": {"tick": row["tick"],
                                "num_consecutive_holds": row["num_consecutive_holds"]}})
    return events
