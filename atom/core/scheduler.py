"""Continuous-batching scheduler: chunked prefill, prefix-cache-aware admission, preemption.

One ``schedule()`` call builds one step's batch under two budgets, ``max_num_seqs`` (running
sequences) and ``max_num_batched_tokens`` (tokens computed this step). Running sequences go
first, in arrival order: a decode takes one token, a partial prefill takes the next chunk.
Waiting sequences are then admitted first-come-first-served while their blocks fit; admission
reserves blocks for the sequence's current tokens (its prompt), not for ``max_tokens``, so a
decode that finds no free block preempts the newest running sequence (recompute: its blocks are
freed and it returns to the front of the waiting queue keeping its output tokens).

The scheduler alone mutates sequence state (through :meth:`Scheduler.update_from_output` what
the worker computed for a step: tokens, their logprobs, prompt logprobs, the KV connector's
results; through :meth:`Scheduler.resume` and
:meth:`Scheduler.attach_kv_transfer_params` a new request's first tokens); the block manager owns
block tables and block hashes. It imports no torch. ``schedule(allow_prefill=False)``
holds all prefill work (admissions and partial-prefill chunks) for one step: the cross-rank
decision (the prefill policy in ``atom.dp``) arrives as that plain value. :meth:`Scheduler.preview_admission`
is a side-effect-free dry run of the same admission function: how many prefills the next step
would start or continue and how many prompt tokens they would compute, which the prefill
policies gather across ranks (lineage: SGLang #14201, ATOM #930; tokens after prefix-cache hits
and within the token budget: ATOM #2196).

Speculative decoding (``num_speculative_tokens = k > 0``): a decode also reserves slots for up to
``k`` draft tokens after its last token (fewer near ``max_tokens`` / ``max_model_len``, or when the
free blocks or the token budget run short: speculation never preempts anyone), so the verify
forward scores them all at once. An in-scheduler proposer (n-gram) fills ``seq.spec_token_ids``
right here and the reservation is its proposal's length; a model-based one fills them after
scheduling (:meth:`Scheduler.set_spec_tokens`). ``update_from_output`` appends the emitted tokens one by
one with the stop checks (EOS, stop ids, ``min_tokens``, ``max_tokens``, ``max_model_len`` cut
exactly, mid-run), counts as computed only the last token and the accepted drafts, and gives
back the blocks that only rejected drafts used; ``spec_stats`` counts the verifies. Draft tokens are never in ``token_ids`` before
they are accepted, so they never reach the prefix cache or the KV events.

P/D disaggregation (:mod:`atom.core.kv_connector`): a consumer sequence is admitted with its blocks
into ``waiting_for_remote_kvs`` (status ``WAITING_FOR_REMOTE_KVS``) instead of being prefilled,
and joins the running batch when its pull is done; a producer's finished prefill may keep its
blocks (``kv_kept``) until the consumer has them. Only sequences with ``kv_transfer_params``
take these paths.

Structured outputs (:mod:`atom.core.structured_output`): a sequence with
``structured_outputs`` waits in ``waiting_for_grammar`` (status ``WAITING_FOR_GRAMMAR``) while its
grammar compiles on the manager's thread, joins the waiting queue when
:meth:`Scheduler.queue_ready_grammars` (called before each step) finds it ready (or finishes
with ``error``), gets no draft slots, and has its grammar's token bitmask in
``SchedulerOutput.grammar_bitmask`` whenever the step samples it; ``update_from_output`` advances
its matcher with every token it appends.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from atom.core.block_manager import BlockManager, DryRunClaims
from atom.core.kv_connector import KVConnectorOutput, KVConnectorScheduler
from atom.core.model_runner_output import ModelRunnerOutput
from atom.core.ngram_proposer import Proposer
from atom.core.scheduler_output import AdmissionPreview, SchedulerOutput
from atom.core.seq_outputs import finish_output, seq_output
from atom.core.sequence import FinishReason, Sequence, SequenceStatus
from atom.core.spec_stats import SpecStats
from atom.core.structured_output import StructuredOutputManager
from atom.messages import SeqOutput, check_token_ids

if TYPE_CHECKING:
    from atom.config import EngineConfig
    from atom.messages import KVTransferParams, ResumedChoice

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and limits of one scheduler (copied from the engine config)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    num_speculative_tokens: int = 0  # most draft tokens a decode verifies per step (0 = off)
    spec_log_every_steps: int = 0  # a SpecStats log line every N verify steps (0 = never)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, max_model_len: int) -> SchedulerConfig:
        """The budgets of ``config`` (``max_model_len``: its resolved value)."""
        return cls(max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   max_model_len=max_model_len,
                   enable_chunked_prefill=config.enable_chunked_prefill,
                   num_speculative_tokens=(config.num_speculative_tokens
                                           if config.speculative_method else 0),
                   spec_log_every_steps=config.spec_log_every_steps)


class Scheduler:
    """Owns the waiting and running queues and every sequence's status and token counters.

    Args:
        config: budgets and limits.
        block_manager: the rank's KV block pool (the scheduler is its only caller).
        eos_token_ids: token ids that end a sequence unless ``ignore_eos``.
        proposer: with ``num_speculative_tokens > 0``, a proposer that runs inside
            :meth:`schedule` (``runs_in_scheduler``: n-gram); None = the drafts come from
            outside after scheduling (:meth:`set_spec_tokens`).
        connector: the scheduler side of the P/D KV connector (:mod:`atom.core.kv_connector`), or
            None. Only sequences with ``kv_transfer_params`` ever reach it.
        structured: the rank's grammars and matchers (:mod:`atom.core.structured_output`);
            None: a sequence with ``structured_outputs`` is refused with ``error``.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, *,
                 eos_token_ids: tuple[int, ...] = (), proposer: Proposer | None = None,
                 connector: KVConnectorScheduler | None = None,
                 structured: StructuredOutputManager | None = None):
        if proposer is not None and not proposer.runs_in_scheduler:
            raise ValueError(f"{type(proposer).__name__} cannot run inside the scheduler")
        self.config = config
        self.proposer = proposer
        self.connector = connector
        # P/D (atom.core.kv_connector), by request id: consumer sequences whose prompt KV is being
        # pulled (they hold blocks, outside the running batch), and producer sequences that
        # finished but whose blocks are kept for a consumer
        self.waiting_for_remote_kvs: dict[str, Sequence] = {}
        self.kv_kept: dict[str, Sequence] = {}
        self.structured = structured
        self.waiting_for_grammar: list[Sequence] = []  # arrival order
        self._grammar_failed: list[Sequence] = []  # until the next schedule() reports them
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = 0  # schedule() calls: the clock of waiting ages (never wall time)
        k = config.num_speculative_tokens
        self.spec_stats = SpecStats(k) if k else None  # counted by update_from_output
        self._finished_seq_ids: list[int] = []  # since the last schedule() (SchedulerOutput)

    # ----- queue entry and exit -----

    def add(self, seq: Sequence, *, error: str | None = None) -> bool:
        """Queue ``seq``; a sequence that can never run is finished at once with ``error``
        (``error``: a reason the caller found, e.g. token ids outside the vocabulary).

        Returns False when the sequence was rejected (``seq.error_message`` says why).
        """
        reason = error if error is not None else self._never_fits(len(seq.token_ids))
        spec = seq.sampling_params.structured_outputs
        if reason is None and spec is not None and self.structured is None:
            reason = "structured_outputs is not available on this engine"
        if reason is not None:
            self._finish(seq, FinishReason.ERROR, error_message=reason)
            return False
        if spec is not None:
            self.structured.submit(seq.seq_id, spec, seq.output_token_ids)
            seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(seq)
            return True
        seq.status = SequenceStatus.WAITING
        seq.waiting_since_step = self.num_steps
        self.waiting.append(seq)
        return True

    def resume(self, seqs: list[Sequence], resumed: list[ResumedChoice]) -> str | None:
        """Before :meth:`add`: a resumed request's choices (:class:`~atom.messages.ResumedChoice`,
        after a rank failure) get their outputs and summed logprob so far (queued, each runs as
        if preempted by recompute; a seeded one's generator is advanced past the tokens already
        drawn, :meth:`atom.worker.sampler.Sampler.generator_for`); one that had finished is
        never queued. Returns an error when ``resumed`` does not match the request's choices."""
        if len(resumed) != len(seqs):
            return (f"the resumed request has {len(resumed)} choices' progress for "
                    f"n={len(seqs)}: a front-end bug")
        for seq, choice in zip(seqs, resumed):
            seq.token_ids += choice.output_token_ids  # num_prompt_tokens stays the prompt's
            seq.cumulative_logprob = choice.cumulative_logprob
            if choice.finished:
                seq.status = SequenceStatus.FINISHED
        return None

    def attach_kv_transfer_params(self, seqs: list[Sequence], params: KVTransferParams, *,
                                  vocab_size: int) -> str | None:
        """Before :meth:`add`: give a P/D request's sequences their params (a consumer's output
        token 0 is the producer's first token). Returns why the request cannot run here (no
        connector, params this engine's role cannot serve, a first token outside the
        vocabulary), or None."""
        if self.connector is None:
            return "kv_transfer_params needs an engine started with --kv-role producer|consumer"
        error = self.connector.check_request(params, num_prompt_tokens=seqs[0].num_prompt_tokens,
                                             n=len(seqs))
        if error is None and params.do_remote_prefill:
            error = check_token_ids([params.first_token_id], [], [], vocab_size=vocab_size)
        if error is not None:
            return error
        for seq in seqs:
            seq.kv_transfer_params = params
            if params.do_remote_prefill:
                seq.token_ids.append(params.first_token_id)
        return None

    def _never_fits(self, num_tokens: int) -> str | None:
        cfg, bm = self.config, self.block_manager
        if num_tokens == 0:
            return "the prompt is empty: send at least one token"
        if num_tokens > cfg.max_model_len:
            return (f"the prompt has {num_tokens} tokens, more than max_model_len="
                    f"{cfg.max_model_len}: shorten it or raise max_model_len")
        num_blocks = bm.max_blocks_held(num_tokens, chunk_tokens=cfg.max_num_batched_tokens)
        if num_blocks > bm.num_blocks:
            return (f"the prompt needs {num_blocks} KV blocks but the "
                    f"whole pool has {bm.num_blocks}: shorten it or raise num_kv_blocks / "
                    f"kv_cache_memory_bytes")
        if not cfg.enable_chunked_prefill and num_tokens > cfg.max_num_batched_tokens:
            return (f"the prompt has {num_tokens} tokens, more than max_num_batched_tokens="
                    f"{cfg.max_num_batched_tokens} with chunked prefill off: enable chunked "
                    f"prefill or raise max_num_batched_tokens")
        return None

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        """End ``seq`` from outside the step (a stop string matched, or an abort)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS:
            del self.waiting_for_remote_kvs[seq.request_id]
            self.connector.request_cancelled(seq)  # the KV cache is written on this thread only
        elif seq.status is SequenceStatus.WAITING_FOR_GRAMMAR:
            self.waiting_for_grammar.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason, stop_reason=stop_reason)

    def _finish(self, seq: Sequence, reason: FinishReason, *, stop_reason: int | str | None = None,
                error_message: str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.error_message = error_message
        seq.spec_token_ids = []
        self._finished_seq_ids.append(seq.seq_id)
        if self.structured is not None and seq.sampling_params.structured_outputs is not None:
            self.structured.release(seq.seq_id)
        if seq.block_table:
            if seq.kv_transfer_params is not None and self.connector is not None:
                keep, seq.kv_transfer_params = self.connector.request_finished(seq, reason)
                if keep:  # freed when the worker reports it sent (update_from_kv_connector_output)
                    self.kv_kept[seq.request_id] = seq
                    return
            self.block_manager.free(seq)

    # ----- queries -----

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_stats(self) -> dict[str, int | float]:
        """The KV pool's blocks, the queues, preemptions, the prefix cache (in tokens;
        ``prefix_cache_hit_rate`` = hits / queries, 0 before any query), with speculative
        decoding the ``spec_*`` entries of :meth:`atom.core.spec_stats.SpecStats.as_stats`, and
        with a KV connector ``num_waiting_for_remote_kvs``."""
        bm = self.block_manager
        stats: dict[str, int | float] = {
            "num_free_blocks": bm.num_free_blocks, "num_total_blocks": bm.num_blocks,
            "num_running": self.num_running, "num_waiting": self.num_waiting,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prefix_cache_hit_rate": (bm.prefix_cache_hits / bm.prefix_cache_queries
                                      if bm.prefix_cache_queries else 0.0)}
        if self.spec_stats is not None:
            stats.update(self.spec_stats.as_stats())
        if self.connector is not None:
            stats["num_waiting_for_remote_kvs"] = len(self.waiting_for_remote_kvs)
        return stats

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_remote_kvs
                    or self.waiting_for_grammar)

    def has_pending_prefill(self) -> bool:
        """Waiting sequences or partial prefills exist (work a prefill policy may align)."""
        return bool(self.waiting) or self.has_partial_prefill()

    def num_running_decodes(self) -> int:
        """Running sequences past their prompt (each computes one token a step)."""
        return sum(1 for seq in self.running if not seq.is_prefill)

    def has_partial_prefill(self) -> bool:
        """A running sequence is part way through its prompt (a chunked prefill)."""
        return any(seq.is_prefill for seq in self.running)

    def oldest_waiting_age_steps(self) -> int:
        """Steps (``schedule()`` calls) the longest-waiting sequence has spent in the waiting
        queue since it last entered it (arrival or preemption); 0 when none waits."""
        if not self.waiting:
            return 0
        return self.num_steps - min(seq.waiting_since_step for seq in self.waiting)

    def preview_admission(self) -> AdmissionPreview:
        """The prefills ``schedule(allow_prefill=True)`` would start or continue now, and their
        tokens; no side effects.

        Runs the walk of ``schedule()`` itself (:meth:`_walk`) as a dry run: same budgets, same
        block costs, same stop at the first sequence that does not fit. Partial prefills that
        would get a chunk count too, with the chunk's tokens. Blocks the step would hand out
        (decode growth, draft slots, earlier admissions: revived prefix blocks, evictions) are
        tracked as :class:`DryRunClaims`, and choices admitted earlier in the dry run hold back
        their siblings, as in ``schedule()``. A decode that would have to preempt ends the dry
        run: ``schedule()`` admits nothing in a step that preempts (partial prefills behind
        that decode are not counted). Tokens are what the step would compute: prefix-cache hits
        excluded, chunks cut to the budget left (ATOM #2196: a fill signal built from raw
        prompt lengths never matched what the step then ran).
        """
        out = self._walk(allow_prefill=True, claims=DryRunClaims())
        # untouched by the dry run, every admitted sequence is still a prefill
        return AdmissionPreview(out.num_prefill_seqs, out.num_prefill_tokens)

    def _admission(self, seq: Sequence, token_budget: int, *, claims: DryRunClaims | None,
                   prefilling: dict[str, int]) -> tuple[int, int] | None:
        """(cached tokens, tokens computed this step) if ``seq`` can be admitted now, else None.

        Choices of an ``n > 1`` request wait while an earlier choice in prefill has not yet
        computed the prompt's full blocks, so they find them in the prefix cache instead of
        computing them again. ``claims``: a dry run's (None: the live state); ``prefilling``:
        see :meth:`_prefilling`, kept up to date by the walk's admissions.
        """
        bm = self.block_manager
        if seq.index > 0:
            num_cacheable = (len(seq.token_ids) - 1) // bm.block_size * bm.block_size
            if prefilling.get(seq.request_id, num_cacheable) < num_cacheable:
                return None
        num_blocks, num_cached = bm.admission_cost(seq, claims, token_budget=token_budget)
        num_free = bm.num_unclaimed_free_blocks(claims)
        shrunk = False
        if num_blocks > num_free:
            # a sliding KV cache group's blocks follow the first chunk: a shorter one may fit
            # (with chunking off, only a preempted sequence's recompute, which may have
            # outgrown what one step's sliding blocks and the full ones take together)
            if not (self.config.enable_chunked_prefill or seq.num_preemptions):
                return None
            token_budget = bm.fitting_first_chunk(seq, claims, token_budget=token_budget,
                                                  num_free_blocks=num_free)
            if token_budget == 0:
                return None
            shrunk = True
        num_uncomputed = len(seq.token_ids) - num_cached
        # chunking off: a prompt must fit one step (add() rejects longer ones); a preempted
        # sequence that outgrew the whole budget with its output tokens is recomputed in chunks
        # rather than waiting forever at the front of the queue
        if (not self.config.enable_chunked_prefill and not shrunk and num_uncomputed > token_budget
                and len(seq.token_ids) <= self.config.max_num_batched_tokens):
            return None
        return num_cached, min(num_uncomputed, token_budget)

    def _prefilling(self) -> dict[str, int]:
        """request id -> fewest computed tokens among its running sequences in prefill."""
        prefilling: dict[str, int] = {}
        for s in self.running:
            if s.is_prefill:
                prefilling[s.request_id] = min(prefilling.get(s.request_id, s.num_computed_tokens),
                                               s.num_computed_tokens)
        return prefilling

    # ----- the step -----

    def schedule(self, *, allow_prefill: bool = True) -> SchedulerOutput:
        """Build the next step's batch (see the module docstring for the policy).

        Args:
            allow_prefill: False holds every prefill (admissions and partial-prefill chunks)
                for this step; decodes still run. The DP loop passes the cross-rank decision.
        """
        self.num_steps += 1
        out = self._walk(allow_prefill=allow_prefill)
        out.failed, self._grammar_failed = self._grammar_failed, []
        if self.structured is not None:
            out.grammar_bitmask = self.structured.bitmask(
                [seq.seq_id for seq in out.sampled_seqs()
                 if seq.sampling_params.structured_outputs is not None])
        out.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, []
        if self.connector is not None:  # the pulls of the sequences admitted just now
            out.kv_connector_metadata = self.connector.build_connector_meta()
        return out

    def queue_ready_grammars(self) -> None:
        """Move the sequences whose grammar is ready to the waiting queue (in arrival order,
        behind those already waiting); finish those whose grammar failed (reported by the next
        :meth:`schedule`'s ``failed``). Called before a step's :meth:`preview_admission` and
        :meth:`schedule` (``EngineCore.step``; the DP loop before its control exchange), never
        inside them, so a dry run and the step it predicts see the same queue."""
        if not self.waiting_for_grammar:
            return
        still = []
        for seq in self.waiting_for_grammar:
            ready = self.structured.poll(seq.seq_id)
            if ready is False:
                still.append(seq)
            elif ready is True:
                seq.status = SequenceStatus.WAITING
                seq.waiting_since_step = self.num_steps
                self.waiting.append(seq)
            else:
                self._finish(seq, FinishReason.ERROR, error_message=ready)
                self._grammar_failed.append(seq)
        self.waiting_for_grammar = still

    def _walk(self, *, allow_prefill: bool, claims: DryRunClaims | None = None) -> SchedulerOutput:
        """The one admission rule of :meth:`schedule` and :meth:`preview_admission`. With
        ``claims`` a dry run: nothing changes but ``claims`` (the blocks the step would take),
        and a decode that would have to preempt ends the walk (the step then admits nothing)."""
        out = SchedulerOutput()
        token_budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and token_budget > 0:
            seq = self.running[i]
            if seq.is_prefill:
                if not allow_prefill:
                    i += 1
                    continue
                num_new = min(seq.num_uncomputed_tokens, token_budget)
                # a sliding KV cache group's table grows chunk by chunk (a no-op otherwise:
                # admission gave a full group blocks for the whole prompt); a chunk is cut to
                # the free blocks, and preempts only when not one token fits
                num_fit = self.block_manager.max_tokens_to_cover(
                    seq, seq.num_computed_tokens + num_new,
                    self.block_manager.num_unclaimed_free_blocks(claims)) - seq.num_computed_tokens
                num_new = min(num_new, num_fit) if num_fit > 0 else num_new
                num_tokens = seq.num_computed_tokens + num_new
                if claims is not None:
                    if not self.block_manager.claim_append(seq, claims, num_tokens):
                        return out  # would preempt: the step admits nothing
                elif not self._reserve_slots(seq, out, num_tokens):
                    continue  # seq left the running list (preempted or finished)
            else:
                num_new = 1
                if claims is not None:
                    if not self.block_manager.claim_append(seq, claims):
                        return out  # would preempt: the step admits nothing
                elif not self._reserve_slots(seq, out):
                    continue  # seq left the running list (preempted or finished)
                if self.config.num_speculative_tokens:  # drafts: budgeted, not in scheduled
                    token_budget -= self._reserve_spec_slots(seq, out, token_budget - 1, claims)
            out.scheduled.append((seq, num_new))
            token_budget -= num_new
            i += 1
        if allow_prefill and not out.preempted:
            self._admit_waiting(out, token_budget, claims)
        return out

    def _reserve_slots(self, seq: Sequence, out: SchedulerOutput,
                       num_tokens: int | None = None) -> bool:
        """Make room for ``num_tokens`` tokens of ``seq`` (default: all it has, a decode's one
        more), preempting the newest sequences if needed."""
        bm = self.block_manager
        num_tokens = len(seq.token_ids) if num_tokens is None else num_tokens
        while bm.num_blocks_to_cover(seq, num_tokens) > bm.num_free_blocks:
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                # alone and still out of blocks: the pool is smaller than this sequence
                self.running.remove(seq)
                self._finish(seq, FinishReason.LENGTH, error_message="the KV pool is full: raise "
                             "num_kv_blocks / kv_cache_memory_bytes")
                out.preempted.append(seq)
                return False
            self._preempt(victim, out)
            if victim is seq:
                return False
        bm.append_slots(seq, num_tokens)
        return True

    def _spec_tokens(self, seq: Sequence, token_budget: int, num_free_blocks: int) -> list[int] | range:
        """The drafts ``seq`` may verify this step: the in-scheduler proposer's tokens, or (for
        a proposer that runs later) a range standing for the slots to reserve. At most ``k``,
        and fewer when ``max_tokens`` or ``max_model_len`` is near (the verify emits up to one
        token more than it has drafts), when ``token_budget`` is short, or when the slots would
        need more than ``num_free_blocks`` new blocks (speculation never preempts)."""
        params = seq.sampling_params
        if params.structured_outputs is not None:
            return []  # no drafts under a grammar (atom.core.structured_output)
        num = min(self.config.num_speculative_tokens, token_budget,
                  self.config.max_model_len - len(seq.token_ids) - 1)
        if params.max_tokens is not None:
            num = min(num, params.max_tokens - seq.num_output_tokens - 1)
        while num > 0 and self._num_spec_blocks(seq, num) > num_free_blocks:
            num -= 1
        if num <= 0:
            return []
        if self.proposer is None:
            return range(num)
        return self.proposer.propose([seq], [num])[0]

    def _num_spec_blocks(self, seq: Sequence, num_spec: int) -> int:
        """New blocks ``num_spec`` draft slots take beyond the decode's own slot."""
        bm = self.block_manager
        return (bm.num_blocks_to_cover(seq, len(seq.token_ids) + num_spec)
                - bm.num_blocks_to_cover(seq, len(seq.token_ids)))

    def _reserve_spec_slots(self, seq: Sequence, out: SchedulerOutput, token_budget: int,
                            claims: DryRunClaims | None) -> int:
        """Reserve ``seq``'s draft slots (after its decode slot); returns how many. With a dry
        run's ``claims``, their blocks are claimed instead."""
        drafts = self._spec_tokens(seq, token_budget,
                                   self.block_manager.num_unclaimed_free_blocks(claims))
        if not drafts:
            return 0
        if claims is not None:
            self.block_manager.claim_new_blocks(self._num_spec_blocks(seq, len(drafts)), claims)
        else:
            if self.proposer is not None:
                seq.spec_token_ids = drafts
            self.block_manager.append_slots(seq, len(seq.token_ids) + len(drafts))
        out.spec_budget[seq.seq_id] = len(drafts)
        return len(drafts)

    def set_spec_tokens(self, out: SchedulerOutput, seqs: list[Sequence],
                        drafts: list[list[int]]) -> None:
        """Hand ``seqs`` their draft tokens (a model-based proposer's, after :meth:`schedule`);
        each fits the slots reserved for it (``out.spec_budget``), which shrinks to the drafts'
        length. Raises ValueError for more drafts than slots."""
        for seq, tokens in zip(seqs, drafts):
            budget = out.spec_budget.get(seq.seq_id, 0)
            if len(tokens) > budget:
                raise ValueError(f"seq {seq.seq_id}: {len(tokens)} drafts for {budget} reserved slots")
            seq.spec_token_ids = list(tokens)
            if tokens:
                out.spec_budget[seq.seq_id] = len(tokens)
            else:
                out.spec_budget.pop(seq.seq_id, None)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.waiting_since_step = self.num_steps
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        logger.debug("preempted seq %d (%d tokens)", seq.seq_id, len(seq.token_ids))

    def _admit_waiting(self, out: SchedulerOutput, token_budget: int,
                       claims: DryRunClaims | None) -> None:
        """Admit waiting sequences first-come-first-served until one does not fit (a dry run's
        ``claims``: record their blocks, change nothing)."""
        if not self.waiting:
            return
        prefilling = self._prefilling()
        num_seqs = len(self.running) + len(self.waiting_for_remote_kvs)
        num_admitted = 0
        for seq in self.waiting:  # popped after the loop (a deque cannot change while iterated)
            if token_budget <= 0 or num_seqs >= self.config.max_num_seqs:
                break
            decision = self._admission(seq, token_budget, claims=claims, prefilling=prefilling)
            if decision is None:
                break
            num_cached, num_new = decision
            num_admitted += 1
            num_seqs += 1
            if claims is not None:
                self.block_manager.claim(seq, claims, token_budget=num_new)
            else:
                num_cached = seq.num_computed_tokens = self.block_manager.allocate(
                    seq, token_budget=num_new)
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = num_cached
            if self._start_remote_load(seq, num_cached, claims):
                continue
            if num_cached < max(seq.num_prompt_tokens, len(seq.token_ids) - 1):  # as is_prefill
                prefilling[seq.request_id] = min(prefilling.get(seq.request_id, num_cached),
                                                 num_cached)
            if claims is None:
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            out.scheduled.append((seq, num_new))
            token_budget -= num_new
        if claims is None:
            for _ in range(num_admitted):
                self.waiting.popleft()

    # ----- the KV connector (P/D) -----

    def _start_remote_load(self, seq: Sequence, num_cached: int, claims: DryRunClaims | None
                           ) -> bool:
        """Admit a consumer sequence (its blocks are allocated) as waiting for its remote KV
        instead of prefilling it (a dry run's ``claims``: only say so); False when it has
        nothing to load (not a P/D consumer's)."""
        params = seq.kv_transfer_params
        if params is None or self.connector is None or not params.do_remote_prefill:
            return False
        if claims is not None:
            return True
        num_external, _ = self.connector.get_num_new_matched_tokens(seq, num_cached)
        # num_external == 0 (the whole prompt was cached here) still goes through the worker,
        # which reports it loaded at once: one path for the first-token injection
        self.connector.update_state_after_alloc(seq, num_external)
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_remote_kvs[seq.request_id] = seq
        return True

    def update_from_kv_connector_output(self, output: KVConnectorOutput) -> list[SeqOutput]:
        """Apply what the worker side finished: free kept blocks that were sent (producer);
        move loaded sequences to the running batch with their prompt computed and the
        producer's first token as their first output token (consumer); fail the sequences whose
        pull failed.

        Returns:
            The outputs: each loaded sequence's first token (a finish too, if it ended it), and
            each failed sequence's finish with ``error``.
        """
        for request_id in output.finished_sending:
            seq = self.kv_kept.pop(request_id, None)
            if seq is not None:
                self.block_manager.free(seq)
        outputs = []
        for request_id in output.finished_recving:
            seq = self.waiting_for_remote_kvs.pop(request_id, None)
            if seq is None:
                continue  # aborted meanwhile
            seq.num_computed_tokens = seq.num_prompt_tokens
            seq.kv_transfer_params = None  # loaded: a preemption now recomputes, as for any sequence
            self.block_manager.cache_computed_blocks(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            reason, stop_reason = self._stop_check(seq, seq.token_ids[-1])
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason, stop_reason=stop_reason)
            outputs.append(seq_output(seq, [seq.token_ids[-1]], None))
        for request_id, error in output.failed_recving.items():
            seq = self.waiting_for_remote_kvs.pop(request_id, None)
            if seq is not None:
                self._finish(seq, FinishReason.ERROR, error_message=error)
                outputs.append(finish_output(seq))
        return outputs

    def update_from_output(self, out: SchedulerOutput, output: ModelRunnerOutput
                           ) -> list[SeqOutput]:
        """Apply one step's results (vLLM v1's ``update_from_output``): advance counters,
        publish computed blocks, append the emitted tokens with their stop checks, count the
        verifies (``spec_stats``), record prompt logprobs, apply the KV connector's results.

        Args:
            out: the batch ``schedule()`` returned for this step.
            output: what the worker computed for it (a sequence that verified drafts emits its
                accepted drafts then one more, appended up to its first stop).
        Returns:
            The step's outputs: sequences the pool cut (finished without a token), the KV
            connector's loads and failures, then every sequence that got tokens (finished
            ones included), in batch order. Sequences finished from outside during the step
            report nothing.
        """
        outputs = [finish_output(seq) for seq in out.preempted if seq.is_finished]  # cut
        outputs += [finish_output(seq) for seq in out.failed]
        if output.kv_connector_output is not None:
            outputs += self.update_from_kv_connector_output(output.kv_connector_output)
        by_id = {seq.seq_id: seq for seq, _ in out.scheduled}
        for seq_id, entries in output.prompt_logprobs.items():
            recorded = by_id[seq_id].prompt_logprobs
            for position, entry in entries.items():
                if recorded[position] is None:  # a recomputed position keeps its first entry
                    recorded[position] = entry
        rows = {seq_id: row for row, seq_id in enumerate(output.seq_ids)}
        verified = False
        for seq, num_new in out.scheduled:
            if seq.is_finished:  # finished from outside during the step
                continue
            row = rows.get(seq.seq_id)
            if seq.seq_id in out.spec_budget:
                verified = True
                num_drafts, num_before = len(seq.spec_token_ids), len(seq.token_ids)
                self._append_verified(seq, output, row)
                num_kept = len(seq.token_ids) - num_before
                self.spec_stats.record(num_drafts=num_drafts, num_emitted=num_kept,
                                       num_accepted=len(output.sampled_token_ids[row]) - 1)
            else:
                seq.num_computed_tokens += num_new
                self.block_manager.cache_computed_blocks(seq)
                if row is None:
                    continue  # mid-prompt chunk: nothing sampled
                num_kept = 1
                self._append_sampled(seq, output, row)
            logprobs = None if output.logprobs is None else output.logprobs[row]
            outputs.append(seq_output(seq, seq.token_ids[len(seq.token_ids) - num_kept:],
                                      None if logprobs is None else logprobs[:num_kept]))
        if verified:
            self._count_verify_step()
        return outputs

    def _append_sampled(self, seq: Sequence, output: ModelRunnerOutput, row: int) -> None:
        """Append ``seq``'s one sampled token (row ``row`` of ``output``), then stop-check."""
        token_id = output.sampled_token_ids[row][0]
        seq.token_ids.append(token_id)
        if output.sampled_logprobs is not None:
            seq.cumulative_logprob += output.sampled_logprobs[row][0]
        reason, stop_reason = self._stop_check(seq, token_id)
        error = None
        if self.structured is not None and seq.sampling_params.structured_outputs is not None:
            error = self.structured.accept(seq.seq_id, token_id)
        if error is not None:  # only a worker that ignored the bitmask gets here
            reason, stop_reason = FinishReason.ERROR, None
        if reason is not None:
            self.running.remove(seq)
            self._finish(seq, reason, stop_reason=stop_reason, error_message=error)

    def _count_verify_step(self) -> None:
        stats = self.spec_stats
        stats.num_verify_steps += 1
        every = self.config.spec_log_every_steps
        if every and stats.num_verify_steps % every == 0:
            logger.info(stats.summary())

    def _append_verified(self, seq: Sequence, output: ModelRunnerOutput, row: int) -> None:
        """Append a verify step's emitted tokens (row ``row`` of ``output``) up to the first
        that stops the sequence.

        KV was written for the last token and every draft; only the last token and the
        accepted drafts (``len(token_ids) - 1``) count as computed, and never past the
        appended tokens (a stop cuts the run). Blocks past the kept tokens held only rejected
        drafts and are freed.
        """
        token_ids = output.sampled_token_ids[row]
        num_before = len(seq.token_ids)
        seq.spec_token_ids = []
        reason = stop_reason = None
        for token_id in token_ids:
            seq.token_ids.append(token_id)
            reason, stop_reason = self._stop_check(seq, token_id)
            if reason is not None:
                break
        if output.sampled_logprobs is not None:
            seq.cumulative_logprob += sum(output.sampled_logprobs[row][:len(seq.token_ids) - num_before])
        seq.num_computed_tokens = min(num_before + len(token_ids) - 1, len(seq.token_ids) - 1)
        self.block_manager.trim(seq, len(seq.token_ids))
        self.block_manager.cache_computed_blocks(seq)
        if reason is not None:
            self.running.remove(seq)
            self._finish(seq, reason, stop_reason=stop_reason)

    def _stop_check(self, seq: Sequence, token_id: int) -> tuple[FinishReason | None, int | None]:
        params = seq.sampling_params
        num_output = seq.num_output_tokens
        if num_output > params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return FinishReason.STOP, None
            if token_id in params.stop_token_ids:
                return FinishReason.STOP, token_id
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return FinishReason.LENGTH, None
        if len(seq.token_ids) >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None, None
