"""A model's checkpoint tensors by Hugging Face name, read when the model asks for them.

:class:`Checkpoint` is the :class:`atom.layers.weights.WeightSource` the loader hands the model:
over safetensors files it reads nothing up front (``safe_open`` maps the files) and each tensor
when it is asked for, cast to the run dtype, and :meth:`Checkpoint.rows` reads only a slice of a
tensor's first dimension. So a rank under expert parallelism never holds the other ranks'
experts, whichever layout the checkpoint has (:func:`atom.layers.weights.read_experts`), and the
load's peak is the model plus one tensor, not the model twice. Tensors already in memory (the
dequantized GGUF, tests) go through the same interface.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Mapping, Sequence

import torch


class Checkpoint(Mapping):
    """Tensors by name, float ones in ``dtype`` (None: as stored), read on access.

    Build with :meth:`from_tensors` or :meth:`from_safetensors`. A ``Mapping[str, Tensor]``:
    ``checkpoint[name]`` reads the whole tensor; :meth:`rows` a slice of it.
    """

    def __init__(self, *, tensors: Mapping[str, torch.Tensor] | None = None,
                 files: Sequence[pathlib.Path] = (), dtype: torch.dtype | None = None) -> None:
        self._tensors = dict(tensors or {})
        self._handles: dict[str, object] = {}  # name -> its file's safe_open handle
        self.dtype = dtype
        if files:
            from safetensors import safe_open

            for file in files:
                handle = safe_open(str(file), framework="pt")
                for name in handle.keys():
                    self._handles[name] = handle

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor],
                     dtype: torch.dtype | None = None) -> Checkpoint:
        return tensors if isinstance(tensors, Checkpoint) else cls(tensors=tensors, dtype=dtype)

    @classmethod
    def from_safetensors(cls, files: Sequence[pathlib.Path], dtype: torch.dtype) -> Checkpoint:
        """Over ``*.safetensors`` files (memory-mapped; nothing read yet).

        Raises:
            FileNotFoundError: no files.
        """
        if not files:
            raise FileNotFoundError("no *.safetensors files; save the model with "
                                    "save_pretrained(..., safe_serialization=True)")
        return cls(files=files, dtype=dtype)

    @property
    def device(self) -> torch.device:
        """Where tensors come out: the in-memory tensors' device, the CPU for files."""
        first = next(iter(self._tensors.values()), None)
        return torch.device("cpu") if first is None else first.device

    def __iter__(self) -> Iterator[str]:
        yield from self._tensors
        yield from self._handles

    def __len__(self) -> int:
        return len(self._tensors) + len(self._handles)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors or name in self._handles

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._tensors:
            return self._cast(self._tensors[name])
        return self._cast(self._handles[name].get_tensor(name))

    def rows(self, name: str, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of ``name``'s first dimension; from a file only those bytes
        are read."""
        if name in self._tensors:
            return self._cast(self._tensors[name][start:end])
        return self._cast(self._handles[name].get_slice(name)[start:end])

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Float tensors in ``dtype``; integer ones (MXFP4 blocks and scales) as stored."""
        if self.dtype is None or not tensor.is_floating_point():
            return tensor
        return tensor.to(self.dtype)
