"""Delta sync: send a receiver only the elements whose wire bits changed since the version it holds.

The sender keeps a baseline: the wire bytes of its last push, one copy of the model in the wire
dtype, in host memory (a 2 GiB bf16 model costs 2 GiB of host RAM), plus that version's content
digest. Each push with `delta=True` diffs every tensor, as sent (after any cast), bitwise against
the baseline, updates the baseline in place (one native pass per tensor, `_native/deltadiff.c`;
numpy where it is not built), and encodes each tensor the cheapest way:

    sparse   count int32 indices, then count values      4 + itemsize bytes per changed element
    bitmap   one bit per element, then count values       numel / 8 + itemsize per changed element
    dense    every element                                numel * itemsize

The patch is an ordinary `Plan` whose tensors carry an `encoding`, so it is bucketed, chunked,
checksummed and landed like any sync. A receiver gets it only if it holds exactly the baseline
(its content digest equals the baseline's); everyone else gets the full version in the same
push. The receiver applies each patch in place into its destination (`apply_patch`) and, before
committing, hashes every destination whole: the content digest of the full new weights must equal
the sender's, or the sync fails with ChecksumError and the receiver's next push is full.

A diff is paid before anything is sent; `Costs` keeps what the last ones measured, so that the
sender skips a diff that would not arrive sooner than the full version (`delta_policy="faster"`):
a diff measured as not paying is abandoned after its first eighth, and the pushes that go
without a diff keep measuring on a sample of the tensors, diffed as they are packed.
"""

from __future__ import annotations

import dataclasses
import math
import time
import types
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeAlias

import msgspec
import numpy as np
import torch

from weightsync.checksum import HASH_TIMEOUT_S, content_digest, tensor_digests
from weightsync.dtypes import dtype_from_name, dtype_name
from weightsync.errors import PlanError
from weightsync.pack import byte_view
from weightsync.plan import INDEX_BYTES, dense_nbytes, tensor_nbytes
from weightsync.source import TensorMeta, WeightSource
from weightsync.types import TensorSpec

__all__ = [
    "DENSE_FRACTION",
    "GATE_FRACTION",
    "SAMPLE_FRACTION",
    "Baseline",
    "Costs",
    "Diff",
    "Sample",
    "Step",
    "apply_patch",
    "sample_names",
    "settled",
]

DENSE_FRACTION = 0.5
"""A push whose patches would carry more than this fraction of the full model goes full: the diff
would not pay for itself."""

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""An integer dtype per element size: elements are compared by their bits (NaN payloads, -0.0)."""


CHUNK_ELEMENTS = 1 << 20
"""The numpy path's elements compared at a time: the comparison, the indices and the baseline
update of a chunk run while it is in cache (several times torch's speed for these ops here)."""


_NP_BITS: dict[int, type[np.integer[Any]]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

_deltadiff: types.ModuleType | None
try:
    from weightsync._native import deltadiff as _deltadiff
except ImportError:  # built without a C compiler: numpy does the diff, several times slower
    _deltadiff = None

_NATIVE_SIZES = (2, 4)
"""Element sizes the native diff handles (bf16/fp16 and fp32/int32); others take numpy."""


_CAST_BF16 = (torch.float32, torch.bfloat16)
"""The cast the native diff does in the same pass (fp32 master weights sent as bf16)."""


def _threads() -> int:
    """Threads for the native diff: torch's intra-op count, which the caller already tunes."""
    return max(1, torch.get_num_threads())


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's elements as integers of the same size, no copy (numpy)."""
    return tensor.reshape(-1).view(_BITS[tensor.element_size()]).numpy()


def _update(new: torch.Tensor, old: torch.Tensor) -> np.ndarray:
    """Copy `new` into `old` (same shape and dtype, CPU), chunk by chunk; the flat indices of the
    elements whose bits changed (int64). The numpy path: where the native diff is not built."""
    fresh, base = _bits(new), _bits(old)
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


def _encode(
    indices: np.ndarray, values: np.ndarray, numel: int, spec: TensorSpec, alloc: Callable[[int], np.ndarray]
) -> tuple[TensorSpec, np.ndarray | None]:
    """The cheapest encoding of the changes (flat `indices`, their new bits `values` as bytes) to a
    tensor of `numel` elements: the spec and payload (flat uint8, from `alloc(nbytes)`) of its
    patch, or None where the whole tensor is cheaper (dense)."""
    count = indices.size
    encoding = _cheapest(count, numel, spec)
    if encoding == "dense":
        return spec, None
    if encoding == "sparse":
        head = count * INDEX_BYTES
        payload = alloc(head + values.size)
        payload[:head].view(np.int32)[:] = indices
    else:
        mask = np.zeros(numel, dtype=np.bool_)
        mask[indices] = True
        bitmap = np.packbits(mask, bitorder="little")
        head = bitmap.size
        payload = alloc(head + values.size)
        payload[:head] = bitmap
    payload[head:] = values
    return msgspec.structs.replace(spec, encoding=encoding, count=count), payload


def _cheapest(count: int, numel: int, spec: TensorSpec) -> str:
    """The encoding of a patch changing `count` of a tensor's `numel` elements."""
    return min(_sizes(count, numel, spec).items(), key=lambda item: item[1])[0]


def _patch_nbytes(count: int, numel: int, spec: TensorSpec) -> int:
    """The bytes of that patch on the wire."""
    return int(min(_sizes(count, numel, spec).values()))


def _sizes(count: int, numel: int, spec: TensorSpec) -> dict[str, float]:
    size = dtype_from_name(spec.dtype).itemsize
    sizes = {
        "sparse": count * (INDEX_BYTES + size) if numel < 1 << 31 else math.inf,
        "bitmap": (numel + 7) // 8 + count * size,
        "dense": dense_nbytes(spec),
    }
    # A bitmap costs a pass over every element on both sides, sparse only over the changes: take
    # it only where it halves the bytes (above ~6% changed for bf16).
    if sizes["bitmap"] > sizes["sparse"] / 2:
        del sizes["bitmap"]
    return sizes


def apply_patch(dest: torch.Tensor, spec: TensorSpec, payload: torch.Tensor) -> None:
    """Write the patch `payload` (its uint8 bytes, as planned by `spec`) into `dest` in place.

    Raises:
        PlanError: the payload names elements outside the tensor, or a bitmap's bits disagree
            with its count (a corrupted or hostile patch; checksums catch corruption first).
    """
    numel, count = math.prod(spec.shape), spec.count
    payload = payload.reshape(-1)
    if payload.numel() != tensor_nbytes(spec):
        raise PlanError(f"patch of {spec.name!r} is {payload.numel()} bytes, its plan says {tensor_nbytes(spec)}")
    if count == 0:
        return
    raw = payload.numpy()
    head = count * INDEX_BYTES if spec.encoding == "sparse" else (numel + 7) // 8
    values = _aligned(raw[head:], _NP_BITS[dtype_from_name(spec.dtype).itemsize])
    where: np.ndarray
    if spec.encoding == "sparse":
        where = _aligned(raw[:head], np.int32)
        if int(where.min()) < 0 or int(where.max()) >= numel:
            raise PlanError(f"patch of {spec.name!r} names elements outside its {numel}")
    else:
        where = np.flatnonzero(np.unpackbits(raw[:head], count=numel, bitorder="little"))
        if where.size != count:
            raise PlanError(f"bitmap patch of {spec.name!r} marks {where.size} elements, its plan says {count}")
    if dest.device.type == "cpu":
        _scatter(_bits(dest), where, values)
        return
    flat = dest.view(-1).view(_BITS[dest.element_size()])
    flat[torch.from_numpy(where.astype(np.int64)).to(dest.device)] = torch.from_numpy(values).to(dest.device)


def settled(value: str | Future[str]) -> str:
    """A content digest, waiting (bounded) for one still being computed."""
    return value if isinstance(value, str) else value.result(timeout=HASH_TIMEOUT_S)


def _digest_later(specs: Sequence[TensorSpec], tensors: list[torch.Tensor]) -> Future[str]:
    """The content digest of `tensors`, computed on a thread of its own: the whole-model hash
    then runs while the push's offer and buckets go out (its commit is the first to need it).
    The tensors (the baseline) stay unchanged until the next diff, which waits for it."""
    hashing = ThreadPoolExecutor(1, thread_name_prefix="weightsync-digest")
    try:
        return hashing.submit(lambda: content_digest(specs, tensor_digests([byte_view(t) for t in tensors])))
    finally:
        hashing.shutdown(wait=False)  # the thread ends once the digest is done


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


def _scatter(dest: np.ndarray, where: np.ndarray, values: np.ndarray) -> None:
    """dest[where] = values, natively where built (numpy converts int32 indices to int64 first)."""
    if _deltadiff is not None and where.dtype == np.int32 and dest.itemsize in _NATIVE_SIZES:
        _deltadiff.apply(dest, dest.itemsize, where, values, _threads())
    else:
        np.put(dest, where, values)


def _aligned(raw: np.ndarray, dtype: type[np.integer[Any]]) -> np.ndarray:
    """Bytes as elements of `dtype`: a view where they are aligned for it, else an aligned copy."""
    aligned = raw.ctypes.data % np.dtype(dtype).itemsize == 0
    return (raw if aligned else raw.copy()).view(dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class Diff:
    """One push's view of what changed since the baseline it was diffed against."""

    base: str
    """The content digest of the previous baseline (what a delta receiver must hold), or ""."""
    pending_content: str | Future[str]
    """The content digest of the new version (every tensor whole, as sent), or its computation
    under way: `content` waits for it."""
    specs: tuple[TensorSpec, ...]
    """The patch plan's tensors (encodings and counts)."""
    payloads: tuple[torch.Tensor, ...]
    """Each tensor's payload: a flat uint8 patch, or the whole tensor (dense). Both are the
    baseline's memory, valid until its next `diff`."""
    changed_elements: int
    total_elements: int
    full_bytes: int
    cold: bool = False
    """Memory was allocated on the way (the baseline, scratch, the patch arena): its time says
    more about page faults than about the next push."""

    @property
    def content(self) -> str:
        return settled(self.pending_content)

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


GATE_FRACTION = 1 / 8
"""A diff measured as not paying once this fraction of the model is diffed stops there: the push
goes plain, having spent an eighth of a diff to find out."""

SAMPLE_FRACTION = 1 / 32
"""About this fraction of the model's bytes is diffed on every push that goes without a diff (as
the tensors are packed), so that the sender sees when diffs start to pay again."""


Step: TypeAlias = Literal["diff", "refresh", "plain"]
"""What a push with delta=True does (`Costs.next_step`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """What diffing part of the model measured."""

    seconds: float
    nbytes: int
    """The bytes diffed (as sent)."""
    patch_bytes: int
    """The bytes their patches take."""
    cold: bool
    """Memory was allocated on the way: the time is no measurement."""


@dataclasses.dataclass
class Costs:
    """What the sender's last pushes measured, to decide what the next one does:

        diff     diff against the baseline: receivers holding it get the patch, the others the
                 full version (verified)
        refresh  copy the new version into the baseline and push it full, verified: its
                 receivers then hold a base for the next push's patch
        plain    push as without delta (cast while packing, no baseline, checksums only where
                 asked for), diffing a sample of the tensors on the way to keep measuring

    A diff is paid before anything is sent (the plan names every patch); it pays when the diff
    and the patch's delivery take less than the full version's delivery, over the routes to the
    receivers holding the base:

        diff_s + sum over routes of delta_delivery_s  <  sum over routes of full_delivery_s

    `diff_s` and the patch fraction come from the last warm measurement (a diff, the first eighth
    of one, or the sample a plain push diffs). One that allocated memory on the way (cold: the
    first diff) overstates the cost; it stands in only until a warm one is measured, so that the
    first diff already counts and a route where diffs do not pay stops diffing a push sooner. A route's
    `full_delivery_s` is its last plain full delivery's, or failing that its last verified one's
    (a refresh: slower, which favours the diff); its `delta_delivery_s` is its last patch
    delivery's (the receiver applies and verifies it: it scales with the model, not the patch),
    or failing that the patch's bytes at the full throughput. Anything not measured yet means:
    diff. Once a route has had a measured diff but never a plain delivery, one push goes plain to
    measure it: a verified delivery is no fair measure of what a push without delta costs.
    """

    diff_s_per_byte: float | None = None
    patch_fraction: float | None = None
    full_bytes_per_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per route (transport name): bytes per second of its last plain full delivery."""
    verified_bytes_per_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per route: bytes per second of its last verified full delivery (a refresh)."""
    delta_s_per_byte: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per route: seconds of its last patch delivery per byte of the full model."""
    warm: bool = False
    """Whether `diff_s_per_byte` comes from a warm measurement (a cold one only stands in)."""

    def next_step(self, full_bytes: int, at_base: Sequence[str], reached: Sequence[str], always: bool) -> Step:
        """What a push of `full_bytes` does: `at_base`, the routes to receivers holding the
        baseline; `reached`, the routes to every receiver it reaches; `always`: diff wherever a
        receiver can take a patch, and keep a base (delta_policy="always")."""
        if at_base:
            if always:
                return "diff"
            if self._unchecked(at_base):
                return "plain"
            return "diff" if self.diff_pays(full_bytes, at_base) else "plain"
        return "refresh" if reached and (always or self.diff_pays(full_bytes, reached)) else "plain"

    def _unchecked(self, routes: Sequence[str]) -> bool:
        """A diff and a patch delivery are measured on some route that no plain push measured."""
        measured = self.diff_s_per_byte is not None
        return measured and any(r in self.delta_s_per_byte and r not in self.full_bytes_per_s for r in routes)

    def diff_pays(self, full_bytes: int, routes: Sequence[str]) -> bool:
        """Whether a diff should beat pushing in full to `routes` (the rule above)."""
        if self.diff_s_per_byte is None or self.patch_fraction is None:
            return True
        full_s = delta_s = 0.0
        for route in routes:
            rate = self.full_bytes_per_s.get(route) or self.verified_bytes_per_s.get(route)
            if not rate:
                return True
            full_s += full_bytes / rate
            per_byte = self.delta_s_per_byte.get(route)
            delta_s += per_byte * full_bytes if per_byte is not None else self.patch_fraction * full_bytes / rate
        return self.diff_s_per_byte * full_bytes + delta_s < full_s

    def diff_would_pay(self, part: Sample, full_bytes: int, routes: Sequence[str]) -> bool:
        """Whether a diff pays over `routes` at the pace and patch fraction of `part`, the first
        part of it, warm or cold. A cold part overstates the diff's cost; a diff stopped that would
        have paid costs one plain push, whose sample then measures warm."""
        if part.nbytes <= 0:
            return True
        at_pace = dataclasses.replace(
            self, diff_s_per_byte=part.seconds / part.nbytes, patch_fraction=part.patch_bytes / part.nbytes
        )
        return at_pace.diff_pays(full_bytes, routes)

    def measured(self, sample: Sample) -> None:
        """Take a diff's measurement (a cold one only while no warm one was taken; never an empty one)."""
        if sample.nbytes > 0 and not (sample.cold and self.warm):
            self.diff_s_per_byte = sample.seconds / sample.nbytes
            self.patch_fraction = sample.patch_bytes / sample.nbytes
            self.warm = self.warm or not sample.cold

    def diffed(self, seconds: float, diff: Diff) -> None:
        if diff.base:
            self.measured(Sample(seconds, diff.full_bytes, diff.patch_bytes, diff.cold))

    def delivered(self, route: str, mode: str, full_bytes: int, seconds: float, verified: bool) -> None:
        """A delivery of the version (`full_bytes` as sent) over `route` took `seconds`: a patch
        (`mode="delta"`), or the full version, `verified` for the sake of delta (a refresh)."""
        if full_bytes <= 0 or seconds <= 0:
            return
        if mode == "delta":
            self.delta_s_per_byte[route] = seconds / full_bytes
        elif verified:
            self.verified_bytes_per_s[route] = full_bytes / seconds
        else:
            self.full_bytes_per_s[route] = full_bytes / seconds


def sample_names(specs: Sequence[TensorSpec]) -> frozenset[str]:
    """The tensors a plain push diffs to keep measuring: a stride through the model covering
    about `SAMPLE_FRACTION` of its bytes; the smallest tensor where every one is larger."""
    taken = seen = 0
    names = set()
    for spec in specs:
        nbytes = dense_nbytes(spec)
        seen += nbytes
        if taken + nbytes <= SAMPLE_FRACTION * seen:
            names.add(spec.name)
            taken += nbytes
    if not names and specs:
        names.add(min(specs, key=dense_nbytes).name)
    return frozenset(names)


class _Tap:
    """A source passed through as it is, diffing the sampled tensors into the baseline on the way
    (`Baseline.tapped`): `sample` says what that measured."""

    def __init__(self, baseline: Baseline, specs: Sequence[TensorSpec], source: WeightSource) -> None:
        self._baseline, self._source = baseline, source
        self._specs = {spec.name: spec for spec in specs}
        self._names = sample_names(specs)
        self.sample = Sample(0.0, 0, 0, cold=False)

    def metas(self) -> list[TensorMeta]:
        return self._source.metas()

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._source.tensors():
            if name in self._names:
                self._measure(self._specs[name], tensor)
            yield name, tensor

    def _measure(self, spec: TensorSpec, tensor: torch.Tensor) -> None:
        started = time.perf_counter()
        patch_bytes, cold = self._baseline.update(spec, tensor)
        seconds = time.perf_counter() - started
        s = self.sample
        self.sample = Sample(
            s.seconds + seconds, s.nbytes + dense_nbytes(spec), s.patch_bytes + patch_bytes, s.cold or cold
        )


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
        self._high_water = 0
        """The most any push has used: the pages faulted in already."""

    def reset(self, full_bytes: int) -> bool:
        """Free everything taken so far (the previous push's patches are no longer in use) and
        make room for patches up to the point where a push goes full anyway. Returns whether
        the pages are fresh (not faulted in by an earlier push)."""
        wanted = int(DENSE_FRACTION * full_bytes) + self.ALIGN
        fresh = self._buffer.size < wanted or self._high_water == 0
        if self._buffer.size < wanted:
            self._buffer, self._high_water = np.empty(wanted, dtype=np.uint8), 0
        self._used = 0
        return fresh

    def _touched(self) -> None:
        self._high_water = max(self._high_water, self._used)

    def take(self, nbytes: int) -> np.ndarray:
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if start + nbytes > self._buffer.size:
            return np.empty(nbytes, dtype=np.uint8)
        self._used = start + nbytes
        self._touched()
        return self._buffer[start : self._used]


class Baseline:
    """The sender's copy of its last push, in the wire dtype, in host memory.

    Costs one copy of the model as sent (2 bytes per element for a bf16 push). `diff` compares
    a new version against it, replaces it with the new version, and says what changed.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._content: str | Future[str] = ""
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._indices = np.empty(0, dtype=np.int32)
        self._values = np.empty(0, dtype=np.uint8)
        self._patches = _Arena()
        self._cold = False
        """Memory was allocated during the current diff (`Diff.cold`)."""

    @property
    def content(self) -> str:
        """The content digest of the version it holds, or "" before the first push."""
        return settled(self._content)

    def diff(
        self, specs: Sequence[TensorSpec], source: WeightSource, keep_going: Callable[[Sample], bool] | None = None
    ) -> Diff | None:
        """Diff `source` (tensors as `specs` send them) against the baseline, which becomes the
        new version. A changed tensor set, shape or dtype makes every tensor dense (no base).

        `keep_going` is asked once, when the diff has covered `GATE_FRACTION` of the bytes, with
        what that part measured; if it says no, the diff stops there and returns None, and
        the baseline holds no version a patch can be based on (part of it is new)."""
        return self._take(specs, source, compare=True, keep_going=keep_going)

    def refresh(self, specs: Sequence[TensorSpec], source: WeightSource) -> Diff:
        """Make `source` the baseline without comparing (a push that goes full to everyone, so
        that the next one can be a patch): a copy. The result offers no patch (no base)."""
        diff = self._take(specs, source, compare=False)
        assert diff is not None  # only a gated diff stops
        return diff

    def tapped(self, specs: Sequence[TensorSpec], source: WeightSource) -> _Tap:
        """`source` for a push without a diff: the sampled tensors (`sample_names`) are diffed into
        the baseline as they go by, and the result's `sample` says what that measured."""
        self.forget()
        return _Tap(self, specs, source)

    def update(self, spec: TensorSpec, tensor: torch.Tensor) -> tuple[int, bool]:
        """Bring one tensor of the baseline to `tensor` as sent (no patch is kept): the bytes its
        patch would have taken, and whether memory was allocated on the way."""
        _check_yielded(spec, spec.name, tensor)
        if not self._holds(spec) or self.tensors[spec.name].element_size() not in _BITS:
            self.tensors[spec.name] = _copy(tensor, dtype_from_name(spec.dtype))
            return dense_nbytes(spec), True
        old = self.tensors[spec.name]
        indices, _ = self._changes(tensor, old)
        cold, self._cold = self._cold, False
        return _patch_nbytes(indices.size, old.numel(), spec), cold

    def _holds(self, spec: TensorSpec) -> bool:
        """Whether the baseline has tensor `spec` in its shape and wire dtype."""
        old = self.tensors.get(spec.name)
        return old is not None and tuple(old.shape) == spec.shape and old.dtype == dtype_from_name(spec.dtype)

    def _take(
        self,
        specs: Sequence[TensorSpec],
        source: WeightSource,
        compare: bool,
        keep_going: Callable[[Sample], bool] | None = None,
    ) -> Diff | None:
        same_layout = [spec.name for spec in specs] == list(self.tensors) and all(map(self._holds, specs))
        held = self.content  # waits for the last push's digest: it reads what this overwrites
        base = held if same_layout and compare else ""
        self._content = ""  # until the new version is whole
        if not same_layout:
            self.tensors = {}
        full_bytes = sum(dense_nbytes(spec) for spec in specs)
        self._cold = self._patches.reset(full_bytes)
        patched: list[TensorSpec] = []
        payloads: list[torch.Tensor] = []
        changed = total = 0
        started, done_bytes, patch_bytes = time.perf_counter(), 0, 0
        for spec, (name, tensor) in zip(specs, source.tensors(), strict=True):
            _check_yielded(spec, name, tensor)
            old = self.tensors.get(name)
            if old is None or old.element_size() not in _BITS:
                old = self.tensors[name] = _copy(tensor, dtype_from_name(spec.dtype))
                patch_spec, payload, num_changed = spec, None, old.numel()
            elif not compare:
                old.copy_(tensor.detach())
                patch_spec, payload, num_changed = spec, None, old.numel()
            else:
                indices, values = self._changes(tensor, old)
                patch_spec, payload = _encode(indices, values, old.numel(), spec, self._patches.take)
                num_changed = indices.size
            patched.append(patch_spec)
            # dense: the baseline itself (ours, not the caller's, which may change)
            payloads.append(old if payload is None else torch.from_numpy(payload))
            changed += num_changed
            total += old.numel()
            done_bytes, patch_bytes = done_bytes + dense_nbytes(spec), patch_bytes + tensor_nbytes(patch_spec)
            if keep_going is not None and done_bytes >= GATE_FRACTION * full_bytes and base:
                part = Sample(time.perf_counter() - started, done_bytes, patch_bytes, self._cold)
                if not keep_going(part):
                    self._cold = False
                    return None  # the baseline is part new, part old: `content` stays ""
                keep_going = None  # asked once
        self._content = _digest_later(specs, [self.tensors[spec.name] for spec in specs])
        cold, self._cold = self._cold or not same_layout, False
        return Diff(base, self._content, tuple(patched), tuple(payloads), changed, total, full_bytes, cold)

    def _changes(self, tensor: torch.Tensor, old: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Update `old` (the baseline) to `tensor` as sent; the flat indices of the elements whose
        bits changed and their new bits (bytes). Views of scratch buffers: valid until the next
        call. One native pass where it is built (an fp32 source cast to bf16 in the same pass),
        else numpy's."""
        numel, size = old.numel(), old.element_size()
        if _deltadiff is None or size not in _NATIVE_SIZES or numel >= 1 << 31:
            new = self._as_sent(tensor, old.dtype)
            indices = _update(new, old)
            return indices, np.take(_bits(new), indices).view(np.uint8)
        indices, values = self._outputs(numel, size)
        source = tensor.detach()
        if source.device.type == "cpu" and source.is_contiguous() and (source.dtype, old.dtype) == _CAST_BF16:
            count = _deltadiff.cast_diff(_bits(source), _bits(old), indices, values, _threads())
        else:
            new = self._as_sent(source, old.dtype)
            count = _deltadiff.diff(_bits(new), _bits(old), size, indices, values, _threads())
        return indices[:count], values[: count * size]

    def _outputs(self, numel: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Scratch for the native diff's output, room for every element of the largest tensor:
        only the pages the changes touch are ever faulted in."""
        if self._indices.size < numel:
            self._indices, self._cold = np.empty(numel, dtype=np.int32), True
        if self._values.size < numel * size:
            self._values, self._cold = np.empty(numel * size, dtype=np.uint8), True
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

    def forget(self) -> None:
        """Hold no version a patch can be based on (a plain push went past it); the memory stays
        for the next refresh."""
        settled(self._content)  # a digest still computing reads the tensors a refresh rewrites
        self._content = ""

    def source(self) -> WeightSource:
        """The baseline's tensors (the version last diffed), as a source for a full push."""
        return _Tensors(list(self.tensors.items()))

    @property
    def nbytes(self) -> int:
        """Host memory the baseline holds."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
