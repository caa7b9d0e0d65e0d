"""The wire's typed data: the transfer plan and every control message.

Every message a peer can send is a frozen msgspec Struct declared here and encoded only in
`wire.py`. Messages are tagged, so a decoder accepts exactly these types and nothing else. What a
push reports to its caller (`SyncReport`) is in report.py.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "Abort",
    "Accept",
    "Adapter",
    "BucketData",
    "BucketDone",
    "BucketReady",
    "Commit",
    "Committed",
    "Failed",
    "Hello",
    "Message",
    "NixlTarget",
    "NixlWrites",
    "Offer",
    "SyncTimes",
    "Piece",
    "Plan",
    "Ring",
    "DeviceRing",
    "DeviceSlot",
    "TensorSpec",
    "Welcome",
]

PROTOCOL_VERSION = 9
"""Bumped whenever a peer of another version would misread us (3: collective buckets go down a
chain of send/recv instead of one gloo broadcast; 4: a tensor may travel encoded, as a patch; 5: `NixlTarget`
and `NixlWrites`, new messages in the union; 6: an shm ring's staging area carries the tensors
larger than a bucket; 7: the content digest takes the tensors in name order; 8: an `Offer` may
carry a LoRA `Adapter`; 9: a patch may be encoded "blocks", and no longer "bitmap")."""


class TensorSpec(msgspec.Struct, frozen=True):
    """One tensor as it travels: wire dtype and shape, plus the dtype it had on the sender."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    source_dtype: str
    encoding: str = "dense"
    """How its bytes travel (delta.py): "dense" (every element), or a patch onto the receiver's
    copy of the base version: "sparse" (`count` int32 indices, then `count` values) or "blocks"
    (`count` values, then each 256-element block's number of changes as a uint16, then each
    change's offset in its block as one byte; patch.py)."""
    count: int = 0
    """Values a patch carries (0 for "dense")."""


class Piece(msgspec.Struct, frozen=True, array_like=True):
    """A run of `nbytes` bytes of tensor `tensor` (index into Plan.tensors), starting at byte
    `tensor_offset` of that tensor, stored at byte `bucket_offset` of its bucket."""

    tensor: int
    tensor_offset: int
    bucket_offset: int
    nbytes: int


class Plan(msgspec.Struct, frozen=True):
    """Where every byte of a sync goes. Built once by the sender, shipped, checked by receivers."""

    bucket_bytes: int
    tensors: tuple[TensorSpec, ...]
    buckets: tuple[tuple[Piece, ...], ...]
    total_bytes: int


# --- control messages -------------------------------------------------------------------------


class Hello(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver, first frame on a connection."""

    protocol: int
    sender_id: str
    nonce: str = ""
    """The sender's challenge: a receiver with a token answers it in `Welcome.proof`."""


class Welcome(msgspec.Struct, frozen=True, tag=True):
    """Receiver -> sender: what the receiver can afford and what it holds."""

    protocol: int
    receiver_id: str
    max_bucket_bytes: int
    version: int | None
    verify: str = "off"
    """The weakest verification this receiver accepts."""
    nonce: str = ""
    """The receiver's challenge, answered by the sender's `Auth` when the receiver has a token."""
    proof: str = ""
    """HMAC of the sender's nonce under the shared token, or "" when the receiver has none."""
    content: str = ""
    """The content digest of what it holds, where a patch (a delta sync) can be applied to it,
    else "" (never verified, dirty, or a sink without destinations to patch)."""


class Auth(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver, right after `Welcome`: HMAC of the receiver's nonce (see auth.py)."""

    proof: str


class Ring(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver (shm only): the shared-memory slots buckets are written to, and the
    staging area tensors larger than a bucket are written to whole ("" and 0: none)."""

    segments: tuple[str, ...]
    slot_bytes: int
    staging: str = ""
    staging_bytes: int = 0


class DeviceSlot(msgspec.Struct, frozen=True):
    """One GPU ring slot as CUDA IPC shares it (the fields of torch's `_share_cuda_`): plain
    bytes and numbers, opened by the receiver with `_new_shared_cuda`."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class DeviceRing(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver (cudaipc only): the GPU memory slots buckets are written to."""

    slots: tuple[DeviceSlot, ...]
    slot_bytes: int


class Group(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver (collective), after `Accept`, before the buckets: the process group
    of this sync. A receiver joins it unless it is a member already (same `prefix`): a new
    group forms when the members that accepted the plan differ from the current group's."""

    store_host: str
    store_port: int
    prefix: str
    """A fresh random key namespace in the sender's store, known only to this group's members."""
    rank: int
    world_size: int
    backend: str


class Adapter(msgspec.Struct, frozen=True):
    """A LoRA adapter: what a push of its tensors (PEFT's names, `...lora_A.weight` and
    `...lora_B.weight` of each target module) needs besides them to be served on a base model."""

    name: str
    """The name requests ask for it by (the OpenAI `model` field)."""
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    """The last component of every module the adapter targets (`q_proj`, ...), sorted."""
    use_rslora: bool = False
    """Scale by alpha / sqrt(rank) instead of alpha / rank."""


class Offer(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver: the plan of version `version`; receivers accept or fail."""

    version: int
    plan: Plan
    digest: str
    verify: str = "off"
    """With "bucket", every bucket carries a checksum that the receiver checks."""
    base: str = ""
    """For a delta sync: the content digest of the version the plan's patches apply to, which
    the receiver must hold; "" for a full sync."""
    adapter: Adapter | None = None
    """The plan is version `version` of this LoRA adapter, served on top of the base weights,
    which it leaves as they are; None: the plan is the base weights."""


class Accept(msgspec.Struct, frozen=True, tag=True):
    """Receiver -> sender: the plan fits; send the buckets."""

    version: int
    lends: bool = False
    """Its sink is handed tensors larger than a bucket that have no destination: a transport
    that can hold such a tensor whole (shm's staging area) spares it a copy, from the next sync."""


class NixlTarget(msgspec.Struct, frozen=True, tag=True):
    """Receiver -> sender (nixl), right after `Accept`: where the sender may write this sync's
    buckets. Plain bytes and numbers; the sender checks every count against the plan."""

    metadata: bytes
    """The receiver's NIXL agent metadata (how to connect, and the remote keys of the memory it
    registered), opaque bytes loaded by the sender's agent (`add_remote_agent`)."""
    sites: tuple[int, ...]
    """Per plan tensor: the address of its destination's first byte, written in place, or 0 when
    the tensor lands through a slot (it is staged, or lives on a device)."""
    slots: tuple[int, ...]
    """Addresses of the receiver's ring slots of `slot_bytes` each, or () when no piece needs one."""
    slot_bytes: int


class NixlWrites(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver (nixl), just before the sync's first write into an in-place site: from
    bucket `index` on, live destinations may change under the receiver (one-sided writes it does
    not see). A sync that ends before this message leaves them intact."""

    index: int


class BucketReady(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver (shm, collective, nixl): bucket `index` sits in ring slot `slot` (shm;
    nixl: its pieces that land through a slot, the rest is in place already), or is the next to
    come down the chain (collective)."""

    index: int
    slot: int
    checksum: int = 0
    """xxh3-64 of the bucket's bytes when the sync verifies buckets, else 0."""


class BucketData(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver (tcp): the raw bytes of bucket `index`'s pieces follow, in plan order."""

    index: int
    nbytes: int
    checksum: int = 0
    """xxh3-64 of the bucket's bytes when the sync verifies buckets, else 0."""


class BucketDone(msgspec.Struct, frozen=True, tag=True):
    """Receiver -> sender: bucket `index` has landed; its slot may be reused."""

    index: int


class Commit(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver: every bucket was sent; commit `version` if everything arrived."""

    version: int
    digest: str
    content: str = ""
    """With verify="bucket": the digest of every bucket's checksum (see checksum.content_digest)."""
    tensors: tuple[int, ...] = ()
    """With verify="full": xxh3-64 of every tensor's bytes, in plan order."""


class SyncTimes(msgspec.Struct, frozen=True):
    """Where one receiver's sync went, in seconds, from its Accept to its Committed."""

    total_s: float = 0.0
    transfer_s: float = 0.0
    """Waiting for and reading bucket bytes: what is left of `total_s` after the rest."""
    landing_s: float = 0.0
    """Copying pieces into place or staging, and checking checksums."""
    load_s: float = 0.0
    """In the sink's `load` and `commit`: the engine's own reload."""
    pause_s: float = 0.0
    """Parking the engine for the sync (a rollout server): waiting for requests to drain."""


class Committed(msgspec.Struct, frozen=True, tag=True):
    """Receiver -> sender: `version` is committed and serving."""

    version: int
    times: SyncTimes = msgspec.field(default_factory=SyncTimes)
    """Where the receiver's sync went."""
    content: str = ""
    """What a delta sync may now be based on here (as `Welcome.content`)."""


class Abort(msgspec.Struct, frozen=True, tag=True):
    """Sender -> receiver: the sync of `version` is abandoned."""

    version: int
    reason: str


class Failed(msgspec.Struct, frozen=True, tag=True):
    """Receiver -> sender: the receiver rejected or failed the sync; `kind` is the error class."""

    version: int
    kind: str
    message: str


Message = (
    Hello
    | Welcome
    | Auth
    | Ring
    | DeviceRing
    | Group
    | Offer
    | Accept
    | NixlTarget
    | NixlWrites
    | BucketReady
    | BucketData
    | BucketDone
    | Commit
    | Committed
    | Abort
    | Failed
)
