"""Engine configuration: frozen dataclasses, one default per field, the CLI generated from them.

Values found at run time (number of KV blocks, EOS ids) are not here: they live in
:class:`atom.messages.EngineRuntime`. Every setting is validated here, once (``__post_init__``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

_DTYPES = ("auto", "bfloat16", "float32")
QUANTIZATIONS = ("gguf",)
MAX_DEFAULT_MODEL_LEN = 8192  # max_model_len=None caps the model's context length here
DP_LOAD_BALANCE_POLICIES = ("least_requests", "round_robin", "cache_aware")
# where the ranks publish KV events when cache_aware routing needs them and no endpoint is set:
# loopback, OS-chosen ports (each rank reports its bound endpoints in its ready message)
PRIVATE_KV_EVENTS_ENDPOINT = "tcp://127.0.0.1:0"
PREFILL_POLICIES = ("delayer", "coalescer", "none")
ON_RANK_FAILURE = ("shrink", "replace", "stop")
SPECULATIVE_METHODS = ("ngram", "draft", "mtp")
KV_ROLES = ("producer", "consumer")
MIN_ENGINE_HANG_TIMEOUT_S = 2.0  # heartbeats come every timeout / 5 s, at most 1 s apart
# options that were replaced: the old name fails with a message that says what to use
_REPLACED_OPTIONS = {
    "prefill_delayer": "use prefill_policy='delayer' or 'none' "
                       "(--prefill-policy delayer|none)",
}
#: vLLM's options that atom spells otherwise or does not have: option name -> (vLLM's short
#: flag or None, what to use in atom). Each is a one-line usage error naming the atom spelling,
#: on the command line and as an ``LLM(...)`` / ``EngineConfig.from_kwargs`` keyword.
VLLM_OPTION_HINTS = {
    "data_parallel_size": ("-dp", "atom spells it --data-parallel-size N (data_parallel_size)"),
    "tensor_parallel_size": ("-tp", "atom has no tensor parallelism: scale with "
                                    "--data-parallel-size N (data_parallel_size), and shard an "
                                    "MoE's experts over the ranks with --enable-expert-parallel"),
    "pipeline_parallel_size": ("-pp", "atom has no pipeline parallelism: scale with "
                                      "--data-parallel-size N (data_parallel_size)"),
    "num_redundant_experts": (None, "atom spells it --eplb-num-redundant-experts N "
                                    "(eplb_num_redundant_experts), with --enable-eplb"),
    "eplb_config": (None, "atom's EPLB settings are options of their own: "
                          "--eplb-window-size, --eplb-step-interval, "
                          "--eplb-num-redundant-experts, --eplb-min-balancedness (eplb_*), "
                          "with --enable-eplb"),
    "enable_dbo": (None, "atom's two-batch overlap is --enable-tbo (enable_tbo), with "
                         "--enable-expert-parallel"),
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything a user sets to build an engine (vLLM's option names where one exists)."""

    model: str | None = None
    """Path of a .gguf file or a Hugging Face folder; None = embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """Run dtype of weights, activations and KV cache: bfloat16, float32, or auto = bfloat16 when
    the CPU has native bf16 matmuls (AVX512-BF16 or AMX), else float32 (bf16 matmuls are 6-9x
    slower than fp32 on an AVX2-only CPU)."""
    quantization: str | None = None
    """gguf = keep a GGUF model's Q4_1 / Q8_0 blocks and run steps of at most 16 rows (tokens;
    sampled rows for the LM head) on them with int8 kernels: about 4x less memory read per
    decode token. Larger steps keep the float GEMMs (their float weights stay loaded). Runs in
    float32; GGUF models only. None = dequantize at load (the float path)."""
    max_model_len: int | None = None
    """Max tokens (prompt + output) per sequence; None = the model's context length, capped at 8192."""
    max_num_seqs: int = 256
    """Max sequences running in one step (batch size)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    block_size: int = 16
    """Tokens per KV block."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full prompt blocks computed earlier."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps to fit the token budget."""
    num_kv_blocks: int | None = None
    """KV pool size in blocks; wins over kv_cache_memory_bytes."""
    kv_cache_memory_bytes: int = 2 * 1024**3
    """KV pool budget in bytes, used when num_kv_blocks is None (default 2 GiB)."""
    seed: int = 0
    """Seed of the sampling generators of unseeded requests: each DP rank's stream is derived
    from it and the rank, so ranks never share one (requests may bring their own seed)."""
    skip_tokenizer_init: bool = False
    """Do not load a tokenizer: prompts must be token ids and outputs carry no text."""
    num_threads: int | None = None
    """Torch intra-op threads per engine core; None = OMP_NUM_THREADS when set (a launcher's
    share), else the cores available divided among the engine cores of this node."""
    data_parallel_size: int = 1
    """Number of data-parallel ranks (one EngineCore process each, stepping in lockstep)."""
    dp_load_balance: str = "least_requests"
    """DP router policy: least_requests (fewest unfinished requests, ties rotate), round_robin,
    or cache_aware (the rank holding the longest cached prefix of the prompt, from the KV
    events; else the rank of the request's session; else the least loaded; always behind the
    load guard). cache_aware turns KV events on, on private loopback ports, when
    kv_events_endpoint is not set."""
    dp_load_guard_abs_threshold: int = 2
    """cache_aware load guard: a preferred rank is given up for the least-loaded one when its
    unfinished requests exceed the least-loaded rank's by more than this many requests ..."""
    dp_load_guard_rel_threshold: float = 1.5
    """... and are more than this many times the least-loaded rank's (both must hold, as in
    SGLang's router: absolute at low load, relative at high load)."""
    dp_cache_aware_min_match_ratio: float = 0.5
    """cache_aware: a rank's cached prefix counts as a hit only when it covers at least this
    fraction of the prompt's full blocks (a shared system prompt alone does not pull every
    request to the rank that saw it first; SGLang's cache_threshold)."""
    prefill_policy: str | None = None
    """Cross-rank prefill policy (data parallelism): delayer (hold prefills while only some of
    the ranks with pending prefill work can admit one), coalescer (also hold until the
    admittable prompt tokens summed over the ranks fill a worthwhile step) or none; None =
    delayer when data_parallel_size > 1."""
    prefill_delayer_max_delay_passes: int = 30
    """Delayer: most consecutive ticks a prefill hold may last before prefills are allowed."""
    prefill_delayer_kv_low_watermark: float | None = None
    """Delayer: KV usage fraction in (0, 1): a ready rank below it releases a hold; None = off."""
    prefill_coalescer_target_fill: float = 0.7
    """Coalescer: fire once the admittable prefill tokens summed over the ranks reach this
    fraction of (token budget x ranks with pending prefill work); in (0, 1] (ATOM #1611's
    default)."""
    prefill_coalescer_ttft_max_ticks: int = 30
    """Coalescer: most consecutive ticks any hold lasts (every request it holds has waited that
    long for it), then fire."""
    prefill_coalescer_partial_max_ticks: int = 8
    """Coalescer: most consecutive held ticks while some rank has a partial prefill (it holds
    KV blocks while it waits)."""
    prefill_coalescer_stall_ticks: int = 3
    """Coalescer: give up holding for fill after this many ticks without growth in the summed
    prefill tokens."""
    prefill_coalescer_kv_high_watermark: float = 0.9
    """Coalescer: fire when a ready rank's KV usage fraction reaches this (waiting cannot grow
    the batch when the pool is nearly full); in (0, 1]."""
    prefill_coalescer_max_queue_ticks: int | None = None
    """Coalescer: also fire once a ready rank's oldest waiting request has been queued this many
    ticks, backlog included (a latency guard: under a backlog it fires every tick); None = off."""
    prefill_decode_interval: int = 0
    """Decode protection: after a tick in which any rank prefilled, hold every prefill for this
    many ticks while some rank has running decodes (composes with any policy); 0 = off."""
    dp_trace: str | None = None
    """Folder for the per-tick DP trace: every rank writes one row per tick to
    dp<rank>.jsonl there (scripts/dp_trace.py turns them into Perfetto JSON and a PNG);
    None = off."""
    kv_events_endpoint: str | None = None
    """Publish KV cache events (vLLM 0.32's wire) on this ZMQ PUB endpoint, the TCP port offset
    by DP rank (tcp://127.0.0.1:5557; tcp://*:5557 to leave the host; port 0 = OS-chosen);
    None = off (unless cache_aware routing needs them)."""
    kv_events_replay_endpoint: str | None = None
    """ROUTER endpoint that replays buffered batches from a seq (port offset by DP rank);
    None = no replay (a subscriber cannot heal gaps)."""
    kv_events_topic: str = ""
    """First frame of every KV events message (subscribers filter on its prefix)."""
    kv_events_buffer_size: int = 10_000
    """Batches (one per step) kept for replay (vLLM's buffer_steps)."""
    kv_events_max_queue_size: int = 10_000
    """Batches waiting for the publisher thread before the oldest is dropped (and counted)."""
    kv_events_hwm: int = 100_000
    """PUB send (and the DP router's SUB receive) high-water mark, in messages (vLLM's)."""
    dp_group_timeout_s: float = 600.0
    """Seconds a DP collective (and the rendezvous) may wait for its peers before it fails:
    a rank that never shows up, or stops in the middle of a tick, fails the others after this
    long instead of hanging them (gloo's and NCCL's default is 10 minutes too)."""
    engine_hang_timeout_s: float = 10.0
    """Seconds without a heartbeat from an engine-core process after which the front end
    declares it hung (a stopped process, or one frozen in native code holding the GIL). The
    heartbeat comes from a thread of its own, every second, so a long but progressing step
    (torch and atom's kernels release the GIL) never trips it: 10 s is ten missed beats,
    however long the step (tests/engine/test_liveness.py runs a forward longer than the
    timeout). Well under dp_group_timeout_s: a hung rank is found long before the collectives
    waiting for it would fail."""
    on_rank_failure: str = "shrink"
    """What the front end does when an engine-core process it started dies or hangs: shrink
    (start a fresh group without the lost rank: it needs nothing the failure may have taken,
    such as that rank's device, and repeated failures converge), replace (a fresh group of
    the same size: full capacity back, but a rank whose slot is broken fails again) or stop
    (fail every in-flight request and stay down: 503). Under atom launch the launcher's
    --max-restarts decides instead."""
    resume_on_rank_failure: bool = True
    """After a rank failure, continue every in-flight request on the new group from its prompt
    plus the tokens already streamed (greedy text is that of an undisturbed run); off: they end
    with finish_reason="error"."""
    enable_expert_parallel: bool = False
    """Shard the experts of MoE layers across the DP ranks (tokens travel to the ranks owning
    their experts and back inside every forward); needs an MoE model."""
    enable_eplb: bool = False
    """Expert-parallel load balancing (atom.dp.eplb): count the tokens routed to each expert
    over a window of ticks, and every eplb_step_interval ticks move the experts (and their
    replicas) so that every rank gets the same share; needs enable_expert_parallel."""
    eplb_num_redundant_experts: int = 0
    """EPLB: physical expert slots per MoE layer beyond the model's experts, for replicas of
    the hottest ones (the total must be a multiple of the DP size); 0 = re-placement only."""
    eplb_window_size: int = 1000
    """EPLB: ticks whose routed tokens the plan reads: the last this many of each interval
    (at most eplb_step_interval; vLLM's default)."""
    eplb_step_interval: int = 3000
    """EPLB: ticks between rebalances (every tick counts, dummy batches included, so every
    rank rebalances at the same tick; vLLM's default)."""
    eplb_min_balancedness: float = 0.95
    """EPLB: leave the placement as it is when the window's balancedness (mean over max of the
    ranks' routed tokens, summed over layers; 1 = perfect) is at least this: a move pauses
    every rank; 1.0 = rebalance whenever it is not perfect."""
    eplb_fake_uniform: bool = False
    """EPLB measurement mode: replace the router's expert choice by a uniform one (every
    expert and rank gets the same share: the balanced upper bound; ATOM's --fake-eplb). It
    changes the model's output: never for serving."""
    record_expert_load: bool = False
    """Count the tokens routed to each expert over EPLB's window (eplb_window_size of every
    eplb_step_interval ticks) without moving any expert: balancedness per window in /metrics,
    the DP summary line and the DP trace, the load at GET /expert_load (SGLang's expert
    distribution recorder, stat mode). enable_eplb records too; needs enable_expert_parallel."""
    enable_tbo: bool = False
    """Two-batch overlap: run prefill steps as two micro-batches whose MoE collectives overlap
    the other's compute (across DP ranks, only on steps where every rank can split); needs
    data_parallel_size > 1 and enable_expert_parallel (the collectives it overlaps)."""
    moe_split_experts: int | None = None
    """Split every dense MLP into this many experts along the intermediate dimension, each
    token routed to all of them with gate 1 (the dense model's function, as an MoE: the checkable model
    (a) of docs/ARCHITECTURE.md, "Models")."""
    speculative_method: str | None = None
    """Speculative decoding: ngram (prompt lookup: propose what followed the last n tokens
    earlier in the sequence), draft (a draft model: draft_model with its own KV cache, or
    without it an early-exit draft of the target: its first draft_num_layers layers, final
    norm and LM head, on the target's own KV cache), mtp (the checkpoint's own
    multi-token-prediction layers, DeepSeek-V2/V3 with num_nextn_predict_layers >= 1, reused
    num_speculative_tokens times; their KV in the same paged pool as extra layers) or None =
    off. Outputs keep the target's distribution at any temperature (rejection sampling)."""
    num_speculative_tokens: int = 3
    """Speculative decoding: most draft tokens a decode verifies per step (k; a step emits up
    to k + 1 tokens per sequence)."""
    draft_model: str | None = None
    """Speculative decoding (draft): a separate draft model, a GGUF file or Hugging Face folder
    with the target's vocabulary (the same tokenizer), run in the target's dtype with a KV cache
    of its own (paged like the target's: the same block ids; the KV memory budget covers both);
    None = the early-exit draft of the target (draft_num_layers)."""
    draft_num_layers: int | None = None
    """Speculative decoding (draft): layers the draft runs, 1 .. its layers: the early-exit
    draft's (required without draft_model; all layers: the draft is the target and accepts
    every draft token), or the first layers of draft_model (default: all)."""
    prompt_lookup_min: int = 1
    """Speculative decoding (ngram): shortest n-gram matched (tokens)."""
    prompt_lookup_max: int = 3
    """Speculative decoding (ngram): longest n-gram matched (tokens; tried first)."""
    spec_log_every_steps: int = 100
    """Speculative decoding: log the acceptance statistics every this many verify steps
    (0 = never)."""
    kv_role: str | None = None
    """Prefill/decode disaggregation (atom.core.kv_connector): producer (prefills requests that carry
    kv_transfer_params and keeps their KV blocks until a consumer pulls them) or consumer
    (pulls a producer's KV instead of prefilling, then decodes); None = off. Requests without
    kv_transfer_params run as usual on either role."""
    kv_transfer_host: str = "127.0.0.1"
    """Producer: the address its KV transfer socket binds and that it tells consumers."""
    kv_transfer_port: int = 0
    """Producer: TCP port of its KV transfer socket, DP rank r's at port + r (0 = OS-chosen;
    the bound port travels in the kv_transfer_params of each response)."""
    kv_transfer_keep_timeout_s: float = 60.0
    """Producer: seconds a finished prefill's KV blocks are kept for a consumer that never
    pulls or confirms them (it died, or the client left), then freed."""
    kv_transfer_timeout_s: float = 30.0
    """Consumer: seconds a pull may wait for the producer's reply before the request fails
    (the producer died or is unreachable)."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported: use one of {_DTYPES}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not supported: use one of "
                             f"{QUANTIZATIONS} or leave it unset")
        if self.quantization == "gguf" and self.dtype == "bfloat16":
            raise ValueError("quantization='gguf' computes in float32 (its kernels take float32 "
                             "activations): use dtype='float32' or 'auto'")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be >= 1")
        if self.seed < 0:
            raise ValueError(f"seed={self.seed} must be >= 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads} must be >= 1")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} must be >= 1")
        if self.dp_load_balance not in DP_LOAD_BALANCE_POLICIES:
            raise ValueError(f"dp_load_balance={self.dp_load_balance!r} is not supported: use one "
                             f"of {DP_LOAD_BALANCE_POLICIES}")
        self._check_routing()
        self.resolved_kv_events()  # builds (so validates) the publisher settings
        if not self.dp_group_timeout_s > 0:
            raise ValueError(f"dp_group_timeout_s={self.dp_group_timeout_s} must be > 0 (seconds)")
        if not self.engine_hang_timeout_s >= MIN_ENGINE_HANG_TIMEOUT_S:
            raise ValueError(f"engine_hang_timeout_s={self.engine_hang_timeout_s} must be at least "
                             f"{MIN_ENGINE_HANG_TIMEOUT_S:g} seconds (a few heartbeats)")
        if self.on_rank_failure not in ON_RANK_FAILURE:
            raise ValueError(f"on_rank_failure={self.on_rank_failure!r} is not supported: use one "
                             f"of {ON_RANK_FAILURE}")
        if self.moe_split_experts is not None and self.moe_split_experts < 1:
            raise ValueError(f"moe_split_experts={self.moe_split_experts} must be >= 1")
        self._check_prefill_policy()
        if self.enable_tbo and not self.enable_expert_parallel:
            raise ValueError("enable_tbo overlaps the MoE collectives of expert parallelism with "
                             "compute: set enable_expert_parallel (--enable-expert-parallel) too, "
                             "or drop --enable-tbo")
        self._check_eplb()
        self._check_speculative()
        self._check_kv_transfer()

    def _check_speculative(self) -> None:
        """The speculative decoding settings (``__post_init__``). Raises ValueError."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for names, method in ((("draft_model", "draft_num_layers"), "draft"),
                              (("prompt_lookup_min", "prompt_lookup_max"), "ngram"),
                              (("num_speculative_tokens", "spec_log_every_steps"), None)):
            changed = [n for n in names if getattr(self, n) != defaults[n]]
            if changed and (self.speculative_method is None
                            or method not in (None, self.speculative_method)):
                raise ValueError(f"{' and '.join(changed)} "
                                 f"{'is' if len(changed) == 1 else 'are'} for speculative "
                                 f"decoding: use --speculative-method {method or 'ngram|draft|mtp'} "
                                 f"(speculative_method), or drop {'it' if len(changed) == 1 else 'them'}")
        if self.speculative_method is None:
            return
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method={self.speculative_method!r} is not supported: "
                             f"use one of {SPECULATIVE_METHODS} (or None for off)")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1")
        if self.spec_log_every_steps < 0:
            raise ValueError(f"spec_log_every_steps={self.spec_log_every_steps} must be >= 0")
        if self.speculative_method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.speculative_method == "draft":
            if self.draft_model is None and self.draft_num_layers is None:
                raise ValueError("speculative_method='draft' needs draft_model (a draft model "
                                 "file or folder) or draft_num_layers (the early-exit draft's "
                                 "layer count)")
            if self.draft_num_layers is not None and self.draft_num_layers < 1:
                raise ValueError(f"draft_num_layers={self.draft_num_layers} must be >= 1")

    def _check_eplb(self) -> None:
        """The EPLB settings (``__post_init__``; the slot count against the DP size is checked
        where the model's expert count is known, :mod:`atom.dp.eplb.manager`). Raises
        ValueError."""
        for name in ("eplb_window_size", "eplb_step_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1 (ticks)")
        if self.eplb_window_size > self.eplb_step_interval:
            raise ValueError(f"eplb_window_size={self.eplb_window_size} ticks is longer than "
                             f"eplb_step_interval={self.eplb_step_interval}: the window is the "
                             f"end of each interval; shorten it or lengthen the interval")
        if self.eplb_num_redundant_experts < 0:
            raise ValueError(f"eplb_num_redundant_experts={self.eplb_num_redundant_experts} "
                             f"must be >= 0")
        if not 0.0 <= self.eplb_min_balancedness <= 1.0:
            raise ValueError(f"eplb_min_balancedness={self.eplb_min_balancedness} must be a "
                             f"fraction in [0, 1]")
        uses_eplb = [name for name, off in (("eplb_num_redundant_experts", 0),
                                            ("eplb_fake_uniform", False))
                     if getattr(self, name) != off]
        if uses_eplb and not self.enable_eplb:
            raise ValueError(f"{' and '.join(uses_eplb)} need{'s' * (len(uses_eplb) == 1)} "
                             f"enable_eplb (--enable-eplb)")
        if self.enable_eplb and not self.enable_expert_parallel:
            raise ValueError("enable_eplb balances the experts of expert parallelism: set "
                             "enable_expert_parallel (--enable-expert-parallel) too")
        if self.record_expert_load and not self.enable_expert_parallel:
            raise ValueError("record_expert_load counts the experts' tokens under expert "
                             "parallelism: set enable_expert_parallel (--enable-expert-parallel) "
                             "too")

    def check_expert_layout(self, num_experts: int | None, *, model: str) -> int | None:
        """Check the expert options against the model's experts (``num_experts`` per MoE
        layer, as its ``config.json`` says; None for a dense model), before any process starts
        (:mod:`atom.engine.preflight`). Returns the experts expert parallelism shards (the
        model's, or ``moe_split_experts`` of a dense one), None when there are none.

        ``model`` names the model in the messages.

        Raises:
            ValueError: in one line saying what to change: ``moe_split_experts`` on an MoE,
                ``enable_expert_parallel`` on a dense model or with fewer experts than DP
                ranks, EPLB's slots (experts + ``eplb_num_redundant_experts``) not a multiple
                of the DP size, or more redundant slots than ``experts x (DP size - 1)`` (a
                rank would hold more slots than there are experts: two copies of one).
        """
        if self.moe_split_experts is not None and num_experts is not None:
            raise ValueError(f"--moe-split-experts splits a dense model's MLPs into experts, but "
                             f"{model} is an MoE ({num_experts} experts a layer): drop "
                             f"--moe-split-experts (--enable-expert-parallel shards its own "
                             f"experts)")
        experts = self.moe_split_experts or num_experts
        if not self.enable_expert_parallel:
            return experts
        dp = self.data_parallel_size
        if experts is None:
            raise ValueError(f"--enable-expert-parallel needs an MoE model and {model} is dense: "
                             f"load an MoE (e.g. a Qwen3-MoE or Mixtral folder), split this one "
                             f"with --moe-split-experts E, or drop --enable-expert-parallel")
        if experts < dp:
            raise ValueError(f"{experts} experts cannot be sharded over {dp} ranks (each rank "
                             f"needs one): use --data-parallel-size {experts} or fewer")
        if not self.enable_eplb:
            return experts
        redundant = self.eplb_num_redundant_experts
        if (experts + redundant) % dp:
            fits = -experts % dp  # the fewest redundant slots that divide
            raise ValueError(f"EPLB: {experts} experts + {redundant} redundant slots = "
                             f"{experts + redundant} slots a layer, not a multiple of the {dp} "
                             f"ranks: set --eplb-num-redundant-experts to {fits} plus a multiple "
                             f"of {dp}")
        if redundant > experts * (dp - 1):
            raise ValueError(f"EPLB: {redundant} redundant slots over {dp} ranks give each rank "
                             f"{(experts + redundant) // dp} slots for {experts} experts (a rank "
                             f"would hold two copies of one): use at most {experts * (dp - 1)} "
                             f"(--eplb-num-redundant-experts)")
        return experts

    def _check_kv_transfer(self) -> None:
        """The P/D settings (``__post_init__``). Raises ValueError."""
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role={self.kv_role!r} is not supported: use one of {KV_ROLES} "
                             f"or leave it unset")
        if self.kv_transfer_port and self.kv_transfer_port + self.data_parallel_size > 65536:
            raise ValueError(f"kv_transfer_port={self.kv_transfer_port}: DP rank r binds port + r, "
                             f"past 65535 with {self.data_parallel_size} ranks")
        if not 0 <= self.kv_transfer_port < 65536:
            raise ValueError(f"kv_transfer_port={self.kv_transfer_port} must be in [0, 65535]")
        for name in ("kv_transfer_keep_timeout_s", "kv_transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 (seconds)")

    def _check_prefill_policy(self) -> None:
        """The prefill policy settings (``__post_init__``). Raises ValueError."""
        if self.prefill_policy is not None and self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill_policy={self.prefill_policy!r} is not supported: use one of "
                             f"{PREFILL_POLICIES}")
        for name in ("prefill_delayer_max_delay_passes", "prefill_coalescer_ttft_max_ticks",
                     "prefill_coalescer_partial_max_ticks", "prefill_coalescer_stall_ticks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1 (ticks): a bound of "
                                 f"0 would never hold")
        age = self.prefill_coalescer_max_queue_ticks
        if age is not None and (isinstance(age, bool) or not isinstance(age, int) or age < 1):
            raise ValueError(f"prefill_coalescer_max_queue_ticks={age!r} must be an integer >= 1 "
                             f"(ticks) or None (off)")
        interval = self.prefill_decode_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise ValueError(f"prefill_decode_interval={interval!r} must be an integer >= 0 "
                             f"(ticks; 0 = off)")
        wm = self.prefill_delayer_kv_low_watermark
        if wm is not None and not 0.0 < wm < 1.0:
            raise ValueError(f"prefill_delayer_kv_low_watermark={wm} must be a fraction in (0, 1) "
                             f"(or None: off)")
        for name in ("prefill_coalescer_target_fill", "prefill_coalescer_kv_high_watermark"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be a fraction in (0, 1]")
        if self.data_parallel_size == 1:
            for name, off in (("prefill_policy", (None, "none")), ("prefill_decode_interval", (0,)),
                              ("dp_trace", (None,)), ("enable_eplb", (False,)),
                              ("enable_tbo", (False,)), ("record_expert_load", (False,))):
                if getattr(self, name) not in off:
                    raise ValueError(f"{name}={getattr(self, name)!r} needs data parallelism: "
                                     f"set data_parallel_size > 1 or leave it unset")

    def _check_routing(self) -> None:
        if self.dp_load_guard_abs_threshold < 0:
            raise ValueError(f"dp_load_guard_abs_threshold={self.dp_load_guard_abs_threshold} "
                             f"must be >= 0 (requests)")
        if not self.dp_load_guard_rel_threshold >= 1.0:
            raise ValueError(f"dp_load_guard_rel_threshold={self.dp_load_guard_rel_threshold} "
                             f"must be >= 1.0")
        if not 0.0 <= self.dp_cache_aware_min_match_ratio <= 1.0:
            raise ValueError(f"dp_cache_aware_min_match_ratio={self.dp_cache_aware_min_match_ratio}"
                             f" must be a fraction in [0, 1]")
        if self.dp_load_balance == "cache_aware" and not self.enable_prefix_caching:
            raise ValueError("dp_load_balance=cache_aware routes on the prefix cache: drop "
                             "--no-enable-prefix-caching or pick another policy")

    def resolved_kv_events(self):
        """The KV events publisher settings (:class:`atom.kv_events.KVEventsConfig`), or None
        when the engine cores publish nothing.

        The one place this is decided: ``kv_events_endpoint`` when set; else, for cache_aware
        routing over DP ranks, :data:`PRIVATE_KV_EVENTS_ENDPOINT` for both PUB and replay
        (the router needs the events; loopback and OS-chosen ports expose nothing and never
        collide); else None.

        Raises:
            ValueError: a malformed endpoint or a size below 1.
        """
        from atom.kv_events import KVEventsConfig

        endpoint, replay = self.kv_events_endpoint, self.kv_events_replay_endpoint
        if endpoint is None:
            if replay is not None:
                raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
            if self.dp_load_balance != "cache_aware" or self.data_parallel_size == 1:
                return None
            endpoint = replay = PRIVATE_KV_EVENTS_ENDPOINT
        return KVEventsConfig(endpoint=endpoint, replay_endpoint=replay,
                              topic=self.kv_events_topic, buffer_size=self.kv_events_buffer_size,
                              max_queue_size=self.kv_events_max_queue_size,
                              hwm=self.kv_events_hwm)

    def with_data_parallel_size(self, num_ranks: int) -> "EngineConfig":
        """This config for a group of ``num_ranks`` ranks (a deployment shrunk by a rank
        failure keeps running the DP loop). At one rank the options that need data parallelism
        (:meth:`_check_prefill_policy`) are turned off, with a warning: the prefill policy
        (nothing to align with), the decode interval, the trace, EPLB (nothing to balance) and
        TBO (no collectives to overlap)."""
        changes: dict[str, Any] = {"data_parallel_size": num_ranks}
        if num_ranks == 1:
            off = {"prefill_policy": (None, "none"), "prefill_decode_interval": (0,),
                   "dp_trace": (None,), "enable_eplb": (False,), "eplb_num_redundant_experts": (0,),
                   "eplb_fake_uniform": (False,), "enable_tbo": (False,),
                   "record_expert_load": (False,)}
            dropped = {k: v[0] for k, v in off.items() if getattr(self, k) not in v}
            if dropped:
                import logging

                logging.getLogger(__name__).warning(
                    "one rank left: %s no longer apply", ", ".join(
                        f"{k}={getattr(self, k)!r}" for k in dropped))
            changes.update(dropped)
        return dataclasses.replace(self, **changes)

    def resolved_record_expert_load(self) -> bool:
        """Whether the DP ranks count the experts' routed tokens (EPLB's manager on every
        rank): with enable_eplb (which rebalances on the counts) or record_expert_load (which
        only reports them)."""
        return self.enable_eplb or self.record_expert_load

    def resolved_prefill_policy(self) -> str:
        """The prefill policy this config runs ("delayer", "coalescer" or "none"; None =
        delayer when data_parallel_size > 1, else none)."""
        if self.prefill_policy is not None:
            return self.prefill_policy
        return "delayer" if self.data_parallel_size > 1 else "none"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from keyword options; unknown keys raise ``TypeError`` listing the valid ones."""
        replaced = sorted(set(kwargs) & set(_REPLACED_OPTIONS))
        if replaced:
            raise TypeError(f"engine option {replaced[0]!r} was replaced: "
                            f"{_REPLACED_OPTIONS[replaced[0]]}")
        vllm = sorted(set(kwargs) & set(VLLM_OPTION_HINTS) - {f.name for f in fields(cls)})
        if vllm:
            raise TypeError(f"{vllm[0]!r} is vLLM's option: {VLLM_OPTION_HINTS[vllm[0]][1]}")
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid options: {sorted(valid)}")
        return cls(**kwargs)

    def resolved_dtype(self) -> str:
        """The concrete dtype name ("bfloat16" or "float32") this config runs with."""
        if self.dtype != "auto":
            return self.dtype
        if self.quantization == "gguf":
            return "float32"
        return "bfloat16" if cpu_has_native_bf16() else "float32"

    def resolved_num_threads(self) -> int:
        """Torch threads of an engine core started with this config (see ``num_threads``)."""
        return resolve_num_threads(self.num_threads)

    def resolved_max_model_len(self, max_position_embeddings: int) -> int:
        """Max tokens per sequence for a model of ``max_position_embeddings`` (see
        ``max_model_len``); the engine core and the simulator both size with this."""
        return self.max_model_len or min(max_position_embeddings, MAX_DEFAULT_MODEL_LEN)

    def resolved_num_kv_blocks(self, bytes_per_block: int) -> int:
        """KV pool size in blocks of ``bytes_per_block`` bytes each (see ``num_kv_blocks``)."""
        return self.num_kv_blocks or max(1, self.kv_cache_memory_bytes // bytes_per_block)


def resolve_num_threads(num_threads: int | None, *, num_local_ranks: int = 1,
                        env: Mapping[str, str] | None = None, num_cpus: int | None = None) -> int:
    """Torch intra-op threads for one of ``num_local_ranks`` engine processes on this node.

    The one place the thread count is decided: ``num_threads`` when set; else
    ``OMP_NUM_THREADS`` when set (by the user, or by whoever started this process with its
    share: a launcher, the engine-core client); else the cores available to this process
    (``num_cpus``, default its CPU affinity) divided by ``num_local_ranks``, at least 1.
    """
    if num_threads:
        return num_threads
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").isdigit() and int(env["OMP_NUM_THREADS"]) > 0:
        return int(env["OMP_NUM_THREADS"])
    num_cpus = num_available_cpus() if num_cpus is None else num_cpus
    return max(1, num_cpus // num_local_ranks)


def num_available_cpus() -> int:
    """CPU cores this process may run on (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def oversubscription_warning(num_local_ranks: int, num_cpus: int | None = None) -> str | None:
    """A warning when ``num_local_ranks`` engine processes share fewer CPU cores than there are
    processes (each then runs one thread on a core it shares: every step slows down); None
    otherwise."""
    num_cpus = num_available_cpus() if num_cpus is None else num_cpus
    if num_local_ranks <= num_cpus:
        return None
    return (f"{num_local_ranks} engine processes on {num_cpus} CPU cores: they share cores "
            f"(oversubscribed) and every step will be slow; use at most {num_cpus} ranks on "
            f"this machine")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 or AMX-BF16 flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` of the ``atom`` commands: descriptions and help texts taken from docstrings
    show their markup as plain text (:func:`plain_text`), and ``(default: X)`` is added only
    where the help does not state its default already."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain_text(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return plain_text(super()._expand_help(action))

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


_ROLE = re.compile(r":\w+:`(~?)([^`]+)`")  # :class:`~a.b.C` -> C, :mod:`a.b` -> a.b
_QUOTED = re.compile(r"``?([^`]+)``?")


def plain_text(text: str) -> str:
    """Docstring markup as plain text: ``:role:`~mod.name``` -> ``name`` (``:role:`mod.name```
    -> ``mod.name``), ````code```` and ```code``` -> ``code``."""
    text = _ROLE.sub(lambda m: m[2].rsplit(".", 1)[-1] if m[1] else m[2], text)
    return _QUOTED.sub(r"\1", text)


class ArgumentParser(argparse.ArgumentParser):
    """The ``atom`` command's parsers (its subcommands' parsers are of the same class): a usage
    error is one line, ``PROG: error: MESSAGE``, and exit code 2, like every other error of
    the command line; the usage (dozens of lines with every engine option) is ``--help``'s.
    Help is formatted by :class:`HelpFormatter` unless ``formatter_class`` says otherwise."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per EngineConfig field; defaults and help come from the dataclass.
    The parsed namespace gets ``runs_engine=True`` (:func:`config_from_args` applies)."""
    parser.set_defaults(runs_engine=True)
    docs = _field_docs(EngineConfig)
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if str(f.type) in ("bool", "bool | None") or isinstance(default, bool):
            parser.add_argument(flag, default=default, action=argparse.BooleanOptionalAction,
                                help=docs.get(f.name))
        else:
            kind = {"int": int, "int | None": int, "str": str, "str | None": str,
                    "float": float, "float | None": float}.get(str(f.type), str)
            parser.add_argument(flag, default=default, type=kind, help=docs.get(f.name))
    for name, hint in _REPLACED_OPTIONS.items():
        flag = name.replace("_", "-")
        parser.add_argument(f"--{flag}", f"--no-{flag}", action=_ReplacedFlag,
                            hint=f"was replaced: {hint}")
    names = {f.name for f in fields(EngineConfig)}
    for name, (short, hint) in VLLM_OPTION_HINTS.items():
        flags = [short] if short else []
        if name not in names:  # atom has no such option: vLLM's long spelling is the hint too
            flags.append("--" + name.replace("_", "-"))
        parser.add_argument(*flags, action=_ReplacedFlag, hint=f"is vLLM's option: {hint}")


class _ReplacedFlag(argparse.Action):
    """A flag atom does not take (replaced, or vLLM's): using it is a usage error that says
    what to use instead."""

    def __init__(self, option_strings, dest, *, hint: str, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help=argparse.SUPPRESS, **kwargs)
        self.hint = hint

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} {self.hint}")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def _field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal after each field) read from the class source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = str(nxt.value.value)  # type: ignore[attr-defined]
    return docs
