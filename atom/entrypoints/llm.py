"""The offline ``LLM`` API (vLLM-shaped): ``LLM(...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import atexit
import itertools
import time
import weakref
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from atom.config import EngineConfig
from atom.outputs import CompletionOutput, RequestMetrics, RequestOutput
from atom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom.engine.llm_engine import LLMEngine

PromptType = str | list[int] | dict[str, Any]

_live_llms: "weakref.WeakSet[LLM]" = weakref.WeakSet()


def build_engine(config: EngineConfig):
    """The front end's :class:`atom.engine.llm_engine.LLMEngine` for ``config``: one engine-core process
    (:class:`atom.engine.core_client.MPClient`), or with ``data_parallel_size > 1`` one per DP
    rank (:class:`atom.dp.dp_client.DPEngineCoreClient`);
    in the front end of a launched deployment, a client of the ranks the launcher started
    (:mod:`atom.entrypoints.launched`). Every front end (``LLM``, the CLI, the OpenAI server)
    builds its engine here.

    Raises:
        ValueError: invalid options or a model that cannot be loaded (found before any process
            starts: :func:`atom.engine.preflight.check_model_files`).
        EngineStartError: an engine core failed to start and said why (one line; a
            ``RuntimeError``).
        RuntimeError: an engine-core process died during start-up (exit code, stderr tail).
    """
    from atom.engine.llm_engine import LLMEngine

    from atom.entrypoints.launched import is_front_end, launched_client

    if is_front_end():  # rank 0's child under atom launch / torchrun: the ranks run already
        return LLMEngine(config, client_factory=launched_client)
    if config.data_parallel_size > 1:
        from atom.dp.dp_client import DPEngineCoreClient as client_class
    else:
        from atom.engine.core_client import MPClient as client_class
    return LLMEngine(config, client_factory=lambda config, extra_eos: client_class(
        config, extra_eos_token_ids=extra_eos))


@atexit.register
def _shutdown_all() -> None:
    for llm in list(_live_llms):
        llm.shutdown()


class LLM:
    """Generate text offline with one engine.

    The engine core (weights, KV cache, scheduler) runs in its own process, started here and
    stopped by :meth:`shutdown` (or the context manager, or at interpreter exit); this process
    tokenizes, detokenizes and matches stop strings. If that process dies, calls raise
    :class:`atom.engine.core_client.EngineDeadError` instead of hanging. (For the engine in
    this process, e.g. to look at its scheduler, use :class:`atom.engine.llm_engine.LLMEngine`.)

    Args:
        model: path of a .gguf file or a Hugging Face folder; None = the embedded
            SmolLM2-135M-Instruct.
        **engine_options: fields of :class:`atom.config.EngineConfig` (``max_model_len``,
            ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``, ``enable_prefix_caching``,
            ``enable_chunked_prefill``, ``dtype``, ``seed``, ``num_kv_blocks``, ...).
            ``data_parallel_size=N`` (> 1) starts N engine-core processes stepping in lockstep
            (:mod:`atom.dp`), with requests routed by ``dp_load_balance``.

    Raises:
        TypeError: an unknown option. ValueError: an invalid option value, or model files that
            cannot be loaded. FileNotFoundError: the model path does not exist.
        EngineStartError: an engine core failed to start and said why, in one line
            (:class:`atom.engine.liveness.EngineStartError`, a ``RuntimeError``).
        RuntimeError: an engine-core process died during start-up (its exit code and stderr
            tail).
    """

    def __init__(self, model: str | None = None, **engine_options: Any):
        self.config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.engine: LLMEngine | None = build_engine(self.config)
        self._counter = itertools.count()
        _live_llms.add(self)

    # ----- public API -----

    def get_tokenizer(self):
        return self._engine.tokenizer

    def get_stats(self) -> dict[str, int | float]:
        """num_free_blocks, num_total_blocks, num_running, num_waiting, num_preemptions,
        prefix_cache_queries, prefix_cache_hits (both in tokens), prefix_cache_hit_rate,
        num_aborted_seqs (client aborts), num_front_end_finished_seqs (ended by a stop string);
        with KV events kv_events_published_batches / kv_events_dropped_batches; with DP the
        router's dp_router_load and dp_router_decisions_<reason>, and with cache_aware the
        subscriber's kv_subscriber_* counters."""
        return self._engine.get_stats()

    def get_rank_stats(self) -> list[dict]:
        """Each DP rank's stats (those of :meth:`get_stats` plus tick, wave, dummy steps,
        collective count and hash, prefill policy counters, the router's counters for the
        rank; with EPLB or ``record_expert_load`` ``eplb_balancedness`` of the last closed
        window and ``eplb_num_windows``, with EPLB also ``eplb_num_rebalances``,
        the last rebalance's ``eplb_last_plan_ms`` and ``eplb_last_move_ms``); one rank:
        ``[get_stats()]``."""
        return self._engine.get_rank_stats()

    def get_expert_load(self):
        """EPLB (``enable_eplb``) or ``record_expert_load``: the tokens routed to each logical
        expert in the last closed window (``eplb_window_size`` ticks before the end of the last
        ``eplb_step_interval``), summed over the DP
        ranks: int64 numpy ``[MoE layers, experts]``, zeros before the first window closes.
        A recorded load for the simulator's skew model (``atom sim run --routing-load``, saved
        with ``numpy.save``). Raises ValueError when neither is on."""
        return self._engine.get_expert_load()

    def get_expert_placement(self):
        """EPLB (``enable_eplb``) or ``record_expert_load``: the current placement, the logical
        expert of each physical slot, int64 numpy ``[MoE layers, slots]`` (rank ``r`` owns the
        ``r``-th run of ``slots / DP size``). Raises ValueError when neither is on."""
        return self._engine.get_expert_placement()

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache of every rank, as vLLM's ``LLM.reset_prefix_cache``: the next
        prompts start cold (benchmarks that repeat a workload call it between runs). Returns
        False when a rank still had blocks in use (nothing is running between ``generate``
        calls, so it returns True there)."""
        return self._engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = False,
                 data_parallel_rank: int | list[int | None] | None = None,
                 session_id: str | list[str | None] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; returns one finished RequestOutput per prompt, in order.

        ``data_parallel_rank`` pins the DP rank of every prompt (an int) or of each prompt (a
        list, None entries routed by the policy); ignored with one rank. ``session_id`` names
        the conversation of every prompt (a str) or of each (a list, None: no session): with
        ``dp_load_balance="cache_aware"`` a session's requests stay on the rank holding its
        KV unless the load guard moves them.

        Prompts are strings, lists of token ids, or ``{"prompt_token_ids": [...]}`` /
        ``{"prompt": "..."}`` dicts. A bad prompt (empty, too long, not fitting the KV pool,
        ids outside the vocabulary, wrong type) yields an output with ``finish_reason="error"``
        and the others still complete.

        Raises:
            ValueError: a list of sampling params (or of ranks, or of session ids) whose length
                differs from the prompts', or a rank outside ``[0, data_parallel_size)``.
            TypeError: a session id that is not a string.
        """
        prompt_list = self._as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        ranks = self._as_rank_list(data_parallel_rank, len(prompt_list))
        sessions = _as_session_list(session_id, len(prompt_list))
        request_ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        for prompt, params, rank, session in zip(prompt_list, params_list, ranks, sessions):
            request_id = str(next(self._counter))
            request_ids.append(request_id)
            try:
                text, token_ids = self._tokenize_prompt(prompt)
            except (TypeError, ValueError) as exc:
                results[request_id] = _error_output(request_id, prompt, str(exc), params.n)
                continue
            self._engine.add_request(request_id, token_ids, params, prompt=text,
                                     data_parallel_rank=rank, session_id=session)
        self._run(results, len(request_ids), use_tqdm)
        return [results[rid] for rid in request_ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             use_tqdm: bool = False, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
                   for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the output text of one prompt piece by piece, as the engine generates it.

        The pieces concatenate to the final text (stop strings cut, as in ``generate``). Closing
        the iterator early aborts the request and frees its KV blocks: ``break`` (or Ctrl-C) in
        a ``for`` loop over ``llm.stream(...)`` itself does, since nothing else holds the
        iterator; one kept in a variable must be closed (``it.close()``, or ``with
        contextlib.closing(llm.stream(...)) as it:``), and until then its request stays in the
        engine and another ``stream()`` is refused.

        Raises:
            ValueError: ``n > 1``, a prompt that cannot run (its error message), or no tokenizer.
            RuntimeError: other requests are in flight on this LLM (one stream at a time).
        """
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"stream() returns one choice: use n=1, not n={params.n}")
        engine = self._engine
        self._require_tokenizer()
        if engine.has_unfinished_requests():
            raise RuntimeError("stream() needs the engine to itself: finish other requests first")
        text, token_ids = self._tokenize_prompt(prompt)
        request_id = str(next(self._counter))
        engine.add_request(request_id, token_ids, params, prompt=text)
        num_sent = 0
        finished = False
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id != request_id:
                        continue
                    completion, finished = out.outputs[0], out.finished
                    if completion.finish_reason == "error":
                        raise ValueError(completion.error)
                    if len(completion.text) > num_sent:
                        yield completion.text[num_sent:]
                        num_sent = len(completion.text)
        finally:
            if not finished and self.engine is engine and engine.client_is_alive():
                engine.abort_request(request_id)
                engine.step()  # collect the abort's output so the engine is idle again

    def apply_chat_template(self, conversation: list[dict[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        tokenizer = self._require_tokenizer()
        return tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    def shutdown(self) -> None:
        """Stop the engine-core process and release the engine (idempotent)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----- helpers -----

    @property
    def _engine(self):
        if self.engine is None:
            raise RuntimeError("this LLM was shut down; create a new one")
        return self.engine

    def _require_tokenizer(self):
        tokenizer = self._engine.tokenizer
        if tokenizer is None:
            raise ValueError("this LLM was built with skip_tokenizer_init=True: pass token ids")
        return tokenizer

    def _tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _as_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            ids = self._require_tokenizer().encode(prompt, add_special_tokens=False)
            return prompt, list(ids)
        return None, _as_token_ids(prompt)

    @staticmethod
    def _as_prompt_list(prompts: Any) -> list[Any]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)

    def _as_rank_list(self, ranks: Any, num_prompts: int) -> list[int | None]:
        if self.config.data_parallel_size == 1 or ranks is None:
            return [None] * num_prompts
        ranks = [ranks] * num_prompts if isinstance(ranks, int) else list(ranks)
        if len(ranks) != num_prompts:
            raise ValueError(f"got {len(ranks)} data_parallel_rank values for {num_prompts} prompts")
        for r in ranks:
            if r is not None and (isinstance(r, bool) or not isinstance(r, int)
                                  or not 0 <= r < self.config.data_parallel_size):
                raise ValueError(f"data_parallel_rank={r!r} is outside "
                                 f"[0, {self.config.data_parallel_size})")
        return ranks

    @staticmethod
    def _as_params_list(params: Any, num_prompts: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * num_prompts
        params = list(params)
        if len(params) != num_prompts:
            raise ValueError(f"got {len(params)} sampling params for {num_prompts} prompts: pass "
                             f"one SamplingParams or one per prompt")
        return params

    def _run(self, results: dict[str, RequestOutput], num_requests: int, use_tqdm: bool) -> None:
        bar = tqdm(total=num_requests, desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm, initial=len(results))
        start = time.perf_counter()
        num_prompt_tokens = num_output_tokens = 0
        while len(results) < num_requests:
            for out in self._engine.step():
                if out.finished:
                    results[out.request_id] = out
                    num_prompt_tokens += len(out.prompt_token_ids)
                    num_output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    elapsed_s = time.perf_counter() - start
                    bar.update(1)
                    bar.set_postfix_str(f"input {num_prompt_tokens / elapsed_s:.1f} tok/s, "
                                        f"output {num_output_tokens / elapsed_s:.1f} tok/s")
        bar.close()


def _as_session_list(session_id: Any, num_prompts: int) -> list[str | None]:
    sessions = ([session_id] * num_prompts if session_id is None or isinstance(session_id, str)
                else list(session_id))
    if len(sessions) != num_prompts:
        raise ValueError(f"got {len(sessions)} session_id values for {num_prompts} prompts")
    bad = [s for s in sessions if s is not None and not isinstance(s, str)]
    if bad:
        raise TypeError(f"a session_id must be a str (or None), got {bad[0]!r}")
    return sessions


def _as_token_ids(value: Any) -> list[int]:
    if not isinstance(value, SequenceABC) or isinstance(value, str) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict; got {type(value).__name__}")
    return list(value)


def _error_output(request_id: str, prompt: Any, message: str, n: int) -> RequestOutput:
    outputs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error", error=message)
               for i in range(n)]
    return RequestOutput(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                         prompt_token_ids=[], outputs=outputs, finished=True,
                         metrics=RequestMetrics(arrival_time_s=time.monotonic()))
