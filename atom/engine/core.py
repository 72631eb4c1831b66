"""EngineCore: one rank's tokenizer-free core, torch-free glue around the step's three parts.

The step is vLLM v1's (docs/ARCHITECTURE.md, "One rank")::

    sched  = scheduler.schedule()                        # atom.core: which tokens to compute
    output = worker.execute_model(sched)                 # the worker: forward, sampling, drafts
    outs   = scheduler.update_from_output(sched, output)  # tokens appended, stops, outputs

The core speaks token ids only: it takes :class:`~atom.messages.EngineCoreRequest` s and returns
:class:`~atom.messages.SeqOutput` s (new token ids and logprobs per sampled sequence, and
finishes; built by the scheduler). Text, stop strings and per-request output assembly live in
the front end (:mod:`atom.engine.output_processor`). Its worker is
:class:`atom.worker.worker.Worker` (torch: the model, the KV cache tensors, the samplers, the
P/D connector's worker side), or the simulator's cost-model worker (:mod:`atom.dp.sim.rank`):
the core itself imports no torch.

It runs in-process (:class:`atom.engine.llm_engine.LLMEngine`) or inside its own process
(:mod:`atom.engine.core_proc`), whose busy loop calls :meth:`EngineCore.step`. The data-parallel
loop (``atom.dp.dp_core_proc``, which this module never imports) calls the parts itself, with
the cross-rank exchanges between them: :meth:`EngineCore.schedule` (with the tick's prefill
decision as a value), :meth:`EngineCore.run_drafts`, then :meth:`EngineCore.execute`, after
:meth:`EngineCore.execute_dummy_batch` when this rank has nothing to run.

A request rejected at :meth:`EngineCore.add_request` (token ids outside the vocabulary, a
duplicate id, a prompt that can never fit) is finished with ``error`` by the next step.
Sequences finished from outside (:meth:`EngineCore.abort_requests`,
:meth:`EngineCore.finish_requests`) report nothing: the front end ended them and already knows;
one finished between :meth:`EngineCore.schedule` and :meth:`EngineCore.execute` is dropped from
the step before the forward (its blocks, draft slots included, are already free).

KV events: with :meth:`atom.config.EngineConfig.resolved_kv_events` set, the core owns a
:class:`~atom.kv_events.KVEventPublisher` (its DP rank's endpoint and seq) and hands it the
block manager's events once per step, at the end of :meth:`EngineCore.execute` (and right after
a prefix-cache reset); the publisher's thread encodes and sends, so a step never waits on it.

P/D disaggregation (``kv_role``): the scheduler's connector metadata rides the
``SchedulerOutput`` to the worker, the worker's results ride the ``ModelRunnerOutput`` back;
what changes outside a forward (blocks kept by a finish, a cancelled pull) reaches the worker
at the end of the step or of the abort.
"""

from __future__ import annotations

import logging

from atom.config import EngineConfig
from atom.core.block_manager import BlockManager
from atom.core.kv_connector import KVConnectorScheduler
from atom.core.scheduler import Scheduler, SchedulerConfig
from atom.core.scheduler_output import SchedulerOutput
from atom.core.seq_outputs import finish_output
from atom.core.sequence import FinishReason, Sequence
from atom.core.structured_output import StructuredOutputManager
from atom.core.tbo_split import can_split
from atom.worker.model_files import tokenizer_json
from atom.engine.step_worker import StepWorker
from atom.messages import EngineCoreRequest, SeqOutput, check_token_ids

logger = logging.getLogger(__name__)

# what a UtilityCall may name
UTILITY_METHODS = ("get_stats", "reset_prefix_cache", "get_cached_block_hashes")
_WAIT_S = 0.01  # a step with only remote KV pulls or grammar compiles in flight waits for one


class EngineCore:
    """Runs token-id requests on one rank.

    Owns the scheduler, the block manager, the requests' sequences and the KV events
    publisher; its worker owns everything torch. Mutates sequence state only through the
    scheduler. Not thread-safe: one caller (the busy loop, or the in-process engine) drives it.

    Args:
        config: engine options.
        worker: the rank's worker, already loaded (its ``runtime`` sizes the block pool).
        dp_rank: this core's DP rank (its KV events endpoint offset).
        kv_event_publisher: where each step's KV events go; None: the config's
            :class:`~atom.kv_events.KVEventPublisher` (or nowhere when events are off).

    Raises:
        ValueError: invalid options.
        RuntimeError: the KV events endpoint cannot be bound (in use, bad address).
    """

    def __init__(self, config: EngineConfig, worker: StepWorker, *, dp_rank: int = 0,
                 kv_event_publisher=None):
        self.config = config
        self.worker = worker
        self.runtime = runtime = worker.runtime
        self.block_manager = BlockManager(runtime.num_kv_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching,
                                          group_windows=runtime.kv_cache_group_windows)
        self.scheduler = Scheduler(
            SchedulerConfig.from_engine_config(config, runtime.max_model_len), self.block_manager,
            eos_token_ids=runtime.eos_token_ids, proposer=_ngram_proposer(config),
            connector=None if config.kv_role is None else KVConnectorScheduler(
                config.kv_role, block_size=config.block_size, host=config.kv_transfer_host,
                port=worker.kv_transfer_port, group_windows=runtime.kv_cache_group_windows),
            structured=StructuredOutputManager(
                vocab_size=runtime.vocab_size, eos_token_ids=runtime.eos_token_ids,
                load_tokenizer_json=lambda: tokenizer_json(config.model)))
        self.kv_event_publisher = (_start_publisher(config, dp_rank)
                                   if kv_event_publisher is None else kv_event_publisher)
        self._requests: dict[str, list[Sequence]] = {}
        self._pending: list[SeqOutput] = []  # finishes decided outside a step (rejections)
        self.num_aborted_seqs = 0
        self.num_front_end_finished_seqs = 0
        logger.debug("engine core ready: %s, %d KV blocks x %d tokens, max_model_len %d",
                    config.model or "embedded SmolLM2-135M-Instruct", runtime.num_kv_blocks,
                    config.block_size, runtime.max_model_len)

    # ----- inputs -----

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. A request that can never run (token ids outside the vocabulary, an
        empty or too long prompt, a duplicate id) is finished with ``error`` and its message,
        reported by the next :meth:`step`; this never raises for a bad request.
        """
        params = request.sampling_params
        seqs = [Sequence(request.request_id, list(request.prompt_token_ids), params, index=i,
                         arrival_time_s=request.arrival_time_s) for i in range(params.n)]
        error = None
        if request.resumed is not None:
            error = self.scheduler.resume(seqs, request.resumed)
        if request.request_id in self._requests:
            # Not registered: the running request of that id must not be disturbed.
            error = f"request_id {request.request_id!r} is already running; use a unique id"
        if error is not None:
            self._pending += [finish_output(seq, reason=FinishReason.ERROR, error=error)
                              for seq in seqs]
            return
        error = check_token_ids(request.prompt_token_ids, params.stop_token_ids,
                                list(params.logit_bias), vocab_size=self.runtime.vocab_size)
        if request.kv_transfer_params is not None and error is None:
            error = self.scheduler.attach_kv_transfer_params(
                seqs, request.kv_transfer_params, vocab_size=self.runtime.vocab_size)
        self._requests[request.request_id] = seqs
        for seq in seqs:
            if seq.is_finished:  # a resumed choice that had finished before the failure
                continue
            self.scheduler.add(seq, error=error)  # may reject (too long, empty, bad ids)
            if seq.is_finished:
                self._pending.append(finish_output(seq))
        self._forget_if_done(request.request_id)

    def fail_request(self, request_id: str, num_seqs: int, error: str) -> None:
        """Finish a request the core could not even read (a malformed frame from the front end)
        with ``error``: its ``num_seqs`` choices report the finish in the next step."""
        self._pending += [SeqOutput(request_id=request_id, index=i, new_token_ids=[],
                                    finish_reason=FinishReason.ERROR.value, error=error)
                          for i in range(num_seqs)]

    def abort_requests(self, request_ids: list[str]) -> None:
        """Client aborts: finish every unfinished sequence with ``abort`` and free its KV blocks
        now. Unknown or finished ids are ignored. Nothing is reported (the front end knows)."""
        for request_id in request_ids:
            for seq in self._requests.get(request_id, ()):
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.ABORT)
                    self.num_aborted_seqs += 1
            self._forget_if_done(request_id)
        self._flush_kv_connector()  # an aborted pull is dropped, its producer told

    def finish_requests(self, seq_keys: list[tuple[str, int]], stop_reasons: list[str]) -> None:
        """The front end found a stop string (``stop_reasons[i]``) in sequence ``seq_keys[i]``
        (``(request_id, choice index)``): finish it with ``stop``, free its KV blocks now; not
        an abort (counted apart); one already finished here (``max_tokens``) is ignored."""
        for (request_id, index), stop in zip(seq_keys, stop_reasons):
            seqs = self._requests.get(request_id, [])
            if not 0 <= index < len(seqs):
                continue
            if not seqs[index].is_finished:
                self.scheduler.finish(seqs[index], FinishReason.STOP, stop_reason=stop)
                self.num_front_end_finished_seqs += 1
            self._forget_if_done(request_id)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self._requests.get(request_id)
        if seqs is not None and all(seq.is_finished for seq in seqs):
            del self._requests[request_id]

    # ----- the step -----

    def has_work(self) -> bool:
        """Unfinished sequences, unreported finishes or KV connector results exist."""
        return (bool(self._pending) or self.scheduler.has_unfinished()
                or self.worker.has_pending_kv_output())

    def step(self) -> list[SeqOutput]:
        """One tick: compiled grammars' sequences join the waiting queue, :meth:`schedule`,
        :meth:`execute` (two micro-batches when :meth:`tbo_eligible`); returns what changed."""
        self.scheduler.queue_ready_grammars()  # compiled off the loop: now they may run
        sched = self.schedule()
        outputs = self.execute(sched, two_batch_overlap=self.tbo_eligible(sched))
        if sched.is_empty and self.scheduler.waiting_for_remote_kvs:  # no spinning:
            self.worker.wait_for_kv_transfers(_WAIT_S)  # only pulls in flight
        elif sched.is_empty and self.scheduler.waiting_for_grammar:
            self.scheduler.structured.wait(_WAIT_S)  # only grammars compiling
        return outputs

    def tbo_eligible(self, sched: SchedulerOutput) -> bool:
        """``enable_tbo`` and a batch that can split (the DP loop splits when all ranks can)."""
        return self.config.enable_tbo and not sched.spec_budget and can_split(sched.scheduled)

    def schedule(self, *, allow_prefill: bool = True, defer_drafts: bool = False) -> SchedulerOutput:
        """The first part of :meth:`step`: pick this tick's batch (``allow_prefill=False`` holds
        every prefill: the cross-rank decision of the tick). With a model-based draft, its
        forwards run here and fill the reserved draft slots, unless ``defer_drafts`` (the DP
        loop: every rank must run the same number of draft forwards, agreed in the batch-shape
        exchange, then :meth:`run_drafts`)."""
        sched = self.scheduler.schedule(allow_prefill=allow_prefill)
        if self.worker.proposes_drafts and sched.spec_budget and not defer_drafts:
            self.run_drafts(sched)
        return sched

    def run_drafts(self, sched: SchedulerOutput, *, num_steps: int | None = None) -> None:
        """Fill ``sched``'s reserved draft slots with the worker's model-based draft (none: a
        no-op); ``num_steps``: draft forwards to run (the DP loop's largest over the ranks)."""
        if not self.worker.proposes_drafts:
            return
        seqs = [seq for seq, _ in sched.scheduled if seq.seq_id in sched.spec_budget]
        drafts = self.worker.propose_drafts(seqs, [sched.spec_budget[s.seq_id] for s in seqs],
                                            num_steps=num_steps)
        self.scheduler.set_spec_tokens(sched, seqs, drafts)

    def num_draft_tokens(self, sched: SchedulerOutput) -> int | None:
        """Tokens of the largest draft forward :meth:`run_drafts` will run for ``sched`` (the
        DP batch shape carries it), or None without a model-based draft."""
        if not self.worker.proposes_drafts:
            return None
        return self.worker.num_draft_tokens(
            [seq for seq, _ in sched.scheduled if seq.seq_id in sched.spec_budget])

    def execute(self, sched: SchedulerOutput, *, two_batch_overlap: bool = False
                ) -> list[SeqOutput]:
        """The rest of :meth:`step`: the worker runs ``sched`` (two micro-batches with
        ``two_batch_overlap``), the scheduler applies what it computed. An empty ``sched`` runs
        no forward (a DP rank's dummy batch comes first) but still reports what finished."""
        outputs, self._pending = self._pending, []
        if any(seq.is_finished for seq, _ in sched.scheduled):  # finished since schedule()
            sched.scheduled = [(seq, n) for seq, n in sched.scheduled if not seq.is_finished]
        model_output = self.worker.execute_model(sched, two_batch_overlap=two_batch_overlap)
        outputs += self.scheduler.update_from_output(sched, model_output)
        for request_id in {o.request_id: None for o in outputs if o.finish_reason is not None}:
            self._forget_if_done(request_id)
        self._flush_kv_connector()  # blocks kept for consumers, before the outputs announce them
        self._publish_kv_events()
        return outputs

    def execute_dummy_batch(self, *, two_batch_overlap: bool = False) -> None:
        """The worker's forward over zero tokens (a DP rank with nothing to run)."""
        self.worker.execute_dummy_batch(two_batch_overlap=two_batch_overlap)

    def apply_kv_connector_output(self) -> None:
        """Collect what the KV connector finished outside a step (an idle DP rank between
        waves: a producer's kept blocks, freed without a forward); outputs go with the next."""
        if self.scheduler.connector is not None:
            self._pending += self.scheduler.update_from_kv_connector_output(
                self.worker.get_kv_connector_output())

    def _flush_kv_connector(self) -> None:
        """Hand the worker what the scheduler side changed outside ``schedule()`` (blocks kept
        by a finish, cancelled pulls): the next ``SchedulerOutput`` would come too late."""
        if self.scheduler.connector is not None:
            self.worker.start_kv_transfers(self.scheduler.connector.build_connector_meta())

    def _publish_kv_events(self) -> None:
        """This step's block-manager events as one batch (taken even with no publisher)."""
        events = self.block_manager.take_events()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(events)

    # ----- stats and utilities -----

    def get_stats(self) -> dict[str, int | float]:
        """The scheduler's counters (:meth:`atom.core.scheduler.Scheduler.get_stats`), the KV
        pool's bytes and bytes per token over every layer (the latent size for MLA), outside
        finishes (``num_aborted_seqs``: client aborts; ``num_front_end_finished_seqs``: stop
        strings), when publishing KV event batches (``kv_events_published_batches``,
        ``kv_events_dropped_batches``), and the worker's KV connector counters."""
        stats = self.scheduler.get_stats()
        stats.update(kv_cache_bytes=self.runtime.kv_cache_bytes,
                     kv_cache_bytes_per_token=self.runtime.kv_cache_bytes // (
                         self.block_manager.num_blocks * self.config.block_size),
                     **_group_stats(self.runtime),
                     num_aborted_seqs=self.num_aborted_seqs,
                     num_front_end_finished_seqs=self.num_front_end_finished_seqs)
        if self.kv_event_publisher is not None:
            pub = self.kv_event_publisher.stats()
            stats["kv_events_published_batches"] = pub["num_published_batches"]
            stats["kv_events_dropped_batches"] = pub["num_dropped_batches"]
        stats.update(self.worker.get_stats())
        return stats

    def reset_prefix_cache(self) -> dict[str, bool]:
        """Drop the prefix cache; ``{"reset": False}`` (nothing done) while blocks are in use.
        Its ``AllBlocksCleared`` is published at once (the core may be idle for long)."""
        reset = self.block_manager.reset_prefix_cache()
        self._publish_kv_events()
        return {"reset": reset}

    def get_cached_block_hashes(self) -> dict[str, list[int]]:
        """``{"block_hashes": [...]}``: :meth:`atom.core.block_manager.BlockManager.
        wire_block_hashes` (what an index of this core's KV events holds once caught up)."""
        return {"block_hashes": self.block_manager.wire_block_hashes()}

    def close(self) -> None:
        """Stop the KV events publisher (sending what it has queued) and the worker's KV
        connector. Idempotent."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        self.scheduler.structured.close()
        self.worker.close()

    def call_utility(self, method: str) -> dict:
        """Run a utility method by name (one of ``UTILITY_METHODS``).

        Raises:
            ValueError: an unknown method name.
        """
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}; known: {list(UTILITY_METHODS)}")
        return getattr(self, method)()


def _ngram_proposer(config: EngineConfig):
    """The scheduler's in-step proposer (``speculative_method="ngram"``), or None."""
    if config.speculative_method != "ngram":
        return None
    from atom.core.ngram_proposer import NgramProposer

    return NgramProposer(prompt_lookup_min=config.prompt_lookup_min,
                         prompt_lookup_max=config.prompt_lookup_max)


def _start_publisher(config: EngineConfig, dp_rank: int):
    """This core's KV events publisher, or None when events are off.

    Raises:
        RuntimeError: an endpoint cannot be bound (the message names it).
    """
    settings = config.resolved_kv_events()
    if settings is None:
        return None
    import zmq

    from atom.kv_events import KVEventPublisher

    try:
        return KVEventPublisher(settings, dp_rank=dp_rank)
    except zmq.ZMQError as exc:
        raise RuntimeError(f"dp rank {dp_rank}: cannot bind the KV events endpoints "
                           f"{settings.endpoint} / {settings.replay_endpoint} (offset by the "
                           f"rank): {exc}") from exc


def _group_stats(runtime) -> dict[str, int]:
    """With several KV cache groups, each group's bytes per token
    (``kv_cache_bytes_per_token_full``, ``kv_cache_bytes_per_token_window_<W>``); none for one."""
    windows = runtime.kv_cache_group_windows
    if len(windows) < 2:
        return {}
    return {"kv_cache_bytes_per_token_" + ("full" if w is None else f"window_{w}"): n
            for w, n in zip(windows, runtime.kv_cache_group_bytes_per_token)}
