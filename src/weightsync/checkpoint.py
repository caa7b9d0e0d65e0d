"""A WeightSource over a safetensors checkpoint directory, read one tensor at a time.

`metas()` reads only the headers; `tensors()` loads each tensor just before the sender needs it,
so pushing a checkpoint never holds more than one tensor of it in memory; `boxes(specs)` reads
only the boxes a receiver keeps (a tensor-parallel worker's), as slices of the files.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from weightsync.errors import ConfigError
from weightsync.messages import TensorSpec
from weightsync.source import TensorMeta

__all__ = ["SafetensorsSource"]

_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsSource:
    """The tensors of every `*.safetensors` file in `model_dir` (shards in index order)."""

    def __init__(self, model_dir: str | Path) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        self._files = _shard_files(Path(model_dir))
        self._metas: list[tuple[Path, TensorMeta]] = []
        for path in self._files:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    piece = handle.get_slice(name)
                    dtype = _DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise ConfigError(f"{path.name}: {name!r} has unsupported dtype {piece.get_dtype()}")
                    self._metas.append((path, TensorMeta(name, tuple(piece.get_shape()), dtype)))

    def metas(self) -> list[TensorMeta]:
        return [meta for _, meta in self._metas]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self._files:
            with self._safe_open(path, framework="pt") as handle:
                for file, meta in self._metas:
                    if file == path:
                        yield meta.name, handle.get_tensor(meta.name)

    def boxes(self, specs: Sequence[TensorSpec]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each of `specs` (a whole tensor, or a box of one) in order, a box read as a slice: no
        whole tensor is built for it."""
        files = {meta.name: path for path, meta in self._metas}
        with contextlib.ExitStack() as stack:
            handles = {path: stack.enter_context(self._safe_open(path, framework="pt")) for path in self._files}
            for spec in specs:
                handle = handles[files[spec.name]]
                if spec.region is None:
                    yield spec.name, handle.get_tensor(spec.name)
                else:
                    box = tuple(slice(a, a + n) for a, n in zip(spec.region.start, spec.shape, strict=True))
                    yield spec.name, handle.get_slice(spec.name)[box]


def _shard_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        raise ConfigError(f"{model_dir}: no such folder")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no *.safetensors checkpoint")
    return files
