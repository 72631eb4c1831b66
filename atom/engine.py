"""LLMEngine: one deployment's engine as the front end sees it — tokenizer, output side, client.

A thin composition (vLLM v1's shape): the :class:`~atom.output_processor.OutputProcessor` keeps
per-request text and outputs, and an :class:`~atom.engine_core_client.EngineCoreClient` runs
the token ids:

- by default an :class:`~atom.engine_core_client.InprocClient` over an
  :class:`~atom.engine_core.EngineCore` in this process, stepped by ``step()`` itself (what tests
  that look inside: ``scheduler``, ``block_manager``, ``runner``, use);
- or whatever ``client_factory`` builds: the entrypoints
  (:func:`atom.entrypoints.llm.build_engine`) pass an :class:`~atom.engine_core_client.MPClient`
  (one engine-core process) or the DP client, whose cores step on their own while ``step()``
  collects what they produced.

Every client speaks the one interface, so the front-end logic is one code path.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from atom.config import EngineConfig
from atom.engine_core_client import EngineCoreClient, InprocClient
from atom.messages import EngineCoreRequest, EngineRuntime
from atom.output_processor import OutputProcessor
from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams

__all__ = ["LLMEngine"]

_STEP_WAIT_S = 1.0  # multiprocess step(): the longest it waits for the core before returning []


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
            :class:`~atom.engine_core_client.InprocClient` over an engine core in this process
            (see the module docstring). The engine never imports ``atom.dp``: the entrypoints
            pass the DP client's factory.

    Raises:
        ValueError: invalid options, a model that cannot be loaded, or
            ``data_parallel_size > 1`` without a ``client_factory``.
        RuntimeError: an engine-core process failed to start.
    """

    def __init__(self, config: EngineConfig, *,
                 client_factory: Callable[[EngineConfig, tuple[int, ...]], EngineCoreClient]
                 | None = None):
        from atom.model_loader import load_tokenizer

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
            from atom.engine_core import EngineCore

            self.core = EngineCore(config, extra_eos_token_ids=extra_eos)
            self.client = InprocClient(self.core)
        self.runtime: EngineRuntime = self.client.runtime
        self.output_processor = OutputProcessor(self.tokenizer)
        self._pending: list[RequestOutput] = []  # finished here, not by a core step

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
    def runner(self):
        return self._local_core().runner

    @property
    def sampler(self):
        return self._local_core().sampler

    # ----- requests -----

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prompt: str | None = None, arrival_time_s: float | None = None,
                    data_parallel_rank: int | None = None, session_id: str | None = None,
                    arrival_tick: int | None = None) -> None:
        """Queue a request; one that can never run is finished with ``error`` (its output comes
        from the next ``step()``).

        ``data_parallel_rank`` pins the DP rank; ``session_id`` names the conversation the
        request belongs to (the DP router keeps a session on its rank; it never reaches the
        core); both are ignored with one rank. ``arrival_tick`` (tick-clocked replay, DP only)
        makes the request's rank hold it until that tick of the wave (the ticks of a replay
        count from its wave's first tick; send every request of a replay before the first
        ``step()``: ``atom.dp.engine_core_proc``). The token ids are
        checked by the core (a request it cannot run finishes with ``error``); one that msgpack
        cannot even carry (an id past 64 bits) fails here.

        Raises:
            ValueError: ``request_id`` is already in use, a bad ``data_parallel_rank``, or
                ``arrival_tick`` with one rank or below 0.
        """
        if arrival_tick is not None and (self.config.data_parallel_size == 1 or arrival_tick < 0):
            raise ValueError(f"arrival_tick={arrival_tick}: tick-clocked arrivals need "
                             f"data_parallel_size > 1 (the DP ranks hold them) and a tick >= 0")
        arrival = time.monotonic() if arrival_time_s is None else arrival_time_s
        rejected = self.output_processor.add_request(request_id, prompt_token_ids, params,
                                                     prompt=prompt, arrival_time_s=arrival)
        if rejected is not None:
            self._pending.append(rejected)
            return
        request = EngineCoreRequest(request_id, list(prompt_token_ids), params, arrival,
                                    arrival_tick=arrival_tick)
        try:
            self.client.add_request(request, data_parallel_rank=data_parallel_rank,
                                    session_id=session_id)
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:  # not msgpack-able
            self._pending.append(self.output_processor.fail_request(
                request_id, f"the request cannot be encoded: {exc}"))

    def abort_request(self, request_id: str) -> None:
        """Abort a request: its final output (``abort``) comes from the next ``step()`` and the
        core frees its KV blocks. Unknown ids are ignored."""
        out = self.output_processor.abort_request(request_id)
        if out is None:
            return
        self.client.abort([request_id])
        self._pending.append(out)

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
        seq_outputs = self.client.get_outputs(timeout_s=0.0 if outputs else _STEP_WAIT_S)
        processed = self.output_processor.process_outputs(seq_outputs)
        # a stop string ended these sequences: free their KV before the core's next tick
        self.client.finish(processed.finish_seq_keys, processed.stop_reasons)
        return outputs + processed.request_outputs

    # ----- stats, lifecycle -----

    def get_stats(self) -> dict[str, int]:
        """Counters of the KV pool, queues, prefix cache (cache counters in tokens) and finishes
        from outside the core (``num_aborted_seqs``, ``num_front_end_finished_seqs``), summed
        over DP ranks."""
        return self.client.get_stats()

    def get_rank_stats(self) -> list[dict]:
        """Each DP rank's stats (one rank: ``[get_stats()]``)."""
        return self.client.get_rank_stats()

    def front_end_stats(self) -> dict:
        """Counters of the front end that belong to no rank (the DP client's KV event
        subscriber: ``kv_subscriber_*``); ``{}`` otherwise."""
        return self.client.front_end_stats()

    def client_is_alive(self) -> bool:
        """False once the engine-core process has exited (always True in-process)."""
        return self.client.is_alive()

    def shutdown(self) -> None:
        """Stop the engine-core process, if any (idempotent)."""
        self.client.shutdown()
