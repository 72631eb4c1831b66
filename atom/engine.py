"""LLMEngine: one rank's engine — tokenizer, scheduler, block manager, model runner, sampler.

``step()`` runs one scheduler tick: schedule → forward → sample → postprocess → detokenize and
match stop strings → outputs. It is synchronous and single-threaded; the EngineCore process and
the data-parallel loop drive it from outside.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from atom.block_manager import BlockManager
from atom.config import EngineConfig
from atom.detokenizer import IncrementalDetokenizer
from atom.outputs import CompletionOutput, RequestMetrics, RequestOutput
from atom.sampler import Sampler, top_logprobs
from atom.sampling_params import SamplingParams
from atom.scheduler import PrefillGate, Scheduler, SchedulerConfig, SchedulerOutput
from atom.sequence import FinishReason, Sequence

logger = logging.getLogger(__name__)

_MAX_DEFAULT_MODEL_LEN = 8192


@dataclass(frozen=True)
class EngineRuntime:
    """Values found at start-up (not user settings)."""

    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_cache_bytes: int


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer | None]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_done: int = 0
    errors: list[str | None] = field(default_factory=list)


class LLMEngine:
    """Runs requests to completion on one rank.

    Args:
        config: engine options.
        prefill_gate: the scheduler's prefill gate (the DP PrefillDelayer plugs in here).

    Raises:
        ValueError: invalid options or a model that cannot be loaded.
    """

    def __init__(self, config: EngineConfig, *, prefill_gate: PrefillGate | None = None):
        from atom.model_loader import load_model_weights, load_tokenizer
        from atom.model_runner import ModelRunner

        self.config = config
        torch.set_num_threads(config.resolved_num_threads())
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[config.resolved_dtype()]
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model)
        arch, weights = load_model_weights(config.model, dtype)
        max_model_len = config.max_model_len or min(arch.max_position_embeddings, _MAX_DEFAULT_MODEL_LEN)
        bytes_per_block = ModelRunner.kv_cache_bytes_per_block(arch, dtype=dtype, block_size=config.block_size)
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory // bytes_per_block)
        if num_blocks * config.block_size < max_model_len:
            logger.warning("KV pool holds %d tokens, fewer than max_model_len=%d: long sequences "
                           "will be preempted or cut", num_blocks * config.block_size, max_model_len)
        self.runner = ModelRunner(arch, weights, dtype=dtype, num_kv_blocks=num_blocks,
                                  block_size=config.block_size, max_model_len=max_model_len)
        eos = set(arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.runtime = EngineRuntime(num_kv_blocks=num_blocks, max_model_len=max_model_len,
                                     vocab_size=arch.vocab_size, eos_token_ids=tuple(sorted(eos)),
                                     kv_cache_bytes=num_blocks * bytes_per_block)
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=max_model_len,
                            enable_chunked_prefill=config.enable_chunked_prefill),
            self.block_manager, eos_token_ids=self.runtime.eos_token_ids, prefill_gate=prefill_gate)
        self.sampler = Sampler(self.runtime.eos_token_ids, seed=config.seed)
        self._requests: dict[str, _RequestState] = {}
        self._pending_outputs: list[RequestOutput] = []
        logger.info("engine ready: %s, dtype %s, %d KV blocks x %d tokens (%.1f MiB), max_model_len %d",
                    config.model or "embedded SmolLM2-135M-Instruct", config.resolved_dtype(), num_blocks,
                    config.block_size, self.runtime.kv_cache_bytes / 2**20, max_model_len)

    # ----- requests -----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time_s: float | None = None) -> None:
        """Queue a request; one that can never run is finished at once with ``error``.

        Raises:
            ValueError: ``request_id`` is already in use.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running; use a unique id")
        arrival = time.monotonic() if arrival_time_s is None else arrival_time_s
        error = self._validate(prompt_token_ids, params)
        seqs = [Sequence(request_id, list(prompt_token_ids), params, index=i, arrival_time_s=arrival)
                for i in range(params.n)]
        state = _RequestState(request_id, prompt, seqs, [self._detokenizer(params) for _ in seqs],
                              RequestMetrics(arrival_time_s=arrival),
                              prompt_logprobs=([None] * len(prompt_token_ids)
                                               if params.prompt_logprobs is not None else None))
        self._requests[request_id] = state
        for seq in seqs:
            if error is not None:
                self.scheduler._finish(seq, FinishReason.ERROR, error_message=error)
            else:
                self.scheduler.add(seq)
        if all(seq.is_finished for seq in seqs):
            self._pending_outputs.append(self._finish_request(state))

    def _validate(self, token_ids: list[int], params: SamplingParams) -> str | None:
        vocab = self.runtime.vocab_size
        for what, ids in (("prompt token ids", token_ids), ("stop_token_ids", params.stop_token_ids),
                          ("logit_bias token ids", list(params.logit_bias))):
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
            if bad:
                return f"{what} {bad[:5]} are outside the vocabulary [0, {vocab})"
        if params.stop and self.tokenizer is None:
            return "stop strings need the tokenizer (skip_tokenizer_init=True): use stop_token_ids"
        return None

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer.backend_tokenizer, stop=params.stop,
                                      include_stop_str_in_output=params.include_stop_str_in_output,
                                      skip_special_tokens=params.skip_special_tokens,
                                      min_tokens=params.min_tokens)

    def abort_request(self, request_id: str) -> None:
        """Abort a request; its KV blocks are freed now. Unknown ids are ignored."""
        state = self._requests.get(request_id)
        if state is None:
            return
        self.scheduler.abort(request_id)
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
        self._pending_outputs.append(self._finish_request(state))

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._pending_outputs)

    # ----- the step -----

    def step(self) -> list[RequestOutput]:
        """Run one tick; returns the requests that changed (finished ones last seen here)."""
        outputs, self._pending_outputs = self._pending_outputs, []
        sched = self.scheduler.schedule()
        touched = self._finish_preempted_out(sched)
        if not sched.is_empty:
            touched |= self._execute(sched)
        for request_id in touched:
            state = self._requests.get(request_id)
            if state is None:
                continue
            if all(seq.is_finished for seq in state.seqs):
                outputs.append(self._finish_request(state))
            else:
                outputs.append(self._make_output(state, finished=False))
        return outputs

    def _finish_preempted_out(self, sched: SchedulerOutput) -> set[str]:
        return {seq.request_id for seq in sched.preempted if seq.is_finished}

    def _execute(self, sched: SchedulerOutput) -> set[str]:
        model_out = self.runner.execute_model(sched.scheduled)
        by_id = {seq.seq_id: seq for seq, _ in sched.scheduled}
        sampled_seqs = [by_id[i] for i in model_out.sampled_seq_ids]
        self._record_prompt_logprobs(model_out.prompt_logits, by_id)
        sampled = self.sampler(model_out.logits, sampled_seqs) if sampled_seqs else None
        token_map = dict(zip(model_out.sampled_seq_ids, sampled.token_ids)) if sampled else {}
        updated = self.scheduler.postprocess(sched, token_map)
        now = time.monotonic()
        touched: set[str] = set()
        for row, seq in enumerate(sampled_seqs):
            state = self._requests[seq.request_id]
            touched.add(seq.request_id)
            if state.metrics.first_token_time_s is None:
                state.metrics.first_token_time_s = now
            if sampled.logprobs[row] is not None:
                seq.output_logprobs.append(sampled.logprobs[row])
            seq.cumulative_logprob += sampled.sampled_logprobs[row]
            if seq in updated:
                self._detokenize(seq, state.detokenizers[seq.index])
            if seq.is_finished:
                self.sampler.release(seq.seq_id)
        return touched

    def _detokenize(self, seq: Sequence, detok: IncrementalDetokenizer | None) -> None:
        """Add ``seq``'s new token to its text; a completed stop string ends ``seq`` here.

        The scheduler has already run its token stop checks: a STOP it set means EOS or a stop
        token id, whose text is left out unless include_stop_str_in_output (vLLM). A stop
        string found here finishes the sequence at once (its KV blocks are freed now); on the
        token that also hit max_tokens, the stop string wins (vLLM checks it last, too).
        """
        if detok is None:
            return
        if seq.finish_reason is FinishReason.STOP and not seq.sampling_params.include_stop_str_in_output:
            return
        stop = detok.add_token(seq.token_ids[-1])
        if stop is None:
            return
        if not seq.is_finished:
            self.scheduler.finish(seq, FinishReason.STOP, stop_reason=stop)
        else:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop

    def _record_prompt_logprobs(self, prompt_logits: dict[int, torch.Tensor], by_id: dict[int, Sequence]) -> None:
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

    # ----- outputs -----

    def _make_output(self, state: _RequestState, *, finished: bool) -> RequestOutput:
        completions = []
        for seq, detok in zip(state.seqs, state.detokenizers):
            text = "" if detok is None else (detok.text if seq.is_finished else detok.safe_text())
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob, error=seq.error_message))
        first = state.seqs[0]
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=list(first.prompt_token_ids), outputs=completions,
                             finished=finished, num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=(None if state.prompt_logprobs is None
                                              else list(state.prompt_logprobs)),
                             metrics=state.metrics)

    def _finish_request(self, state: _RequestState) -> RequestOutput:
        self._requests.pop(state.request_id, None)
        state.metrics.finished_time_s = time.monotonic()
        state.metrics.num_output_tokens = max(seq.num_output_tokens for seq in state.seqs)
        for seq in state.seqs:
            self.sampler.release(seq.seq_id)
        return self._make_output(state, finished=True)

    # ----- stats -----

    def get_stats(self) -> dict[str, int]:
        """Counters of the KV pool, queues and prefix cache (cache counters in tokens)."""
        bm = self.block_manager
        return {
            "num_free_blocks": bm.num_free_blocks,
            "num_total_blocks": bm.num_blocks,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
        }
