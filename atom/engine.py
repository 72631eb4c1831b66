"""LLMEngine: one rank's engine as the front end sees it — tokenizer, output side, engine core.

A thin composition (vLLM v1's shape): the :class:`~atom.output_processor.OutputProcessor` keeps
per-request text and outputs, and an engine core runs the token ids, either

- in this process (default): an :class:`~atom.engine_core.EngineCore` stepped by ``step()``
  itself — what tests that look inside (``scheduler``, ``block_manager``, ``runner``) use, and
  where a ``prefill_gate`` can be plugged in; or
- in its own process (``multiprocess=True``, what :class:`atom.LLM` uses): an
  :class:`~atom.engine_core_client.EngineCoreClient`, whose core steps on its own while
  ``step()`` collects what it produced.

Both speak the same small client interface (``add_request``, ``abort``, ``finish``,
``get_outputs``, ``call_utility``, ``is_alive``, ``shutdown``), so the front-end logic is one code path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from atom.config import EngineConfig
from atom.engine_core import EngineCore, EngineRuntime, check_token_ids
from atom.messages import EngineCoreRequest, SamplingParamsMsg, SeqOutput
from atom.output_processor import OutputProcessor
from atom.outputs import RequestOutput
from atom.sampling_params import SamplingParams
from atom.scheduler import PrefillGate

__all__ = ["EngineRuntime", "LLMEngine"]

_STEP_WAIT_S = 1.0  # multiprocess step(): the longest it waits for the core before returning []


def tokenizer_eos_token_ids(tokenizer) -> tuple[int, ...]:
    """The EOS ids a tokenizer adds to the model config's (the engine core has no tokenizer):
    its ``eos_token_id``, if any; ``()`` for ``None`` (``skip_tokenizer_init``)."""
    if tokenizer is None or tokenizer.eos_token_id is None:
        return ()
    return (tokenizer.eos_token_id,)


class InprocClient:
    """The client interface over an :class:`EngineCore` in this process (``get_outputs`` runs
    one step)."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.runtime = core.runtime

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def finish(self, seq_keys: list[tuple[str, int]], stop_reasons: list[str]) -> None:
        self.core.finish_requests(seq_keys, stop_reasons)

    def get_outputs(self, timeout_s: float | None = None) -> list[SeqOutput]:
        return self.core.step_fn() if self.core.has_work() else []

    def call_utility(self, method: str) -> dict:
        return self.core.call_utility(method)

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class LLMEngine:
    """Runs requests to completion on one rank.

    Args:
        config: engine options.
        prefill_gate: the scheduler's prefill gate (the DP PrefillDelayer plugs in here);
            in-process only.
        multiprocess: run the engine core in its own process (see the module docstring).
        client_factory: ``(config, extra_eos_token_ids) -> client`` building another client
            with the same interface (the DP front end passes ``DPEngineCoreClient`` here).

    Raises:
        ValueError: invalid options, a model that cannot be loaded, or a prefill gate with
            ``multiprocess``.
        RuntimeError: the engine-core process failed to start (multiprocess).
    """

    def __init__(self, config: EngineConfig, *, prefill_gate: PrefillGate | None = None,
                 multiprocess: bool = False,
                 client_factory: Callable[[EngineConfig, tuple[int, ...]], Any] | None = None):
        from atom.model_loader import load_tokenizer

        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model)
        # The core has no tokenizer: the tokenizer's EOS id travels to it from here.
        extra_eos = tokenizer_eos_token_ids(self.tokenizer)
        self.core: EngineCore | None = None
        if client_factory is not None:
            # e.g. the DP client (atom.dp.dp_client), built by the entrypoints: the engine never
            # imports atom.dp
            if prefill_gate is not None:
                raise ValueError("a prefill_gate needs the in-process engine core")
            self.client = client_factory(config, extra_eos)
        elif config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size} needs the DP client: "
                             f"use atom.LLM (or pass client_factory)")
        elif multiprocess:
            if prefill_gate is not None:
                raise ValueError("a prefill_gate needs the in-process engine core (multiprocess=False)")
            from atom.engine_core_client import EngineCoreClient

            self.client = EngineCoreClient(config, extra_eos_token_ids=extra_eos)
        else:
            self.core = EngineCore(config, prefill_gate=prefill_gate, extra_eos_token_ids=extra_eos)
            self.client = InprocClient(self.core)
        self.runtime: EngineRuntime = self.client.runtime
        self.output_processor = OutputProcessor(self.tokenizer)
        self._pending: list[RequestOutput] = []  # finished here, not by a core step

    # ----- in-process internals (tests, the DP loop) -----

    def _local_core(self) -> EngineCore:
        if self.core is None:
            raise RuntimeError("the engine core runs in another process (multiprocess=True): "
                               "use get_stats()")
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
                    data_parallel_rank: int | None = None) -> None:
        """Queue a request; one that can never run is finished with ``error`` (its output comes
        from the next ``step()``).

        ``data_parallel_rank`` pins the DP rank (DP client only; ignored with one rank).

        Raises:
            ValueError: ``request_id`` is already in use, or a bad ``data_parallel_rank``.
        """
        arrival = time.monotonic() if arrival_time_s is None else arrival_time_s
        rejected = self.output_processor.add_request(request_id, prompt_token_ids, params,
                                                     prompt=prompt, arrival_time_s=arrival)
        if rejected is not None:
            self._pending.append(rejected)
            return
        # checked here too (the core checks again): an id past 64 bits would not even encode
        error = check_token_ids(prompt_token_ids, params.stop_token_ids, list(params.logit_bias),
                                vocab_size=self.runtime.vocab_size)
        if error is None:
            try:
                request = EngineCoreRequest(request_id, list(prompt_token_ids),
                                            SamplingParamsMsg.from_params(params), arrival)
                if data_parallel_rank is None:
                    self.client.add_request(request)
                else:
                    self.client.add_request(request, data_parallel_rank=data_parallel_rank)
                return
            except (OverflowError, TypeError, msgspec.EncodeError) as exc:  # not msgpack-able
                error = f"the request cannot be encoded: {exc}"
        self._pending.append(self.output_processor.fail_request(request_id, error))

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
        from outside the core (``num_aborted_seqs``, ``num_front_end_finished_seqs``)."""
        return self.client.call_utility("get_stats")

    def client_is_alive(self) -> bool:
        """False once the engine-core process has exited (always True in-process)."""
        return self.client.is_alive()

    def shutdown(self) -> None:
        """Stop the engine-core process, if any (idempotent)."""
        self.client.shutdown()
