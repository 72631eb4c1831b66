"""Two-batch overlap (TBO): one step's batch as two micro-batches whose MoE collectives overlap
the other micro-batch's compute.

The idea is DeepSeek's (DeepSeek-V3 technical report, arXiv:2412.19437, "dual micro-batch
overlap"; SGLang's ``two_batch_overlap``): while micro-batch 0's tokens travel to the ranks that
own their experts, micro-batch 1 runs its attention, and so on, layer after layer.

Each micro-batch's forward is a *program*: a generator that runs the model's stages (from the
outside: :meth:`DecoderLayer.attention_stage <atom.layers.decoder.DecoderLayer.attention_stage>`,
then the MoE layer's :meth:`~atom.layers.moe.MoE.forward_overlapped`: dispatch, route, experts,
combine) and yields right after it starts an async collective. :func:`run_interleaved` resumes the programs round-robin,
waiting for a program's collective only when it is that program's turn again. Every rank runs
the same two programs in the same order, so the collectives are issued in the same order
everywhere: dispatch(mb0, L), dispatch(mb1, L), combine(mb0, L), combine(mb1, L), for L = 0, 1, ...

How a batch is split, and whether it may be, is :mod:`atom.core.tbo_split` (torch-free: the
engine core and the simulator decide with it too).

On one CPU, gloo's I/O thread shares the cores with the compute; expect agreement and equal
results here, not a speed-up (docs/PERFORMANCE.md has the measured effect).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from atom.kernels.attention import AttentionMetadata


class Waitable(Protocol):
    def wait(self) -> None: ...


def run_interleaved(programs: Sequence[Iterator[Waitable]]) -> None:
    """Run micro-batch programs to completion, overlapping each one's collectives with the
    others' compute (module docstring). A program yields a handle after starting an async
    collective; it is resumed (after ``handle.wait()``) when its turn comes round again.

    Raises:
        Whatever a program or a ``wait()`` raises (e.g. CollectiveError); the other programs
        are then left unfinished.
    """
    ready = collections.deque((program, None) for program in programs)
    while ready:
        program, handle = ready.popleft()
        if handle is not None:
            handle.wait()
        try:
            handle = next(program)
        except StopIteration:
            continue
        ready.append((program, handle))


class MicroBatch:
    """One micro-batch's model inputs and, once run, its final hidden states."""

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata):
        self.input_ids = input_ids
        self.positions = positions
        self.attn_metadata = attn_metadata
        self.hidden: torch.Tensor | None = None  # [T, hidden] after the final norm


def forward_micro_batches(model, micro_batches: Sequence[MicroBatch]) -> None:
    """The model's forward on each micro-batch, interleaved; sets each ``hidden``.

    ``model`` is a :class:`atom.layers.decoder.DecoderForCausalLM` (every family): embeddings,
    ``layers`` with ``attention_stage`` and an ``mlp`` (dense or :class:`MoE`), final ``norm``.
    """
    run_interleaved([_model_program(model, mb) for mb in micro_batches])


def _model_program(model, mb: MicroBatch) -> Iterator[Waitable]:
    from atom.layers.moe import MoE

    x = model.embed(mb.input_ids)
    cos = model.rope_cos.index_select(0, mb.positions)
    sin = model.rope_sin.index_select(0, mb.positions)
    for layer in model.layers:
        x, h = layer.attention_stage(x, cos, sin, mb.attn_metadata)
        mlp = layer.mlp
        x = x + ((yield from mlp.forward_overlapped(h)) if isinstance(mlp, MoE) else mlp(h))
    mb.hidden = model.norm(x)


