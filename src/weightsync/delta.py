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
import math
from collections.abc import Iterator, Sequence
from typing import Literal, TypeAlias

import msgspec
import numpy as np
import torch

from weightsync.checksum import combine_shares, content_digest, tensor_hashes
from weightsync.digest import Pending, box_share
from weightsync.dtypes import dtype_from_name, dtype_name
from weightsync.errors import ConfigError, PlanError
from weightsync.messages import Piece, Plan, TensorShare, TensorSpec
from weightsync.pack import byte_view
from weightsync.patch import BITS, NATIVE, NATIVE_SIZES, crc_room, element_bits, encode, joined_crc, native_threads
from weightsync.plan import INDEX_BYTES, dense_nbytes, pack_segments, tensor_nbytes
from weightsync.source import Exchanges, Held, ShardedSource, SourceLayout, TensorMeta, WeightSource

__all__ = [
    "DENSE_FRACTION",
    "Baseline",
    "Diff",
    "Placed",
    "RankDiff",
    "Step",
    "patch_element_bytes",
    "patch_plan",
    "rank_diff",
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
    hashes: tuple[int | None, ...] = ()
    """Each tensor's CRC32C as it now is, where the diff's pass gave it (else None)."""

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


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """Where a trainer rank's box of a tensor sits in the whole tensor (a sharded push with
    delta): its patch names elements by their flat index in the whole tensor, so that every
    rank's patch of it joins into one (`deliveries`)."""

    start: tuple[int, ...]
    """The box's first element along each of its leading dimensions (`source.Held`)."""
    extents: tuple[int, ...]
    whole: tuple[int, ...]
    """The whole tensor's shape."""

    def whole_indices(self, local: np.ndarray) -> np.ndarray:
        """The flat indices in the whole tensor of the box's elements at flat `local` (int64)."""
        lead = len(self.start)
        local = local.astype(np.int64)
        if lead == 0:
            return local
        inner = math.prod(self.whole[lead:])
        row, rest = np.divmod(local, inner)
        if lead == 1:
            flat: np.ndarray = (row + self.start[0]) * inner + rest
            return flat
        coords = np.unravel_index(row, self.extents)
        moved = tuple(coord + first for coord, first in zip(coords, self.start, strict=True))
        flat = np.ravel_multi_index(moved, self.whole[:lead]) * inner + rest
        return flat


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

    def diff(self, specs: Sequence[TensorSpec], source: WeightSource, placed: Sequence[Placed] | None = None) -> Diff:
        """Diff `source` (tensors as `specs` send them) against the baseline, which becomes the
        new version. A changed tensor set, shape or dtype makes every tensor dense (no base).
        `placed`: the tensors are a trainer rank's boxes of whole ones, placed so; every patch
        is then sparse, in the whole tensor's indices, and the new version's digest is left to
        the caller (`label`: the ranks' shares make it)."""
        return self._take(specs, source, compare=True, placed=placed)

    def refresh(
        self, specs: Sequence[TensorSpec], source: WeightSource, placed: Sequence[Placed] | None = None
    ) -> Diff:
        """Make `source` the baseline without comparing (a push that goes full to everyone, so
        that the next one can be a patch): a copy. The result offers no patch (no base)."""
        return self._take(specs, source, compare=False, placed=placed)

    def label(self, content: str) -> None:
        """The content digest of the version the baseline now holds, found by the caller (a
        rank's baseline holds boxes: every rank's shares make the whole version's)."""
        self._content = Pending.now(content)

    def _holds(self, spec: TensorSpec) -> bool:
        """Whether the baseline has tensor `spec` in its shape and wire dtype."""
        old = self.tensors.get(spec.name)
        return old is not None and tuple(old.shape) == spec.shape and old.dtype == dtype_from_name(spec.dtype)

    def _take(
        self, specs: Sequence[TensorSpec], source: WeightSource, compare: bool, placed: Sequence[Placed] | None
    ) -> Diff:
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
        for index, (spec, (name, tensor)) in enumerate(zip(specs, source.tensors(), strict=True)):
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
                if placed is None:
                    patch_spec, payload = encode(indices, values, old.numel(), spec, self._patches.take)
                else:
                    patch_spec, payload = self._sparse(spec, placed[index].whole_indices(indices), values)
                num_changed = indices.size
            hashes.append(crc)
            patched.append(patch_spec)
            # dense: the baseline itself (ours, not the caller's, which may change)
            payloads.append(old if payload is None else torch.from_numpy(payload))
            changed += num_changed
            total += old.numel()
        if placed is not None:
            pass  # boxes: the caller labels the version (`label`)
        elif None in hashes:
            self._content = _digest_later(specs, [self.tensors[spec.name] for spec in specs])
        else:  # every tensor hashed by its diff
            self._content = Pending.now(content_digest(specs, [crc for crc in hashes if crc is not None]))
        return Diff(base, self._content, tuple(patched), tuple(payloads), changed, total, full_bytes, tuple(hashes))

    def _sparse(self, spec: TensorSpec, indices: np.ndarray, values: np.ndarray) -> tuple[TensorSpec, np.ndarray]:
        """A sparse patch of `spec`'s changed elements at `indices` (of the whole tensor)."""
        patched = msgspec.structs.replace(spec, encoding="sparse", count=indices.size)
        payload = self._patches.take(tensor_nbytes(patched))
        head = indices.size * INDEX_BYTES
        payload[:head].view(np.int32)[:] = indices
        payload[head:] = values
        return patched, payload

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


def _box_spec(spec: TensorSpec, box: Held | None) -> TensorSpec:
    """`spec` as the box `box` of it that a rank holds (no elements where it holds none)."""
    if box is None:
        shape: tuple[int, ...] = (0,)
    else:
        shape = tuple(stop - first for first, stop in box) + spec.shape[len(box) :]
    return msgspec.structs.replace(spec, shape=shape)


def _placed(spec: TensorSpec, box: Held | None) -> Placed:
    if not box:
        return Placed((), (), spec.shape)
    return Placed(tuple(first for first, _ in box), tuple(stop - first for first, stop in box), spec.shape)


def patch_element_bytes(spec: TensorSpec) -> int:
    """What one changed element costs in a sparse patch of `spec`: its index and its value."""
    return INDEX_BYTES + dtype_from_name(spec.dtype).itemsize


class _Held:
    """What a rank holds of each tensor (`ShardedSource.held`) as a source of its boxes (an
    empty tensor where it holds none), for its baseline."""

    def __init__(self, specs: Sequence[TensorSpec], boxes: Sequence[Held | None], source: ShardedSource) -> None:
        self._specs, self._boxes, self._source = specs, boxes, source

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(spec.name, spec.shape, dtype_from_name(spec.source_dtype)) for spec in self._specs]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec, box, (name, tensor) in zip(self._specs, self._boxes, self._source.held(), strict=True):
            yield name, tensor if box is not None else torch.empty(0, dtype=dtype_from_name(spec.source_dtype))


def patch_plan(specs: Sequence[TensorSpec], counts: Sequence[Sequence[int]], bucket_bytes: int) -> Plan:
    """The plan of a sharded push's patches: each tensor of `specs` as one sparse patch of every
    rank's changes (`counts[rank][tensor]`), indices in rank order, then values in rank order;
    the buckets of part m carry rank m's indices and values of every tensor. The same on every
    rank, from the counts the ranks exchanged."""
    patches = [
        msgspec.structs.replace(spec, encoding="sparse", count=sum(row[index] for row in counts))
        for index, spec in enumerate(specs)
    ]
    buckets: list[tuple[Piece, ...]] = []
    parts = []
    for rank, row in enumerate(counts):
        parts.append(len(buckets))
        segments = []
        for index, patch in enumerate(patches):
            before, count, size = (
                sum(r[index] for r in counts[:rank]),
                row[index],
                patch_element_bytes(patch) - INDEX_BYTES,
            )
            if rank == 0 and patch.count == 0:
                segments.append((index, 0, 0))
            if count:
                segments.append((index, before * INDEX_BYTES, count * INDEX_BYTES))
                segments.append((index, patch.count * INDEX_BYTES + before * size, count * size))
        buckets += pack_segments(segments, bucket_bytes)
    total = sum(tensor_nbytes(patch) for patch in patches)
    return Plan(bucket_bytes, tuple(patches), tuple(buckets), total, tuple(parts))


@dataclasses.dataclass(frozen=True, slots=True)
class RankDiff:
    """One trainer rank's diff in a sharded push with delta, once the ranks exchanged theirs."""

    base: str
    """The content digest of the version the patches apply to (every rank's baseline's label)."""
    counts: tuple[tuple[int, ...], ...]
    """Every rank's changes to each tensor, in rank order (`patch_plan`)."""
    payloads: tuple[torch.Tensor, ...]
    """This rank's patch of each tensor: sparse, in the whole tensor's indices."""
    shares: tuple[TensorShare, ...]
    """This rank's shares of the new version's hash (`digest.box_share`)."""
    worth_it: bool
    """Every rank diffed against the base, and the joined patches carry at most `DENSE_FRACTION`
    of the full version's bytes: the same answer on every rank."""
    changed_fraction: float


def rank_diff(
    baseline: Baseline,
    specs: Sequence[TensorSpec],
    layout: SourceLayout,
    source: Exchanges,
    compare: bool,
    timeout: float,
) -> RankDiff:
    """Diff what this rank of `layout` holds of `source` (tensors as `specs` send them, whole)
    against its `baseline` of it (`compare`; else copy it there), then exchange with every rank
    its patches' sizes and its shares of the new version's hash: one plan, and one content
    digest, which labels every rank's baseline. A collective: every rank calls it at the same
    point of a push.

    Raises:
        CollectiveError: a rank did not get to the exchange within `timeout`.
        ConfigError: the exchange reached other ranks than those of `layout`.
    """
    boxes = [held[layout.rank] for held in layout.held]
    box_specs = [_box_spec(spec, box) for spec, box in zip(specs, boxes, strict=True)]
    placed = [_placed(spec, box) for spec, box in zip(specs, boxes, strict=True)]
    held = _Held(box_specs, boxes, source)  # type: ignore[arg-type]  # an Exchanges is a ShardedSource
    diff = (baseline.diff if compare else baseline.refresh)(box_specs, held, placed)
    shares = [
        box_share(spec, box, spec.name, baseline.tensors[spec.name], crc)
        for spec, box, crc in zip(specs, boxes, diff.hashes, strict=True)
    ]
    counts = [spec.count if diff.base else 0 for spec in diff.specs]
    every = source.exchange([int(bool(diff.base)), *counts, *(entry.share for entry in shares)], timeout)
    if len(every) != layout.world:
        raise ConfigError(f"{len(every)} ranks exchanged their patch sizes; the push is from {layout.world}")
    n = len(specs)
    baseline.label(
        combine_shares(
            [[msgspec.structs.replace(e, share=row[1 + n + i]) for i, e in enumerate(shares)] for row in every]
        )
    )
    rows = tuple(tuple(row[1 : 1 + n]) for row in every)
    patch_bytes = sum(count * patch_element_bytes(spec) for row in rows for spec, count in zip(specs, row, strict=True))
    worth_it = all(row[0] for row in every) and patch_bytes <= DENSE_FRACTION * sum(map(dense_nbytes, specs))
    total = sum(math.prod(spec.shape) for spec in specs)
    return RankDiff(diff.base, rows, diff.payloads, tuple(shares), worth_it, sum(map(sum, rows)) / max(1, total))
