"""EngineCore: one rank's tokenizer-free core — scheduler, block manager, model runner, sampler.

The core speaks token ids only (docs/ARCHITECTURE.md, "One rank"): it takes
:class:`~atom.messages.EngineCoreRequest` s and returns :class:`~atom.messages.SeqOutput` s (new
token ids and logprobs per sampled sequence, and finishes). Text, stop strings and per-request
output assembly live in the front end (:mod:`atom.engine.output_processor`).

It runs in-process (:class:`atom.engine.llm_engine.LLMEngine`) or inside its own process
(:mod:`atom.engine.core_proc`), whose busy loop calls :meth:`EngineCore.step`. The data-parallel
loop (``atom.dp.dp_core_proc``, which this module never imports) calls the halves of a step
itself, with the cross-rank exchanges between them: :meth:`EngineCore.schedule` (with the
tick's prefill decision as a value), then :meth:`EngineCore.execute`, after
:meth:`EngineCore.execute_dummy_batch` when this rank has nothing to run.

What a step reports, per sequence:

- a sampled token: ``new_token_ids=[token]`` (plus its logprobs entry when requested) and, if the
  token ended the sequence (EOS, stop token id, ``max_tokens``, ``max_model_len``), its
  ``finish_reason``;
- a sequence finished without a token (rejected at ``add_request`` with ``error``, or cut
  because the KV pool cannot hold it): ``new_token_ids=[]`` and the finish;
- prompt logprobs go once, whole, with the first sampled token of choice 0: by then every
  prompt position has been computed (sampling happens only after the last prompt chunk). A
  request that ends before its first token never sends them.

KV events: with :meth:`atom.config.EngineConfig.resolved_kv_events` set, the core owns a
:class:`~atom.kv_events.KVEventPublisher` (its DP rank's endpoint and seq) and hands it the
block manager's events once per step, at the end of :meth:`EngineCore.execute` (and right after
a prefix-cache reset); the publisher's thread encodes and sends, so a step never waits on it.

A resumed request (``EngineCoreRequest.resumed``, after a rank failure) brings each choice's
output tokens so far: its sequences start as if preempted by recompute, a seeded one's
generator is advanced past the tokens already drawn (:class:`~atom.worker.sampler.Sampler`), and
choices that had finished are not run again.

P/D disaggregation: with ``kv_role`` set, the core owns the worker side of the KV connector
(:class:`atom.worker.tcp_kv_connector.TCPKVConnector`) and gives the scheduler its scheduler side
(:mod:`atom.core.kv_connector`). It applies the worker's output at the start of :meth:`schedule`
(a consumer's loaded sequence reports the producer's first token then) and hands it the
scheduler side's metadata at the end of :meth:`schedule`, :meth:`execute` and
:meth:`abort_requests`; a finished producer prefill's output carries ``kv_transfer_params``.

Sequences finished from outside (:meth:`EngineCore.abort_requests`,
:meth:`EngineCore.finish_requests`) report nothing: the front end ended them and already knows.
One finished between :meth:`EngineCore.schedule` and :meth:`EngineCore.execute` is dropped from
the step before the forward (its blocks, draft slots included, are already free).

Speculative decoding (``speculative_method``): the scheduler reserves draft slots and the
n-gram proposer fills them inside ``schedule()``; the early-exit draft
(:mod:`atom.worker.draft_proposer`) fills them in :meth:`EngineCore.schedule` right after, so the
batch (and a DP rank's batch shape) is final when ``schedule`` returns. The forward scores every
draft; :class:`~atom.worker.rejection_sampler.RejectionSampler` keeps the accepted ones plus one token,
the scheduler cuts the run at the first stop, and a sequence's output carries all the tokens it
kept this step (``new_token_ids`` may hold several). :class:`~atom.engine.spec_stats.SpecStats` counts
it (``get_stats()``'s ``spec_*`` entries, a log line every ``spec_log_every_steps`` verify
steps). Without ``speculative_method`` none of this runs.
"""

from __future__ import annotations

import logging
import torch

from atom.core.block_manager import BlockManager
from atom.config import EngineConfig
from atom.core.kv_connector import KVConnectorScheduler, KVLayout
from atom.kv_cache_spec import describe_layers
from atom.layers.moe import ExpertShard
from atom.messages import (
    EngineCoreRequest,
    EngineRuntime,
    KVTransferParams,
    ResumedChoice,
    SeqOutput,
    check_token_ids,
)
from atom.worker.sampler import Sampler, top_logprobs
from atom.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from atom.core.sequence import FinishReason, Sequence
from atom.worker.tbo import can_split

logger = logging.getLogger(__name__)

# what a UtilityCall may name
UTILITY_METHODS = ("get_stats", "reset_prefix_cache", "get_cached_block_hashes")
_KV_WAIT_S = 0.01  # a step with only remote KV pulls in flight waits this long for one


class _RequestState:
    """The core's view of one request: its sequences and (choice 0's) prompt logprobs."""

    __slots__ = ("seqs", "prompt_logprobs")

    def __init__(self, seqs: list[Sequence], prompt_logprobs: list[dict[int, float] | None] | None):
        self.seqs = seqs
        self.prompt_logprobs = prompt_logprobs


class EngineCore:
    """Runs token-id requests on one rank.

    Owns the model runner (weights, KV cache tensors), the block manager, the scheduler and
    the sampler; mutates sequence state only through the scheduler. Not thread-safe: one
    caller (the busy loop, or the in-process engine) drives it.

    Args:
        config: engine options.
        extra_eos_token_ids: EOS ids the front end knows besides the model config's (e.g. the
            tokenizer's ``eos_token_id``); the core has no tokenizer of its own.
        dp_rank: this core's DP rank (its KV events endpoint offset and batch stamp).

    Raises:
        ValueError: invalid options or a model that cannot be loaded.
        RuntimeError: the KV events endpoint cannot be bound (in use, bad address).
    """

    def __init__(self, config: EngineConfig, *, extra_eos_token_ids: tuple[int, ...] = (),
                 dp_rank: int = 0):
        from atom.worker.model_loader import load_model_weights, release_freed_heap
        from atom.worker.model_runner import ModelRunner

        self.config = config
        torch.set_num_threads(config.resolved_num_threads())
        dtype_name = config.resolved_dtype()
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
        arch, weights = load_model_weights(config.model, dtype)
        blocks = None
        if config.quantization == "gguf":
            from atom.worker.model_loader import load_gguf_blocks

            blocks = load_gguf_blocks(config.model)
        max_model_len = config.resolved_max_model_len(arch.max_position_embeddings)
        bytes_per_block = ModelRunner.kv_cache_bytes_per_block(arch, dtype=dtype, block_size=config.block_size)
        draft = None if config.draft_model is None else _load_draft_model(
            config.draft_model, dtype, target=arch, max_model_len=max_model_len)
        if draft is not None:  # its cache has the target's blocks: the budget covers both
            bytes_per_block += ModelRunner.kv_cache_bytes_per_block(
                draft[0], dtype=dtype, block_size=config.block_size)
        num_blocks = config.resolved_num_kv_blocks(bytes_per_block)
        if num_blocks * config.block_size < max_model_len:
            logger.warning("KV pool holds %d tokens, fewer than max_model_len=%d: long sequences "
                           "will be preempted or cut", num_blocks * config.block_size, max_model_len)
        # under expert parallelism every rank reads and holds only its own experts
        expert_shard = (ExpertShard(dp_rank, config.data_parallel_size)
                        if config.enable_expert_parallel else None)
        self.runner = ModelRunner(arch, weights, dtype=dtype, num_kv_blocks=num_blocks,
                                  block_size=config.block_size, max_model_len=max_model_len,
                                  moe_split_experts=config.moe_split_experts,
                                  quantized_weights=blocks, expert_shard=expert_shard)
        del weights, blocks  # the model holds its own copies (or none: tiled GGUF linears)
        if config.enable_expert_parallel and not self.is_moe:
            raise ValueError("--enable-expert-parallel needs an MoE model: load one (e.g. a "
                             "Qwen3-MoE or Mixtral folder) or split a dense one with "
                             "--moe-split-experts E")
        eos = tuple(sorted(set(arch.eos_token_ids) | set(extra_eos_token_ids)))
        self.runtime = EngineRuntime(num_kv_blocks=num_blocks, max_model_len=max_model_len,
                                     vocab_size=arch.vocab_size, eos_token_ids=eos,
                                     kv_cache_bytes=num_blocks * bytes_per_block, dtype=dtype_name,
                                     num_experts=self.num_experts)
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.kv_connector = _start_kv_connector(config, self.runner, dp_rank, KVLayout(
            architecture=arch.architecture, dtype=dtype_name, block_size=config.block_size,
            layers=tuple(self.runner.kv_cache_specs)))
        draft_runner = None if draft is None else ModelRunner(
            *draft, dtype=dtype, num_kv_blocks=num_blocks, block_size=config.block_size,
            max_model_len=max_model_len)
        del draft
        self.draft_proposer, ngram = _make_proposers(config, self.runner, draft_runner)
        self.scheduler = Scheduler(
            SchedulerConfig.from_engine_config(config, max_model_len), self.block_manager,
            eos_token_ids=eos, proposer=ngram,
            connector=None if self.kv_connector is None else KVConnectorScheduler(
                config.kv_role, block_size=config.block_size, host=config.kv_transfer_host,
                port=self.kv_connector.port))
        self.sampler = Sampler(eos, seed=config.seed, dp_rank=dp_rank)
        self.rejection_sampler = self.spec_stats = None
        if config.speculative_method is not None:
            from atom.worker.rejection_sampler import RejectionSampler
            from atom.engine.spec_stats import SpecStats

            self.rejection_sampler = RejectionSampler(self.sampler)
            self.spec_stats = SpecStats(config.num_speculative_tokens)
        self.kv_event_publisher = _start_publisher(config, dp_rank)
        self._requests: dict[str, _RequestState] = {}
        self._pending: list[SeqOutput] = []  # finishes decided outside a step (rejections)
        self.num_aborted_seqs = 0
        self.num_front_end_finished_seqs = 0
        release_freed_heap()
        logger.info("engine core ready: %s, dtype %s, %d KV blocks x %d tokens (%.1f MiB, %d "
                    "bytes per token: %s), max_model_len %d",
                    config.model or "embedded SmolLM2-135M-Instruct", dtype_name, num_blocks,
                    config.block_size, self.runtime.kv_cache_bytes / 2**20,
                    bytes_per_block // config.block_size,
                    describe_layers(self.runner.kv_cache_specs), max_model_len)

    @property
    def num_experts(self) -> int | None:
        """Experts of each MoE layer, over all ranks (before any expert-parallel sharding);
        None for a dense model."""
        from atom.layers.moe import moe_layers

        layers = moe_layers(self.runner.model)
        return layers[0].num_experts if layers else None

    @property
    def is_moe(self) -> bool:
        """Whether the model has MoE layers (their experts can be sharded across DP ranks)."""
        from atom.layers.moe import moe_layers

        return bool(moe_layers(self.runner.model))

    # ----- inputs -----

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. A request that can never run (token ids outside the vocabulary, an
        empty or too long prompt, a duplicate id) is finished with ``error`` and its message,
        reported by the next :meth:`step`; this never raises for a bad request.
        """
        params = request.sampling_params
        seqs = [Sequence(request.request_id, list(request.prompt_token_ids), params, index=i,
                         arrival_time_s=request.arrival_time_s) for i in range(params.n)]
        if request.resumed is not None:
            error = _resume(self.scheduler, seqs, request.resumed)
            if error is not None:
                self._pending += [_finish_output(seq, FinishReason.ERROR, error=error)
                                  for seq in seqs]
                return
        if request.request_id in self._requests:
            # Not registered: the running request of that id must not be disturbed.
            message = f"request_id {request.request_id!r} is already running; use a unique id"
            self._pending += [_finish_output(seq, FinishReason.ERROR, error=message) for seq in seqs]
            return
        error = self._validate(request)
        if request.kv_transfer_params is not None and error is None:
            error = self._attach_kv_transfer_params(seqs, request.kv_transfer_params)
        prompt_logprobs = ([None] * len(seqs[0].token_ids)
                           if params.prompt_logprobs is not None else None)
        self._requests[request.request_id] = _RequestState(seqs, prompt_logprobs)
        for seq in seqs:
            if seq.is_finished:  # a resumed choice that had finished before the failure
                continue
            self.scheduler.add(seq, error=error)  # may reject (too long, empty, bad ids)
            if seq.is_finished:
                self._pending.append(_finish_output(seq, seq.finish_reason, error=seq.error_message))
        self._forget_if_done(request.request_id)

    def _validate(self, request: EngineCoreRequest) -> str | None:
        params = request.sampling_params
        return check_token_ids(request.prompt_token_ids, params.stop_token_ids,
                               list(params.logit_bias), vocab_size=self.runtime.vocab_size)

    def _attach_kv_transfer_params(self, seqs: list[Sequence], params: KVTransferParams) -> str | None:
        """Give a P/D request's sequences their params (a consumer's also gets the producer's
        first token as output token 0); returns why the request cannot run here, or None."""
        connector = self.scheduler.connector
        if connector is None:
            return "kv_transfer_params needs an engine started with --kv-role producer|consumer"
        error = connector.check_request(params, num_prompt_tokens=seqs[0].num_prompt_tokens,
                                        n=len(seqs))
        if error is None and params.do_remote_prefill:
            error = check_token_ids([params.first_token_id], [], [],
                                    vocab_size=self.runtime.vocab_size)
        if error is not None:
            return error
        for seq in seqs:
            self.scheduler.attach_kv_transfer_params(seq, params)
        return None

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
            state = self._requests.get(request_id)
            if state is None:
                continue
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.ABORT)
                    self.num_aborted_seqs += 1
            self._forget_if_done(request_id)
        self._sync_kv_connector()  # an aborted pull is dropped, its producer told

    def finish_requests(self, seq_keys: list[tuple[str, int]], stop_reasons: list[str]) -> None:
        """The front end found a stop string: finish those sequences with ``stop`` and free
        their KV blocks now. Not an abort (counted apart). Sequences that already finished here
        (e.g. on ``max_tokens`` in the step the front end had not seen yet) are ignored.

        Args:
            seq_keys: ``(request_id, choice index)`` pairs.
            stop_reasons: the matched stop string of each pair.
        """
        for (request_id, index), stop in zip(seq_keys, stop_reasons):
            state = self._requests.get(request_id)
            if state is None or not 0 <= index < len(state.seqs):
                continue
            seq = state.seqs[index]
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.STOP, stop_reason=stop)
                self.num_front_end_finished_seqs += 1
            self._forget_if_done(request_id)

    def _forget_if_done(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None and all(seq.is_finished for seq in state.seqs):
            for seq in state.seqs:
                self.sampler.release(seq.seq_id)
            del self._requests[request_id]

    # ----- the step -----

    def has_work(self) -> bool:
        """Unfinished sequences or unreported finishes exist, or the KV connector finished
        something (the busy loop keeps stepping)."""
        return (bool(self._pending) or self.scheduler.has_unfinished()
                or (self.kv_connector is not None and self.kv_connector.has_pending_output()))

    def step(self) -> list[SeqOutput]:
        """Run one tick: schedule → forward → sample → postprocess. Returns what changed (see
        the module docstring); rejected requests' finishes come first. With ``enable_tbo``, a
        batch :func:`atom.worker.tbo.can_split` allows runs as two micro-batches."""
        sched = self.schedule()
        outputs = self.execute(sched, two_batch_overlap=self.tbo_eligible(sched))
        if sched.is_empty and self.scheduler.waiting_for_remote_kvs:
            self.kv_connector.wait(_KV_WAIT_S)  # only pulls in flight: no busy spinning
        return outputs

    def tbo_eligible(self, sched: SchedulerOutput) -> bool:
        """Whether ``enable_tbo`` is on and this batch can run as two micro-batches (the DP
        loop splits only when every rank's answer is yes)."""
        return self.config.enable_tbo and not sched.spec_budget and can_split(sched.scheduled)

    def schedule(self, *, allow_prefill: bool = True, defer_drafts: bool = False) -> SchedulerOutput:
        """The first half of :meth:`step`: pick this tick's batch (``allow_prefill=False`` holds
        every prefill: the cross-rank decision of the tick). The DP loop exchanges the batch
        shape between :meth:`schedule` and :meth:`execute`. With the early-exit draft, its
        forwards run here and fill the reserved draft slots, unless ``defer_drafts`` (the DP
        loop: every rank must run the same number of draft forwards, agreed in the exchange,
        then :meth:`run_drafts`)."""
        if self.kv_connector is not None:
            self.apply_kv_connector_output()
        sched = self.scheduler.schedule(allow_prefill=allow_prefill)
        if self.kv_connector is not None:
            self._sync_kv_connector()  # start the pulls of the sequences admitted just now
        if self.draft_proposer is not None and sched.spec_budget and not defer_drafts:
            self.run_drafts(sched)
        return sched

    def run_drafts(self, sched: SchedulerOutput, *, num_steps: int | None = None) -> None:
        """Fill ``sched``'s reserved draft slots with the early-exit draft (a no-op without one).
        ``num_steps``: draft forwards to run, the extra ones on zero tokens (the DP loop passes
        the largest over the ranks, so every rank issues the same MoE collectives)."""
        if self.draft_proposer is None:
            return
        seqs = [seq for seq, _ in sched.scheduled if seq.seq_id in sched.spec_budget]
        drafts = self.draft_proposer.propose(seqs, [sched.spec_budget[s.seq_id] for s in seqs],
                                             num_steps=num_steps)
        self.scheduler.set_spec_tokens(sched, seqs, drafts)

    def _sync_kv_connector(self) -> None:
        """Hand the scheduler side's changes (loads, kept blocks, cancels) to the worker."""
        if self.kv_connector is not None:
            meta = self.scheduler.connector.build_connector_meta()
            if not meta.is_empty:
                self.kv_connector.start_load_kv(meta)

    def apply_kv_connector_output(self) -> None:
        """What the worker finished: kept blocks freed; loaded sequences report the producer's
        first token (a finish too, if it ended them); failed pulls finish with ``error``.
        Called by :meth:`schedule`, and by an idle DP rank between waves (only a producer's
        kept blocks can finish then: freeing them needs no forward and no collective)."""
        loaded, failed = self.scheduler.update_from_kv_connector_output(
            self.kv_connector.get_finished())
        for seq in loaded:
            self._pending.append(SeqOutput(
                request_id=seq.request_id, index=seq.index, new_token_ids=[seq.token_ids[-1]],
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason, num_cached_tokens=seq.num_cached_tokens,
                num_prompt_tokens=seq.num_prompt_tokens))
        self._pending += [_finish_output(seq, seq.finish_reason, error=seq.error_message)
                          for seq in failed]
        for seq in loaded + failed:
            if seq.is_finished:
                self._forget_if_done(seq.request_id)

    def execute(self, sched: SchedulerOutput, *, two_batch_overlap: bool = False
                ) -> list[SeqOutput]:
        """The second half of :meth:`step`: forward (as two micro-batches with
        ``two_batch_overlap``), sample, postprocess ``sched`` (from :meth:`schedule` of this
        tick). An empty ``sched`` runs no forward here (a DP rank runs
        :meth:`execute_dummy_batch` for it first) but still reports finishes decided outside a
        forward."""
        outputs, self._pending = self._pending, []
        for seq in sched.preempted:
            if seq.is_finished:  # cut: the pool cannot hold this sequence even alone
                outputs.append(_finish_output(seq, seq.finish_reason, error=seq.error_message))
                self._forget_if_done(seq.request_id)
        if any(seq.is_finished for seq, _ in sched.scheduled):  # finished since schedule()
            sched.scheduled = [(seq, n) for seq, n in sched.scheduled if not seq.is_finished]
        if not sched.is_empty:
            outputs += self._execute(sched, two_batch_overlap)
        self._sync_kv_connector()  # blocks kept for consumers, before the outputs announce them
        self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        """This step's block-manager events as one batch (taken even when nobody publishes,
        so they never pile up)."""
        events = self.block_manager.take_events()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(events)

    def execute_dummy_batch(self, *, two_batch_overlap: bool = False) -> None:
        """A forward over zero tokens that writes no KV: a DP rank with nothing to run takes
        this step so that it issues the same collectives (MoE dispatch/combine, split the same
        way with ``two_batch_overlap``) as the ranks that do."""
        self.runner.execute_model([], two_batch_overlap=two_batch_overlap)

    def _execute(self, sched: SchedulerOutput, two_batch_overlap: bool) -> list[SeqOutput]:
        model_out = self.runner.execute_model(sched.scheduled, two_batch_overlap=two_batch_overlap)
        by_id = {seq.seq_id: seq for seq, _ in sched.scheduled}
        seqs = [by_id[i] for i in model_out.sampled_seq_ids]
        self._record_prompt_logprobs(model_out.prompt_logits, by_id)
        if not seqs:
            self.scheduler.postprocess(sched, {})
            return []
        if model_out.num_rows is not None:
            return self._verify(sched, model_out.logits, seqs)
        sampled = self.sampler(model_out.logits, seqs)
        self.scheduler.postprocess(sched, dict(zip(model_out.sampled_seq_ids, sampled.token_ids)),
                                   dict(zip(model_out.sampled_seq_ids, sampled.sampled_logprobs)))
        outputs = [self._seq_output(seq, [seq.token_ids[-1]], None if top is None else [top])
                   for seq, top in zip(seqs, sampled.logprobs)]
        self._forget_finished(seqs)
        return outputs

    def _verify(self, sched: SchedulerOutput, logits: torch.Tensor, seqs: list[Sequence]
                ) -> list[SeqOutput]:
        """The rest of a speculative step: verify every sampled sequence's drafts (none for a
        prefill's last chunk or a decode without drafts: one sampled token), have the
        scheduler append what each keeps (cut at its first stop), count the verifies, build
        the outputs."""
        drafts = [seq.spec_token_ids for seq in seqs]
        verified = self.rejection_sampler(logits, seqs, drafts)
        num_before = [len(seq.token_ids) for seq in seqs]
        spec = sched.spec_budget
        self.scheduler.postprocess(sched, {
            seq.seq_id: tokens if seq.seq_id in spec else tokens[0]
            for seq, tokens in zip(seqs, verified.token_ids)}, {
            seq.seq_id: logprobs if seq.seq_id in spec else logprobs[0]
            for seq, logprobs in zip(seqs, verified.sampled_logprobs)})
        stats = self.spec_stats
        stats.num_verify_steps += 1
        outputs = []
        for row, seq in enumerate(seqs):
            num_new = len(seq.token_ids) - num_before[row]
            if drafts[row]:
                stats.record(num_drafts=len(drafts[row]), num_accepted=len(verified.token_ids[row]) - 1,
                             num_emitted=num_new)
            outputs.append(self._seq_output(seq, seq.token_ids[len(seq.token_ids) - num_new:],
                                            verified.logprobs[row][:num_new]
                                            if seq.sampling_params.logprobs is not None else None))
        every = self.config.spec_log_every_steps
        if every and stats.num_verify_steps % every == 0:
            logger.info(stats.summary())
        self._forget_finished(seqs)
        return outputs

    def _seq_output(self, seq: Sequence, new_token_ids: list[int],
                    new_logprobs: list[dict[int, float]] | None) -> SeqOutput:
        """A sampled sequence's output for this step (prompt logprobs with choice 0's first)."""
        state = self._requests[seq.request_id]
        send_prompt_logprobs = seq.index == 0 and seq.num_output_tokens == len(new_token_ids)
        return SeqOutput(
            request_id=seq.request_id, index=seq.index, new_token_ids=new_token_ids,
            new_logprobs=new_logprobs, cumulative_logprob=seq.cumulative_logprob,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason, error=seq.error_message,
            num_cached_tokens=seq.num_cached_tokens, num_prompt_tokens=seq.num_prompt_tokens,
            prompt_logprobs=state.prompt_logprobs if send_prompt_logprobs else None,
            kv_transfer_params=seq.kv_transfer_params if seq.is_finished else None)

    def _forget_finished(self, seqs: list[Sequence]) -> None:
        """Forget the requests of finished ``seqs`` (after the outputs: siblings may be in it)."""
        for request_id in {seq.request_id: None for seq in seqs if seq.is_finished}:
            self._forget_if_done(request_id)

    def _record_prompt_logprobs(self, prompt_logits: dict[int, torch.Tensor],
                                by_id: dict[int, Sequence]) -> None:
        """Fill ``prompt_logprobs[p + 1]`` from the logits row of prompt position ``p``.

        Runs before ``postprocess``, so ``num_computed_tokens`` is still the first position
        computed this step. Positions recomputed after a preemption are skipped (already
        filled). Prompt-logprob requests bypass the prefix cache (block manager), so every
        position is computed once.
        """
        for seq_id, logits in prompt_logits.items():
            seq = by_id[seq_id]
            state = self._requests[seq.request_id]
            if seq.index != 0 or state.prompt_logprobs is None:
                continue
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            for row in range(logprobs.shape[0]):
                target = seq.num_computed_tokens + row + 1
                if target < seq.num_prompt_tokens and state.prompt_logprobs[target] is None:
                    state.prompt_logprobs[target] = top_logprobs(
                        logprobs[row], seq.token_ids[target], seq.sampling_params.prompt_logprobs)

    # ----- stats and utilities -----

    def get_stats(self) -> dict[str, int | float]:
        """Counters of the KV pool (its bytes, and bytes per token over every layer: the
        latent size for MLA), queues, prefix cache (in tokens; ``prefix_cache_hit_rate``
        = hits / queries, 0 before any query), outside finishes (``num_aborted_seqs``: client
        aborts; ``num_front_end_finished_seqs``: stop strings), with speculative decoding the
        ``spec_*`` entries of :meth:`atom.engine.spec_stats.SpecStats.as_stats` and, when publishing,
        KV event batches (``kv_events_published_batches``, ``kv_events_dropped_batches``)."""
        bm = self.block_manager
        stats: dict[str, int | float] = {
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "kv_cache_bytes": self.runtime.kv_cache_bytes,
            "kv_cache_bytes_per_token": self.runtime.kv_cache_bytes // (
                bm.num_blocks * self.config.block_size),
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "prefix_cache_hit_rate": prefix_cache_hit_rate(bm.prefix_cache_hits,
                                                           bm.prefix_cache_queries),
            "num_aborted_seqs": self.num_aborted_seqs,
            "num_front_end_finished_seqs": self.num_front_end_finished_seqs,
        }
        if self.spec_stats is not None:
            stats.update(self.spec_stats.as_stats())
        if self.kv_event_publisher is not None:
            pub = self.kv_event_publisher.stats()
            stats["kv_events_published_batches"] = pub["num_published_batches"]
            stats["kv_events_dropped_batches"] = pub["num_dropped_batches"]
        if self.kv_connector is not None:
            stats.update(self.kv_connector.get_stats())
            stats["num_waiting_for_remote_kvs"] = len(self.scheduler.waiting_for_remote_kvs)
        return stats

    def reset_prefix_cache(self) -> dict[str, bool]:
        """Drop the prefix cache; ``{"reset": False}`` (nothing done) while blocks are in use.
        Its ``AllBlocksCleared`` is published at once (the core may be idle for long)."""
        reset = self.block_manager.reset_prefix_cache()
        self._publish_kv_events()
        return {"reset": reset}

    def get_cached_block_hashes(self) -> dict[str, list[int]]:
        """``{"block_hashes": [...]}``: the prefix cache's block hashes in wire form, sorted —
        what an index rebuilt from this core's KV events holds once it has caught up."""
        from atom.kv_events import to_wire_hash

        return {"block_hashes": sorted(to_wire_hash(h) for h in self.block_manager.hash_to_block)}

    def close(self) -> None:
        """Stop the KV events publisher (sending what it has queued) and the KV connector.
        Idempotent."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        if self.kv_connector is not None:
            self.kv_connector.close()

    def call_utility(self, method: str) -> dict:
        """Run a utility method by name (one of ``UTILITY_METHODS``).

        Raises:
            ValueError: an unknown method name.
        """
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}; known: {list(UTILITY_METHODS)}")
        return getattr(self, method)()


def prefix_cache_hit_rate(hits: int, queries: int) -> float:
    """Prompt tokens served from the prefix cache / prompt tokens looked up (0 with none)."""
    return hits / queries if queries else 0.0


def _make_proposers(config: EngineConfig, runner, draft_runner=None):
    """(model-based proposer run by the core, in-scheduler proposer) for ``config``'s
    ``speculative_method``; (None, None) when speculative decoding is off. ``draft_runner``:
    the separate draft model's runner (``draft_model``); it then runs every step's forward
    beside the target's (``ModelRunner.shadow_model``), so its own KV cache holds what the
    target's does."""
    if config.speculative_method == "ngram":
        from atom.core.ngram_proposer import NgramProposer

        return None, NgramProposer(prompt_lookup_min=config.prompt_lookup_min,
                                   prompt_lookup_max=config.prompt_lookup_max)
    if config.speculative_method == "draft":
        from atom.worker.draft_proposer import EarlyExitProposer

        if draft_runner is None:
            return EarlyExitProposer(runner, num_layers=config.draft_num_layers), None
        runner.shadow_model = draft_runner.model
        return EarlyExitProposer(draft_runner, num_layers=config.draft_num_layers
                                 or draft_runner.arch_config.num_hidden_layers), None
    return None, None


def _load_draft_model(path: str, dtype, *, target, max_model_len: int):
    """The draft model's (architecture, weights) for the target's architecture ``target``.

    Raises:
        ValueError: the draft cannot be loaded, its vocabulary is not the target's (a draft
            must share the target's tokenizer), or it has fewer positions than
            ``max_model_len``.
    """
    from atom.worker.model_loader import load_model_weights

    arch, weights = load_model_weights(path, dtype)
    if arch.vocab_size != target.vocab_size:
        raise ValueError(f"draft_model {path}: vocabulary of {arch.vocab_size} tokens, the "
                         f"target's has {target.vocab_size}: a draft must share the target's "
                         "tokenizer")
    if arch.max_position_embeddings < max_model_len:
        raise ValueError(f"draft_model {path}: {arch.max_position_embeddings} positions, fewer "
                         f"than max_model_len={max_model_len}: lower --max-model-len")
    return arch, weights


def _start_publisher(config: EngineConfig, dp_rank: int):
    """This core's KV events publisher, or None when events are off.

    Raises:
        RuntimeError: an endpoint cannot be bound (the message names it).
    """
    import zmq

    from atom.kv_events import KVEventPublisher

    settings = config.resolved_kv_events()
    if settings is None:
        return None
    try:
        return KVEventPublisher(settings, dp_rank=dp_rank)
    except zmq.ZMQError as exc:
        raise RuntimeError(f"dp rank {dp_rank}: cannot bind the KV events endpoints "
                           f"{settings.endpoint} / {settings.replay_endpoint} (offset by the "
                           f"rank): {exc}") from exc


def _start_kv_connector(config: EngineConfig, runner, dp_rank: int, layout: KVLayout):
    """The worker side of the P/D KV connector (:mod:`atom.worker.tcp_kv_connector`), or None when
    ``kv_role`` is unset. DP rank r of a producer binds ``kv_transfer_port + r`` (an
    OS-chosen port with 0); its kv_transfer_params name that rank's port.

    Raises:
        RuntimeError: a producer cannot bind its KV transfer port.
    """
    if config.kv_role is None:
        return None
    from atom.worker.tcp_kv_connector import TCPKVConnector

    return TCPKVConnector(config.kv_role, runner.kv_caches, layout, host=config.kv_transfer_host,
                          port=config.kv_transfer_port and config.kv_transfer_port + dp_rank,
                          keep_timeout_s=config.kv_transfer_keep_timeout_s,
                          pull_timeout_s=config.kv_transfer_timeout_s)


def _resume(scheduler: Scheduler, seqs: list[Sequence], resumed: list[ResumedChoice]) -> str | None:
    """Have ``scheduler`` give each sequence of a resumed request
    (:class:`~atom.messages.ResumedChoice`) the output tokens it had
    (:meth:`~atom.core.scheduler.Scheduler.resume`). Returns an error when ``resumed`` does not
    match the request's choices."""
    if len(resumed) != len(seqs):
        return (f"the resumed request has {len(resumed)} choices' progress for n={len(seqs)}: "
                f"a front-end bug")
    for seq, choice in zip(seqs, resumed):
        scheduler.resume(seq, choice.output_token_ids, cumulative_logprob=choice.cumulative_logprob,
                         finished=choice.finished)
    return None


def _finish_output(seq: Sequence, reason: FinishReason | None, *, error: str | None) -> SeqOutput:
    """A finish with no new token (rejected, or cut by the KV pool)."""
    return SeqOutput(request_id=seq.request_id, index=seq.index, new_token_ids=[],
                     cumulative_logprob=seq.cumulative_logprob,
                     finish_reason=None if reason is None else reason.value,
                     stop_reason=seq.stop_reason, error=error,
                     num_cached_tokens=seq.num_cached_tokens, num_prompt_tokens=seq.num_prompt_tokens)
