"""Delta sync: send a receiver only the elements whose wire bits changed since the version it holds.

The sender keeps a baseline: the wire bytes of its last push, one copy of the model in the wire
dtype, in host memory (a 2 GiB bf16 model costs 2 GiB of host RAM), plus that version's content
digest. Each push with `delta=True` diffs every tensor, as sent (after any cast), bitwise against
the baseline, updates the baseline in place (one native pass per tensor, `_native/deltadiff.c`,
which also hashes the new version for the content digest; numpy where it is not built), and encodes each tensor's changes the cheapest way (sparse, bitmap
or dense: patch.py).

The patch is an ordinary `Plan` whose tensors carry an `encoding`, so it is bucketed, chunked,
checksummed and landed like any sync. A receiver gets it only if it holds exactly the baseline
(its content digest equals the baseline's); everyone else gets the full version in the same
push. The receiver applies each patch in place into its destination (`apply_patch`) and, before
committing, hashes every destination whole: the content digest of the full new weights must equal
the sender's, or the sync fails with ChecksumError and the receiver's next push is full.

Which receivers may get a patch is declared, never measured: with `delta=True`, those reached
over a network transport (tcp, collective, nixl), where a patch arrives sooner than the full
version; with `delta="all"`, every receiver. Over shared memory a diff costs more than the whole
push (docs/delta.md has both measurements).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Literal, TypeAlias

import numpy as np
import torch

from weightsync.checksum import content_digest, tensor_hashes
from weightsync.digest import Pending
from weightsync.dtypes import dtype_from_name, dtype_name
from weightsync.errors import PlanError
from weightsync.messages import TensorSpec
from weightsync.pack import byte_view
from weightsync.patch import BITS, NATIVE, NATIVE_SIZES, crc_room, element_bits, encode, joined_crc, native_threads
from weightsync.plan import dense_nbytes, tensor_nbytes
from weightsync.source import TensorMeta, WeightSource

__all__ = [
    "DENSE_FRACTION",
    "Baseline",
    "Diff",
    "Step",
]

DENSE_FRACTION = 0.5
"""A push whose patches would carry more than this fraction of the full model goes full: the diff
would not pay for itself."""

CHUNK_ELEMENTS = 1 << 20
"""The numpy path's elements compared at a time: the comparison, the indices and the baseline
update of a chunk run while it is in cache (several times torch's speed for these ops here)."""


_CAST_BF16 = (torch.float32, torch.bfloat16)
"""The cast the native diff does in the same pass (fp32 master weights sent as bf16)."""


def _update(new: torch.Tensor, old: torch.Tensor) -> np.ndarray:
    """Copy `new` into `old` (same shape and dtype, CPU), chunk by chunk; the flat indices of the
    elements whose bits changed (int64). The numpy path: where the native diff is not built."""
    fresh, base = element_bits(new), element_bits(old)
    changed = np.empty(min(fresh.size, CHUNK_ELEMENTS), dtype=np.bool_)
    found = []
    for start in range(0, fresh.size, CHUNK_ELEMENTS):
        stop = min(start + CHUNK_ELEMENTS, fresh.size)
        mask = changed[: stop - start]
        np.not_equal(fresh[start:stop], base[start:stop], out=mask)
        if np.count_nonzero(mask):
            found.append(np.flatnonzero(mask) + start)
            base[start:stop] = fresh[start:stop]
    return np.concatenate(found) if found else np.empty(0, dtype=np.int64)


def _digest_later(specs: Sequence[TensorSpec], tensors: list[torch.Tensor]) -> Pending[str]:
    """The content digest of `tensors`, computed on a thread of its own: the whole-model hash
    then runs while the push's offer and buckets go out (its commit is the first to need it).
    The tensors (the baseline) stay unchanged until the next diff, which waits for it."""
    return Pending.later(lambda: content_digest(specs, tensor_hashes([byte_view(t) for t in tensors])))


def _check_yielded(spec: TensorSpec, name: str, tensor: torch.Tensor) -> None:
    if name != spec.name or tuple(tensor.shape) != spec.shape or dtype_name(tensor.dtype) != spec.source_dtype:
        raise PlanError(
            f"source yielded {name!r} {tensor.dtype}{list(tensor.shape)} where its metadata promised "
            f"{spec.name!r} {spec.source_dtype}{list(spec.shape)}"
        )


def _copy(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of `tensor` in `dtype`, contiguous, in host memory: the baseline's own, whatever the
    caller does next. Ordinary pages: huge ones (`hostmem.host_bytes`) filled twice as fast on an
    idle host, but stalled 3x slower on compaction on a busy one."""
    out = torch.empty(tensor.shape, dtype=dtype)
    out.copy_(tensor.detach())
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class Diff:
    """One push's view of what changed since the baseline it was diffed against."""

    base: str
    """The content digest of the previous baseline (what a delta receiver must hold), or ""."""
    pending_content: Pending[str]
    """The content digest of the new version (every tensor whole, as sent), computed while the
    push's buckets go out: `content` waits for it."""
    specs: tuple[TensorSpec, ...]
    """The patch plan's tensors (encodings and counts)."""
    payloads: tuple[torch.Tensor, ...]
    """Each tensor's payload: a flat uint8 patch, or the whole tensor (dense). Both are the
    baseline's memory, valid until its next `diff`."""
    changed_elements: int
    total_elements: int
    full_bytes: int

    @property
    def content(self) -> str:
        return self.pending_content.get()

    @property
    def patch_bytes(self) -> int:
        return sum(tensor_nbytes(spec) for spec in self.specs)

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    @property
    def worth_it(self) -> bool:
        """Whether a receiver at the base should get the patch rather than the full version."""
        return bool(self.base) and self.patch_bytes <= DENSE_FRACTION * self.full_bytes

    def patch_source(self) -> WeightSource:
        """The patches as a source for `bucket_items` (uint8 payloads; dense ones as they are)."""
        return _Tensors(list(zip((spec.name for spec in self.specs), self.payloads, strict=True)))


Step: TypeAlias = Literal["diff", "refresh", "plain"]
"""What a push does (`deliveries.DeliveryPlanner`):

    diff     diff against the baseline: receivers that may take a patch and hold the baseline
             get the patch, the others the full version (verified)
    refresh  copy the new version into the baseline and push it full, verified: its receivers
             then hold a base for the next push's patch
    plain    push as without delta (no receiver may take a patch)
"""


class _Tensors:
    """Named tensors already in memory, as a `WeightSource`."""

    def __init__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self._items = items

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(name, tuple(payload.shape), payload.dtype) for name, payload in self._items]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._items)


class _Arena:
    """Memory for one push's patches, reused push after push: fresh buffers would pay their page
    faults every time (about a third of the diff's time at 1 GiB, 3% changed). A bump allocator;
    what does not fit gets a buffer of its own."""

    ALIGN = 64

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)
        self._used = 0

    def reset(self, full_bytes: int) -> None:
        """Free everything taken so far (the previous push's patches are no longer in use) and
        make room for patches up to the point where a push goes full anyway."""
        wanted = int(DENSE_FRACTION * full_bytes) + self.ALIGN
        if self._buffer.size < wanted:
            self._buffer = np.empty(wanted, dtype=np.uint8)
        self._used = 0

    def take(self, nbytes: int) -> np.ndarray:
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if start + nbytes > self._buffer.size:
            return np.empty(nbytes, dtype=np.uint8)
        self._used = start + nbytes
        return self._buffer[start : self._used]


class Baseline:
    """The sender's copy of its last push, in the wire dtype, in host memory.

    Costs one copy of the model as sent (2 bytes per element for a bf16 push). `diff` compares
    a new version against it, replaces it with the new version, and says what changed.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._content: Pending[str] = Pending.now("")
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._indices = np.empty(0, dtype=np.int32)
        self._values = np.empty(0, dtype=np.uint8)
        self._patches = _Arena()

    @property
    def content(self) -> str:
        """The content digest of the version it holds, or "" before the first push."""
        return self._content.get()

    def diff(self, specs: Sequence[TensorSpec], source: WeightSource) -> Diff:
        """Diff `source` (tensors as `specs` send them) against the baseline, which becomes the
        new version. A changed tensor set, shape or dtype makes every tensor dense (no base)."""
        return self._take(specs, source, compare=True)

    def refresh(self, specs: Sequence[TensorSpec], source: WeightSource) -> Diff:
        """Make `source` the baseline without comparing (a push that goes full to everyone, so
        that the next one can be a patch): a copy. The result offers no patch (no base)."""
        return self._take(specs, source, compare=False)

    def _holds(self, spec: TensorSpec) -> bool:
        """Whether the baseline has tensor `spec` in its shape and wire dtype."""
        old = self.tensors.get(spec.name)
        return old is not None and tuple(old.shape) == spec.shape and old.dtype == dtype_from_name(spec.dtype)

    def _take(self, specs: Sequence[TensorSpec], source: WeightSource, compare: bool) -> Diff:
        same_layout = [spec.name for spec in specs] == list(self.tensors) and all(map(self._holds, specs))
        held = self.content  # waits for the last push's digest: it reads what this overwrites
        base = held if same_layout and compare else ""
        self._content = Pending.now("")  # until the new version is whole
        if not same_layout:
            self.tensors = {}
        full_bytes = sum(dense_nbytes(spec) for spec in specs)
        self._patches.reset(full_bytes)
        patched: list[TensorSpec] = []
        payloads: list[torch.Tensor] = []
        hashes: list[int | None] = []
        changed = total = 0
        for spec, (name, tensor) in zip(specs, source.tensors(), strict=True):
            _check_yielded(spec, name, tensor)
            old = self.tensors.get(name)
            crc = None
            if old is None or old.element_size() not in BITS:
                old = self.tensors[name] = _copy(tensor, dtype_from_name(spec.dtype))
                patch_spec, payload, num_changed = spec, None, old.numel()
            elif not compare:
                old.copy_(tensor.detach())
                patch_spec, payload, num_changed = spec, None, old.numel()
            else:
                indices, values, crc = self._changes(tensor, old)
                patch_spec, payload = encode(indices, values, old.numel(), spec, self._patches.take)
                num_changed = indices.size
            hashes.append(crc)
            patched.append(patch_spec)
            # dense: the baseline itself (ours, not the caller's, which may change)
            payloads.append(old if payload is None else torch.from_numpy(payload))
            changed += num_changed
            total += old.numel()
        if None in hashes:
            self._content = _digest_later(specs, [self.tensors[spec.name] for spec in specs])
        else:  # every tensor hashed by its diff
            self._content = Pending.now(content_digest(specs, [crc for crc in hashes if crc is not None]))
        return Diff(base, self._content, tuple(patched), tuple(payloads), changed, total, full_bytes)

    def _changes(self, tensor: torch.Tensor, old: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int | None]:
        """Update `old` (the baseline) to `tensor` as sent; the flat indices of the elements whose
        bits changed, their new bits (bytes), and the new version's CRC32C where the pass gave it.
        Views of scratch buffers: valid until the next call. One native pass where it is built
        (an fp32 source cast to bf16 in the same pass, and hashed), else numpy's (not hashed)."""
        numel, size = old.numel(), old.element_size()
        if NATIVE is None or size not in NATIVE_SIZES or numel >= 1 << 31:
            new = self._as_sent(tensor, old.dtype)
            indices = _update(new, old)
            return indices, np.take(element_bits(new), indices).view(np.uint8), None
        indices, values = self._outputs(numel, size)
        source, crcs, threads = tensor.detach(), crc_room(), native_threads()
        if source.device.type == "cpu" and source.is_contiguous() and (source.dtype, old.dtype) == _CAST_BF16:
            count = NATIVE.cast_diff(element_bits(source), element_bits(old), indices, values, threads, crcs)
        else:
            new = self._as_sent(source, old.dtype)
            count = NATIVE.diff(element_bits(new), element_bits(old), size, indices, values, threads, crcs)
        return indices[:count], values[: count * size], joined_crc(crcs)

    def _outputs(self, numel: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Scratch for the native diff's output, room for every element of the largest tensor:
        only the pages the changes touch are ever faulted in."""
        if self._indices.size < numel:
            self._indices = np.empty(numel, dtype=np.int32)
        if self._values.size < numel * size:
            self._values = np.empty(numel * size, dtype=np.uint8)
        return self._indices, self._values

    def _as_sent(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`tensor` in the wire dtype, contiguous, in host memory: itself where it already is,
        else cast into a scratch buffer kept across pushes (a fresh one would pay its page
        faults every time, more than the cast itself)."""
        tensor = tensor.detach()
        if tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.is_contiguous():
            return tensor
        nbytes = tensor.numel() * dtype.itemsize
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        out = self._scratch[:nbytes].view(dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    def source(self) -> WeightSource:
        """The baseline's tensors (the version last diffed), as a source for a full push."""
        return _Tensors(list(self.tensors.items()))

    @property
    def nbytes(self) -> int:
        """Host memory the baseline holds."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
