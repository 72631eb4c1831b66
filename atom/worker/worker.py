"""The worker: everything torch on one rank, behind the step's middle call.

vLLM v1's split of a step into three parts (docs/ARCHITECTURE.md, "One rank")::

    sched  = scheduler.schedule()                      # torch-free (atom.core)
    output = worker.execute_model(sched)               # here: forward, sampling, verification
    outs   = scheduler.update_from_output(sched, output)

:class:`Worker` owns the model and its KV cache tensors (through the
:class:`~atom.worker.model_runner.ModelRunner`), a separate draft model's runner, the sampler
and the rejection sampler, the model-based draft proposer (the early-exit draft, or DeepSeek's
MTP layers, which it hands every step's hidden states) and the P/D connector's worker side.
It reads sequences and never mutates them; what it found goes back in a torch-free
:class:`~atom.core.model_runner_output.ModelRunnerOutput`. The engine core
(:class:`atom.engine.core.EngineCore`) holds it as its worker; the simulator gives that same core
a cost-model worker with the same methods (:mod:`atom.dp.sim.rank`).

Only the process that runs the forward builds one: the engine-core process, a DP rank, an
in-process engine (tests, benchmarks) and the simulator's calibration grid.
"""

from __future__ import annotations

import logging
import time

import torch

from atom.config import EngineConfig
from atom.core.kv_connector import KVConnectorMetadata, KVConnectorOutput, KVLayout
from atom.core.model_runner_output import ModelRunnerOutput
from atom.core.scheduler_output import SchedulerOutput
from atom.core.sequence import Sequence
from atom.kv_cache_spec import describe_groups, describe_layers, kv_cache_groups
from atom.layers.moe import ExpertShard, moe_layers
from atom.messages import EngineRuntime
from atom.worker.model_runner import ModelOutput, ModelRunner
from atom.worker.sampler import Sampler, top_logprobs

logger = logging.getLogger(__name__)


class Worker:
    """Loads the model and runs the steps of one rank.

    Args:
        config: engine options.
        extra_eos_token_ids: EOS ids the front end knows besides the model config's (the
            tokenizer's); the worker masks them below ``min_tokens``.
        dp_rank: this worker's DP rank (its expert shard, its sampling stream, its P/D port).

    Attributes:
        runtime: what the load found (KV blocks, ``max_model_len``, vocabulary, EOS ids, ...).
        runner: the target's model runner (its ``model`` is what expert parallelism and EPLB
            wrap, from outside).
        kv_layout: the KV cache's shape, compared at a P/D transfer's handshake.

    Raises:
        ValueError: invalid options, a model that cannot be loaded, expert parallelism over a
            dense model.
        RuntimeError: a P/D producer cannot bind its KV transfer port.
    """

    def __init__(self, config: EngineConfig, *, extra_eos_token_ids: tuple[int, ...] = (),
                 dp_rank: int = 0):
        from atom.worker.model_loader import load_gguf_blocks, load_model_weights, release_freed_heap

        torch.set_num_threads(config.resolved_num_threads())
        dtype_name = config.resolved_dtype()
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype_name]
        arch, weights = load_model_weights(config.model, dtype)
        blocks = load_gguf_blocks(config.model) if config.quantization == "gguf" else None
        max_model_len = config.resolved_max_model_len(arch.max_position_embeddings)
        num_mtp_layers = _num_mtp_layers(config, arch)
        bytes_per_block = ModelRunner.kv_cache_bytes_per_block(
            arch, dtype=dtype, block_size=config.block_size, num_mtp_layers=num_mtp_layers)
        draft = None if config.draft_model is None else _load_draft_model(
            config.draft_model, dtype, target=arch, max_model_len=max_model_len)
        if draft is not None:  # its cache has the target's blocks: the budget covers both
            bytes_per_block += ModelRunner.kv_cache_bytes_per_block(
                draft[0], dtype=dtype, block_size=config.block_size)
        itemsize = torch.empty((), dtype=dtype).element_size()
        specs = ModelRunner.kv_cache_specs_of(arch)
        groups = kv_cache_groups(specs)
        if len(groups) > 1:
            _check_hybrid_supported(config, has_full_group=groups[0].sliding_window is None)
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
                                  quantized_weights=blocks, expert_shard=expert_shard,
                                  num_mtp_layers=num_mtp_layers)
        del weights, blocks  # the model holds its own copies (or none: tiled GGUF linears)
        layers = moe_layers(self.runner.model)
        if config.enable_expert_parallel and not layers:
            raise ValueError("--enable-expert-parallel needs an MoE model: load one (e.g. a "
                             "Qwen3-MoE or Mixtral folder) or split a dense one with "
                             "--moe-split-experts E")
        eos = tuple(sorted(set(arch.eos_token_ids) | set(extra_eos_token_ids)))
        self.runtime = EngineRuntime(num_kv_blocks=num_blocks, max_model_len=max_model_len,
                                     vocab_size=arch.vocab_size, eos_token_ids=eos,
                                     kv_cache_bytes=num_blocks * bytes_per_block, dtype=dtype_name,
                                     num_experts=layers[0].num_experts if layers else None,
                                     kv_cache_group_windows=tuple(g.sliding_window for g in groups),
                                     kv_cache_group_bytes_per_token=tuple(
                                         itemsize * sum(specs[i].values_per_token()
                                                        for i in g.layer_ids) for g in groups))
        self.kv_layout = KVLayout(architecture=arch.architecture, dtype=dtype_name,
                                  block_size=config.block_size,
                                  layers=tuple(self.runner.kv_cache_specs))
        self.kv_connector = _start_kv_connector(config, self.runner, dp_rank, self.kv_layout)
        draft_runner = None if draft is None else ModelRunner(
            *draft, dtype=dtype, num_kv_blocks=num_blocks, block_size=config.block_size,
            max_model_len=max_model_len)
        del draft
        self.draft_proposer = _make_draft_proposer(config, self.runner, draft_runner)
        self.sampler = Sampler(eos, seed=config.seed, dp_rank=dp_rank)
        self.rejection_sampler = None
        if config.speculative_method is not None:
            from atom.worker.rejection_sampler import RejectionSampler

            self.rejection_sampler = RejectionSampler(self.sampler)
        release_freed_heap()
        logger.info("worker ready: dtype %s, %d KV blocks x %d tokens (%.1f MiB, %d bytes per "
                    "token: %s%s), max_model_len %d", dtype_name, num_blocks, config.block_size,
                    self.runtime.kv_cache_bytes / 2**20, bytes_per_block // config.block_size,
                    describe_layers(self.runner.kv_cache_specs),
                    "" if len(groups) == 1 else "; " + describe_groups(specs, itemsize=itemsize),
                    max_model_len)

    @property
    def model(self) -> torch.nn.Module:
        """The target model (expert parallelism and EPLB wrap its MoE layers)."""
        return self.runner.model

    @property
    def kv_transfer_port(self) -> int | None:
        """The port a P/D producer's KV transfer server bound (None without one)."""
        return None if self.kv_connector is None else self.kv_connector.port

    # ----- the step -----

    def execute_model(self, sched: SchedulerOutput, *, two_batch_overlap: bool = False
                      ) -> ModelRunnerOutput:
        """Run ``sched``: forward (as two micro-batches with ``two_batch_overlap``), then sample
        each sequence that reached its last token, verifying its drafts when it has some.

        An empty ``sched`` runs no forward (a DP rank runs :meth:`execute_dummy_batch` for its
        collectives first) but still hands the P/D connector its metadata and collects what
        it finished. Reads ``sched``'s sequences (before the scheduler's update).
        """
        start = time.perf_counter()
        for seq_id in sched.finished_seq_ids:
            self.sampler.release(seq_id)
            if self.runner.mtp is not None:
                self.draft_proposer.release(seq_id)
        meta = sched.kv_connector_metadata
        if meta is not None:
            self.start_kv_transfers(meta)
        output = ModelRunnerOutput()
        if not sched.is_empty:
            model_out = self.runner.execute_model(sched.scheduled,
                                                  two_batch_overlap=two_batch_overlap)
            if model_out.hidden_states is not None:  # the MTP draft's inputs
                self.draft_proposer.record(model_out.hidden_states)
            output = self._sample(model_out, {seq.seq_id: seq for seq, _ in sched.scheduled},
                                  sched.grammar_bitmask)
        if self.kv_connector is not None:
            output.kv_connector_output = self.kv_connector.get_finished()
        output.execute_s = time.perf_counter() - start
        return output

    def execute_dummy_batch(self, *, two_batch_overlap: bool = False) -> None:
        """A forward over zero tokens that writes no KV: a DP rank with nothing to run takes
        this step so that it issues the same collectives (MoE dispatch/combine, split the same
        way with ``two_batch_overlap``) as the ranks that do."""
        self.runner.execute_model([], two_batch_overlap=two_batch_overlap)

    def _sample(self, model_out: ModelOutput, by_id: dict[int, Sequence], token_bitmask: dict
                ) -> ModelRunnerOutput:
        """Tokens (and logprobs) of the sampled rows; a verify when some sequence had drafts.
        ``token_bitmask``: the constrained sequences' grammar masks (applied before sampling)."""
        seqs = [by_id[i] for i in model_out.sampled_seq_ids]
        output = ModelRunnerOutput(seq_ids=model_out.sampled_seq_ids,
                                   prompt_logprobs=_prompt_logprobs(model_out.prompt_logits, by_id))
        if not seqs:
            return output
        if model_out.num_rows is not None:
            verified = self.rejection_sampler(model_out.logits, seqs,
                                              [seq.spec_token_ids for seq in seqs],
                                              token_bitmask=token_bitmask)
            output.sampled_token_ids = verified.token_ids
            output.sampled_logprobs = verified.sampled_logprobs
            output.logprobs = [None if seq.sampling_params.logprobs is None else entries
                               for seq, entries in zip(seqs, verified.logprobs)]
        else:
            sampled = self.sampler(model_out.logits, seqs, token_bitmask=token_bitmask)
            output.sampled_token_ids = [[t] for t in sampled.token_ids]
            output.sampled_logprobs = [[lp] for lp in sampled.sampled_logprobs]
            output.logprobs = [None if entry is None else [entry] for entry in sampled.logprobs]
        return output

    # ----- drafts -----

    @property
    def proposes_drafts(self) -> bool:
        """Whether a model-based proposer (the early-exit draft, a draft model) fills the draft
        slots after scheduling (:meth:`propose_drafts`)."""
        return self.draft_proposer is not None

    def propose_drafts(self, seqs: list[Sequence], max_num_tokens: list[int], *,
                       num_steps: int | None = None) -> list[list[int]]:
        """Exactly ``max_num_tokens[i]`` drafts for ``seqs[i]`` (slots reserved by the
        scheduler); ``num_steps``: draft forwards to run, the extra ones on zero tokens (the DP
        loop passes the largest over the ranks, so every rank issues the same collectives)."""
        return self.draft_proposer.propose(seqs, max_num_tokens, num_steps=num_steps)

    def num_draft_tokens(self, seqs: list[Sequence]) -> int:
        """Tokens of the largest draft forward :meth:`propose_drafts` runs for ``seqs`` (the DP
        batch shape sizes the draft forwards' MoE collectives to the largest over the ranks):
        one per sequence, or with MTP the first forward's catch-up positions."""
        if self.runner.mtp is None:
            return len(seqs)
        return sum(self.draft_proposer.num_catch_up_tokens(seq) for seq in seqs)

    # ----- the P/D connector's worker side -----

    def start_kv_transfers(self, meta: KVConnectorMetadata) -> None:
        """Hand the connector the scheduler side's changes: pulls to start, blocks kept for a
        consumer, pulls cancelled (never blocks)."""
        if self.kv_connector is not None and not meta.is_empty:
            self.kv_connector.start_load_kv(meta)

    def get_kv_connector_output(self) -> KVConnectorOutput:
        """What the connector finished since the last call (an idle DP rank's collection)."""
        return self.kv_connector.get_finished()

    def has_pending_kv_output(self) -> bool:
        """The connector finished something not collected yet (an idle core steps for it)."""
        return self.kv_connector is not None and self.kv_connector.has_pending_output()

    def wait_for_kv_transfers(self, timeout_s: float) -> None:
        """Block until a transfer completes, at most ``timeout_s`` seconds."""
        self.kv_connector.wait(timeout_s)

    def get_stats(self) -> dict[str, int | float]:
        """The connector's counters (empty without one)."""
        return {} if self.kv_connector is None else self.kv_connector.get_stats()

    def close(self) -> None:
        """Stop the KV connector. Idempotent."""
        if self.kv_connector is not None:
            self.kv_connector.close()


def _prompt_logprobs(prompt_logits: dict[int, torch.Tensor], by_id: dict[int, Sequence]
                     ) -> dict[int, dict[int, dict[int, float]]]:
    """``seq_id -> {p + 1: entry}`` from the logits row of each prompt position ``p`` computed
    this step, for positions not filled before (after a preemption the recomputed positions
    keep their first entries). Prompt-logprob requests bypass the prefix cache (block
    manager), so every position is computed at least once."""
    out = {}
    for seq_id, logits in prompt_logits.items():
        seq = by_id[seq_id]
        recorded = seq.prompt_logprobs  # choice 0's only
        if recorded is None:
            continue
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        entries = {}
        for row in range(logprobs.shape[0]):
            target = seq.num_computed_tokens + row + 1
            if target < seq.num_prompt_tokens and recorded[target] is None:
                entries[target] = top_logprobs(logprobs[row], seq.token_ids[target],
                                               seq.sampling_params.prompt_logprobs)
        if entries:
            out[seq_id] = entries
    return out


def _make_draft_proposer(config: EngineConfig, runner: ModelRunner,
                         draft_runner: ModelRunner | None):
    """The model-based proposer of ``speculative_method="draft"`` or ``"mtp"`` (the n-gram
    proposer runs in the scheduler), or None. ``draft_runner``: the separate draft model's
    runner (``draft_model``); it then runs every step's forward beside the target's
    (``ModelRunner.shadow_model``), so its own KV cache holds what the target's does."""
    if config.speculative_method == "mtp":
        from atom.worker.mtp_proposer import MTPProposer

        return MTPProposer(runner)
    if config.speculative_method != "draft":
        return None
    from atom.worker.draft_proposer import EarlyExitProposer

    if draft_runner is None:
        return EarlyExitProposer(runner, num_layers=config.draft_num_layers)
    runner.shadow_model = draft_runner.model
    return EarlyExitProposer(draft_runner, num_layers=config.draft_num_layers
                             or draft_runner.arch_config.num_hidden_layers)


def _num_mtp_layers(config: EngineConfig, arch) -> int:
    """MTP layers to load: 0 unless ``speculative_method="mtp"``, then every one the checkpoint
    has (``num_nextn_predict_layers``; one is reused for every draft).

    Raises:
        ValueError: mtp asked of a model without MTP layers (one line, naming what is missing).
    """
    if config.speculative_method != "mtp":
        return 0
    num = getattr(arch.family, "num_nextn_predict_layers", 0)
    if not num:
        has_key = hasattr(arch.family, "num_nextn_predict_layers")
        raise ValueError(
            f"--speculative-method mtp needs multi-token-prediction layers: "
            f"{'num_nextn_predict_layers is 0 in' if has_key else 'no MTP layers for'} "
            f"{arch.architecture} in {config.model}'s config.json (DeepSeek-V2/V3 checkpoints "
            f"with num_nextn_predict_layers >= 1 have them); use --speculative-method ngram or "
            f"draft")
    return num


def _load_draft_model(path: str, dtype: torch.dtype, *, target, max_model_len: int):
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


def _check_hybrid_supported(config: EngineConfig, *, has_full_group: bool) -> None:
    """Refuse what does not know about several KV cache groups yet (a model with sliding
    layers, :func:`atom.kv_cache_spec.kv_cache_groups`): a draft model's forward (a separate
    model, or the target's first layers) reads one table. KV events name each group's blocks
    (:mod:`atom.core.block_manager`), but a hit needs a full group's chain: a model whose every
    layer slides has none. (P/D moves every group's blocks: :mod:`atom.core.kv_connector`.)

    Raises:
        ValueError: speculative_method draft is set, or KV events without a full group.
    """
    for name, on in (("KV events (kv_events_endpoint or cache_aware routing)",
                      not has_full_group and config.resolved_kv_events() is not None),
                     ("a draft model (speculative_method draft)",
                      config.speculative_method == "draft")):
        if on:
            raise ValueError(f"{name} does not support a model with sliding-window layers "
                             "(hybrid KV cache groups) yet: turn it off for this model")


def _start_kv_connector(config: EngineConfig, runner: ModelRunner, dp_rank: int,
                        layout: KVLayout):
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
