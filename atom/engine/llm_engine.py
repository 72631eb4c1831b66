"""LLMEngine: one deployment's engine as the front end sees it — tokenizer, output side, client.

A thin composition (vLLM v1's shape): the :class:`~atom.engine.output_processor.OutputProcessor` keeps
per-request text and outputs, and an :class:`~atom.engine.core_client.EngineCoreClient` runs
the token ids:

- by default an :class:`~atom.engine.core_client.InprocClient` over an
  :class:`~atom.engine.core.EngineCore` in this process, stepped by ``step()`` itself (what tests
  that look inside: ``scheduler``, ``block_manager``, ``runner``, use);
- or whatever ``client_factory`` builds: the entrypoints
  (:func:`atom.entrypoints.llm.build_engine`) pass an :class:`~atom.engine.core_client.MPClient`
  (one engine-core process) or the DP client, whose cores step on their own while ``step()``
  collects what they produced.

Every client speaks the one interface, so the front-end logic is one code path.

Rank failures (docs/ARCHITECTURE.md, "Rank failures"): when the client reports lost ranks
(:class:`~atom.engine.liveness.RankFailedError`, from any call), the engine asks it to
:meth:`~atom.engine.core_client.EngineCoreClient.recover` (a fresh group, or
:class:`~atom.engine.liveness.EngineDeadError` when the deployment cannot go on, which propagates),
then sends every unfinished request again from what its output processor holds: the prompt
plus each choice's tokens so far (``resume_on_rank_failure``; else they end with
``finish_reason="error"``). The caller's streams go on where they stopped, no token repeated
or lost. :attr:`LLMEngine.status` says which of serving / recovering / dead the engine is in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from atom.config import EngineConfig
from atom.core.structured_output import grammar_error
from atom.engine.core_client import EngineCoreClient, InprocClient
from atom.engine.liveness import EngineDeadError, RankFailedError
from atom.messages import EngineCoreRequest, EngineRuntime, KVTransferParams
from atom.engine.output_processor import OutputProcessor
from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams

__all__ = ["LLMEngine"]

logger = logging.getLogger(__name__)

_STEP_WAIT_S = 1.0  # multiprocess step(): the longest it waits for the core before returning []
# rank failures a request is resumed after; at the next it fails instead (a request that
# takes its ranks down with it must not do so forever)
MAX_RESUMES_PER_REQUEST = 2
SERVING, RECOVERING, DEAD = "serving", "recovering", "dead"


@dataclass(frozen=True)
class EngineStatus:
    """Where the engine stands, replaced (never mutated) by the thread that drives the engine,
    so any thread may read :attr:`LLMEngine.status`.

    Attributes:
        state: :data:`SERVING`, :data:`RECOVERING` (a rank failed; a new group is starting)
            or :data:`DEAD`.
        message: the failure, for people (None while serving without one).
        membership: the client's :meth:`~atom.engine.core_client.EngineCoreClient.membership`
            when the status was set.
    """

    state: str = SERVING
    message: str | None = None
    membership: dict = field(default_factory=dict)


def tokenizer_eos_token_ids(tokenizer) -> tuple[int, ...]:
    """The EOS ids a tokenizer adds to the model config's (the engine core has no tokenizer):
    its ``eos_token_id``, if any; ``()`` for ``None`` (``skip_tokenizer_init``)."""
    if tokenizer is None or tokenizer.eos_token_id is None:
        return ()
    return (tokenizer.eos_token_id,)


class LLMEngine:
    """Runs requests to completion on one rank.

    Args:
        config: engine options.
        client_factory: ``(config, extra_eos_token_ids) -> EngineCoreClient``; None = an
            :class:`~atom.engine.core_client.InprocClient` over an engine core in this process
            (see the module docstring). The engine never imports ``atom.dp``: the entrypoints
            pass the DP client's factory.

    Raises:
        ValueError: invalid options, a model whose files cannot be loaded or whose architecture
            atom does not run (found before any process starts:
            :func:`atom.engine.preflight.check_model_files`), or
            ``data_parallel_size > 1`` without a ``client_factory``.
        FileNotFoundError: the model path, or its weight files, do not exist.
        EngineStartError: an engine core failed to start (a ``RuntimeError``: one line
            naming the rank and the cause).
        RuntimeError: an engine-core process died during start-up without saying why (its
            exit code and stderr tail).
    """

    def __init__(self, config: EngineConfig, *,
                 client_factory: Callable[[EngineConfig, tuple[int, ...]], EngineCoreClient]
                 | None = None):
        from atom.engine.preflight import check_model_files
        from atom.worker.model_files import load_tokenizer

        check_model_files(config)  # before the tokenizer and any process

        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model)
        # The core has no tokenizer: the tokenizer's EOS id travels to it from here.
        extra_eos = tokenizer_eos_token_ids(self.tokenizer)
        self.core = None
        if client_factory is not None:
            self.client = client_factory(config, extra_eos)
        elif config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size} needs the DP client: "
                             f"use atom.LLM (or pass client_factory)")
        else:
            from atom.engine.core_proc import build_engine_core

            self.core = build_engine_core(config, extra_eos_token_ids=extra_eos)
            self.client = InprocClient(self.core)
        self.runtime: EngineRuntime = self.client.runtime
        self.output_processor = OutputProcessor(self.tokenizer)
        self._pending: list[RequestOutput] = []  # finished here, not by a core step
        self.status = EngineStatus(membership=self.client.membership())
        self.num_resumed_requests = 0  # sent again after rank failures
        self.num_unresumed_requests = 0  # failed by rank failures instead

    # ----- in-process internals (tests) -----

    def _local_core(self):
        if self.core is None:
            raise RuntimeError("the engine core runs in another process: use get_stats()")
        return self.core

    @property
    def scheduler(self):
        return self._local_core().scheduler

    @property
    def block_manager(self):
        return self._local_core().block_manager

    @property
    def worker(self):
        return self._local_core().worker

    # ----- requests -----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time_s: float | None = None,
                    data_parallel_rank: int | None = None, session_id: str | None = None,
                    arrival_tick: int | None = None,
                    kv_transfer_params: KVTransferParams | None = None) -> None:
        """Queue a request; one that can never run is finished with ``error`` (its output comes
        from the next ``step()``).

        ``data_parallel_rank`` pins the DP rank; ``session_id`` names the conversation the
        request belongs to (the DP router keeps a session on its rank; it never reaches the
        core); both are ignored with one rank. ``arrival_tick`` (tick-clocked replay, DP only)
        makes the request's rank hold it until that tick of the wave (the ticks of a replay
        count from its wave's first tick; send every request of a replay before the first
        ``step()``: ``atom.dp.dp_core_proc``). ``kv_transfer_params``: the request's P/D
        half (:mod:`atom.core.kv_connector`; a producer's final output carries the params its
        consumer needs in ``RequestOutput.kv_transfer_params``). The token ids are
        checked by the core (a request it cannot run finishes with ``error``); one that msgpack
        cannot even carry (an id past 64 bits) fails here.

        Raises:
            ValueError: ``request_id`` is already in use, a bad ``data_parallel_rank``,
                ``arrival_tick`` with one rank or below 0, or ``structured_outputs`` that do not
                compile (:func:`atom.core.structured_output.grammar_error`).
        """
        if arrival_tick is not None and (self.config.data_parallel_size == 1 or arrival_tick < 0):
            raise ValueError(f"arrival_tick={arrival_tick}: tick-clocked arrivals need "
                             f"data_parallel_size > 1 (the DP ranks hold them) and a tick >= 0")
        if params.structured_outputs is not None:  # the compile itself runs in the core
            error = grammar_error(params.structured_outputs)
            if error is not None:
                raise ValueError(error)
        arrival = time.monotonic() if arrival_time_s is None else arrival_time_s
        rejected = self.output_processor.add_request(request_id, prompt_token_ids, params,
                                                     prompt=prompt, arrival_time_s=arrival)
        if rejected is not None:
            self._pending.append(rejected)
            return
        request = EngineCoreRequest(request_id, list(prompt_token_ids), params, arrival,
                                    arrival_tick=arrival_tick, kv_transfer_params=kv_transfer_params)
        try:
            rank = self.client.add_request(request, data_parallel_rank=data_parallel_rank,
                                           session_id=session_id)
            self.output_processor.set_dp_rank(request_id, rank)
        except ValueError:  # a rank hint outside the group: nothing was sent, nothing is kept
            self.output_processor.fail_request(request_id, "not sent")
            raise
        except RankFailedError as error:
            self._recover(error)  # the request is sent with the other unfinished ones
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:  # not msgpack-able
            self._pending.append(self.output_processor.fail_request(
                request_id, f"the request cannot be encoded: {exc}"))

    def abort_request(self, request_id: str) -> None:
        """Abort a request: its final output (``abort``) comes from the next ``step()`` and the
        core frees its KV blocks. Unknown ids are ignored."""
        out = self.output_processor.abort_request(request_id)
        if out is None:
            return
        self._pending.append(out)
        try:
            self.client.abort([request_id])
        except RankFailedError as error:
            self._recover(error)  # the aborted request is no longer unfinished: not resent

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or bool(self._pending)

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """Returns the requests that changed (a finished one for the last time).

        In-process this runs one core tick. Multiprocess it collects the core's outputs,
        waiting at most ``_STEP_WAIT_S`` (and not at all when something finished here), so it
        may return ``[]``; callers loop.

        Raises:
            EngineDeadError: the engine-core process died (multiprocess).
        """
        outputs, self._pending = self._pending, []
        if not self.output_processor.has_unfinished_requests():
            return outputs
        try:
            seq_outputs = self.client.get_outputs(timeout_s=0.0 if outputs else _STEP_WAIT_S)
        except RankFailedError as error:
            self._recover(error)
            outputs, self._pending = outputs + self._pending, []
            return outputs
        processed = self.output_processor.process_outputs(seq_outputs)
        try:
            # a stop string ended these sequences: free their KV before the core's next tick
            self.client.finish(processed.finish_seq_keys, processed.stop_reasons)
        except RankFailedError as error:
            self._recover(error)  # the choices a stop string ended are not resumed
        outputs, self._pending = outputs + processed.request_outputs + self._pending, []
        return outputs

    # ----- rank failures -----

    def _recover(self, error: RankFailedError) -> None:
        """A new group for ``error`` (module docstring), then every unfinished request sent
        again; the requests that end instead go to ``_pending``. Another failure while
        resending starts over with it.

        Raises:
            EngineDeadError: the deployment cannot go on (``status`` is then ``dead``).
        """
        while True:
            self.status = EngineStatus(RECOVERING, str(error), self.client.membership())
            try:
                self.client.recover(error)
            except EngineDeadError as dead:
                self.status = EngineStatus(DEAD, str(dead), self.client.membership())
                raise
            try:
                self._resend(error)
            except RankFailedError as again:
                error = again
                continue
            self.status = EngineStatus(SERVING, f"recovered from: {error}",
                                       self.client.membership())
            return

    def _resend(self, error: RankFailedError) -> None:
        op = self.output_processor
        if not self.config.resume_on_rank_failure:
            failed = [op.fail_on_rank_failure(request_id, f"{error}; the request was in flight "
                                              f"and resume_on_rank_failure is off")
                      for request_id in op.unfinished_request_ids()]
            resumable = []
        else:
            resumable, failed = op.take_resumable(max_resumes=MAX_RESUMES_PER_REQUEST)
        self._pending += failed
        self.num_unresumed_requests += len(failed)
        for r in resumable:
            rank = self.client.add_request(EngineCoreRequest(
                r.request_id, r.prompt_token_ids, r.params, r.arrival_time_s, resumed=r.choices))
            self.output_processor.set_dp_rank(r.request_id, rank)
        self.num_resumed_requests += len(resumable)
        logger.warning("after the rank failure (%s): %d request(s) resumed, %d failed",
                       error, len(resumable), len(failed))

    # ----- stats, lifecycle -----

    def get_stats(self) -> dict[str, int]:
        """Counters of the KV pool, queues, prefix cache (cache counters in tokens) and finishes
        from outside the core (``num_aborted_seqs``, ``num_front_end_finished_seqs``), summed
        over DP ranks, and :meth:`front_end_stats`. A rank failure found on the way is
        recovered from first (module docstring).

        Raises:
            EngineDeadError: the deployment cannot go on.
        """
        return {**self._call_recovering(self.client.get_stats), **self._front_end_counters()}

    def get_rank_stats(self, *, timeout_s: float | None = None) -> list[dict]:
        """Each DP rank's stats (one rank: ``[get_stats()]``); recovers as :meth:`get_stats`.

        Raises:
            TimeoutError: not every rank answered within ``timeout_s`` seconds (None: no limit
                but the hang timeout).
        """
        return self._call_recovering(lambda: self.client.get_rank_stats(timeout_s=timeout_s))

    def get_expert_load(self):
        """EPLB's last closed window: the tokens routed to each logical expert, int64 numpy
        ``[MoE layers, experts]``, summed over the ranks (each rank counts the tokens it
        dispatched); zeros before the first window closes. Recovers as :meth:`get_stats`.

        Raises:
            ValueError: neither ``record_expert_load`` nor ``enable_eplb`` is on.
            EngineDeadError: the deployment cannot go on.
        """
        return sum(_as_array(r) for r in self._eplb_utility("get_expert_load"))

    def get_expert_placement(self):
        """EPLB's current placement: the logical expert of each physical slot, int64 numpy
        ``[MoE layers, slots]`` (``phy2log``; rank ``r`` owns the ``r``-th run of ``slots /
        DP size`` slots). Recovers as :meth:`get_stats`.

        Raises:
            ValueError: neither ``record_expert_load`` nor ``enable_eplb`` is on.
            RuntimeError: the ranks report different placements (they must never).
            EngineDeadError: the deployment cannot go on.
        """
        placements = [_as_array(r) for r in self._eplb_utility("get_expert_placement")]
        if any((p != placements[0]).any() for p in placements[1:]):
            raise RuntimeError(f"the DP ranks hold different expert placements: {placements}")
        return placements[0]

    def _eplb_utility(self, method: str) -> list[dict]:
        if not self.config.resolved_record_expert_load():
            raise ValueError(f"{method} reads the expert load: start the engine with "
                             f"record_expert_load (--record-expert-load) or enable_eplb "
                             f"(--enable-eplb); both need data and expert parallelism")
        return self._call_recovering(lambda: self.client.call_utility_per_rank(method))

    def reset_prefix_cache(self) -> bool:
        """Drop every rank's prefix cache (cached blocks no running sequence uses go back to
        the free list, an ``AllBlocksCleared`` KV event is published). True when every rank
        did it, False when some rank had blocks in use (those ranks keep their cache).

        Raises:
            EngineDeadError: the deployment cannot go on.
        """
        results = self._call_recovering(
            lambda: self.client.call_utility_per_rank("reset_prefix_cache"))
        return all(r["reset"] for r in results)

    def front_end_stats(self) -> dict:
        """Counters of the front end that belong to no rank: the client's (rank failures,
        recoveries, ``dp_size``, ``generation``; the DP client's KV event subscriber:
        ``kv_subscriber_*``) and ``num_resumed_requests`` / ``num_unresumed_requests``."""
        return {**self.client.front_end_stats(), **self._front_end_counters()}

    def membership(self) -> dict:
        """The client's view of the group now (``/health``): generation, DP size, per rank its
        pid, last tick and heartbeat silence, recent rank failures."""
        return self.client.membership()

    def _front_end_counters(self) -> dict:
        return {"num_resumed_requests": self.num_resumed_requests,
                "num_unresumed_requests": self.num_unresumed_requests}

    def _call_recovering(self, fn):
        try:
            return fn()
        except RankFailedError as error:
            self._recover(error)
            return fn()

    def check_ranks(self) -> None:
        """Recover now from a rank that died or hung since the last call (a front end with no
        request in flight calls it: nothing else would look until the next request).

        Raises:
            EngineDeadError: the deployment cannot go on (``status`` is then ``dead``).
        """
        self._call_recovering(self.client.check_ranks)

    def client_is_alive(self) -> bool:
        """False once the engine-core process has exited (always True in-process)."""
        return self.client.is_alive()

    def shutdown(self) -> None:
        """Stop the engine-core process, if any (idempotent)."""
        self.client.shutdown()


def _as_array(result: dict):
    """A ``{"shape": [...], "values": [...]}`` utility result as an int64 numpy array."""
    import numpy as np

    return np.asarray(result["values"], dtype=np.int64).reshape(result["shape"])
