"""The wire's typed data: the transfer plan and the control messages every transport speaks.

Every message a peer can send is a frozen, tagged msgspec Struct (`Message`), declared here or,
for one transport's own set-up and bucket messages, in that transport's file, and encoded only in
`wire.py`. A link decodes exactly the core messages and its transport's, and nothing else. What a
push reports to its caller (`SyncReport`) is in report.py.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "Abort",
    "Accept",
    "Adapter",
    "CORE_MESSAGES",
    "BucketDone",
    "BucketReady",
    "Commit",
    "Committed",
    "Failed",
    "Hello",
    "Message",
    "Offer",
    "SyncTimes",
    "Piece",
    "Plan",
    "Region",
    "TensorShare",
    "TensorSpec",
    "Want",
    "Welcome",
]

PROTOCOL_VERSION = 15
"""Bumped whenever a peer of another version would misread us (3: collective buckets go down a chain
of send/recv instead of one gloo broadcast; 4: a tensor may travel encoded, as a patch; 5:
`NixlTarget` and `NixlWrites`, new messages in the union; 6: an shm ring's staging area carries the
tensors larger than a bucket; 7: the content digest takes the tensors in name order; 8: an `Offer`
may carry a LoRA `Adapter`; 9: a patch may be encoded "blocks", and no longer "bitmap"; 10: `Offer`
and `Commit` name the plan by `plan_id`, only a ring's `BucketReady` names a slot, and the sender
tells an shm receiver where it staged each tensor larger than a bucket in a `Staged`; an `Abort`
between syncs tells a receiver a version will not come, naming its adapter if it is one's; 11:
cudaipc sends `Shared` before every offer, the tensors receivers copy straight from the sender's
GPU memory, and its handles are `CudaHandle`s; 12: sharded sync: a receiver's `Welcome` names the box
of each tensor it keeps (`wants`), a `TensorSpec` may be a box of its tensor (`region`), and a
plan's buckets may come from several senders (`Plan.parts`, `Offer.part`); 13: tensor hashes are
CRC32C, which compose, and the `Commit` of a part carries its sender's `TensorShare`s, and
`Committed` the content digest committed; 14: the content a patch applies to is `delta_base`
wherever it travels (`Welcome`, `Offer`, `Committed`), and a `Commit`'s version digest is
`content_digest`, as in `Committed`; 15: a receiver refuses a version at or below the last it
committed unless the `Offer` says `allow_older`)."""


class Region(msgspec.Struct, frozen=True, array_like=True):
    """Where a box sits in its tensor: the box's first element along each dimension, and the
    whole tensor's shape. The box's extents are the shape of the `TensorSpec` that carries it."""

    start: tuple[int, ...]
    whole: tuple[int, ...]


class Want(msgspec.Struct, frozen=True, array_like=True):
    """The box of tensor `name` a receiver keeps: elements [start[d], stop[d]) along each
    dimension d."""

    name: str
    start: tuple[int, ...]
    stop: tuple[int, ...]


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
    region: Region | None = None
    """The spec is a box of the tensor `name` (`shape` is the box's extents), where a receiver
    keeps only that box (sharded sync, regions.py); None: the whole tensor."""


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
    parts: tuple[int, ...] = ()
    """Sharded sync: the buckets come from several senders, sender m carrying buckets
    [parts[m], parts[m+1]) (the last to the end); () for one sender carrying every bucket."""


# --- control messages -------------------------------------------------------------------------


class Message(msgspec.Struct, frozen=True, tag=True):
    """A control message: a frozen Struct tagged with its class name on the wire. The ones every
    transport speaks are below (`CORE_MESSAGES`); a transport declares its own next to it, in
    its `TransportSpec.messages`, and its links decode exactly the two sets."""


class Hello(Message, frozen=True):
    """Sender -> receiver, first frame on a connection."""

    protocol: int
    sender_id: str
    nonce: str = ""
    """The sender's challenge: a receiver with a token answers it in `Welcome.proof`."""


class Welcome(Message, frozen=True):
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
    delta_base: str = ""
    """The content digest of what it holds, where a patch (a delta sync) can be applied to it,
    else "" (never verified, dirty, or a sink without destinations to patch)."""
    wants: tuple[Want, ...] = ()
    """The box of each tensor it keeps, where it keeps less than whole tensors (an engine's
    tensor-parallel worker); a tensor it does not name is sent whole. () : every tensor whole."""


class Auth(Message, frozen=True):
    """Sender -> receiver, right after `Welcome`: HMAC of the receiver's nonce (see auth.py)."""

    proof: str


class TensorShare(msgspec.Struct, frozen=True, array_like=True):
    """One sender's share of a tensor's hash in a sharded push (checksum.share): the CRC32C of
    the bytes of tensor `name` it holds, shifted past the bytes after them; 0 where it holds none.
    The XOR of every sender's share is the hash of the whole tensor."""

    name: str
    dtype: str
    """The wire dtype, as the content digest names it."""
    shape: tuple[int, ...]
    """The whole tensor's shape."""
    share: int


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


class Offer(Message, frozen=True):
    """Sender -> receiver: the plan of version `version`; receivers accept or fail."""

    version: int
    plan: Plan
    plan_id: str
    """The plan's id (`plan.plan_id`: a hash of it), named again by the `Commit`."""
    verify: str = "off"
    """With "bucket", every bucket carries a checksum that the receiver checks."""
    delta_base: str = ""
    """For a delta sync: the content digest of the version the plan's patches apply to, which
    the receiver must hold (its `Welcome.delta_base`); "" for a full sync."""
    adapter: Adapter | None = None
    """The plan is version `version` of this LoRA adapter, served on top of the base weights,
    which it leaves as they are; None: the plan is the base weights."""
    part: int = 0
    """Sharded sync: which of the plan's parts this sender carries (`Plan.parts`); the receiver
    takes one offer of the same plan from each part's sender into one sync."""
    allow_older: bool = False
    """The pusher said so: the receiver takes `version` though it is at or below the last one it
    committed (which it refuses otherwise: versions only go forward)."""


class Accept(Message, frozen=True):
    """Receiver -> sender: the plan fits; send the buckets."""

    version: int
    lends: bool = False
    """Its sink is handed tensors larger than a bucket that have no destination: a transport
    that can hold such a tensor whole (shm's staging area) spares it a copy, from the next sync."""


class BucketReady(Message, frozen=True):
    """Sender -> receiver: bucket `index` is there to land (in a ring slot, written in place, or
    next down the chain)."""

    index: int
    checksum: int = 0
    """The bucket's checksum (checksum.bucket_checksum) when the sync verifies buckets, else 0."""
    slot: int = -1
    """The ring slot that holds the bucket's bytes (shm, cudaipc: the sender's ring; nixl: the
    receiver's, for the pieces not written in place), or -1 where no ring carries them."""


class BucketDone(Message, frozen=True):
    """Receiver -> sender: bucket `index` has landed; its slot may be reused."""

    index: int


class Commit(Message, frozen=True):
    """Sender -> receiver: every bucket was sent; commit `version` if everything arrived."""

    version: int
    plan_id: str
    """The id of the plan committed (`Offer.plan_id`)."""
    content_digest: str = ""
    """The version's content digest (checksum.content_digest) where the sync was verified, else ""."""
    tensors: tuple[int, ...] = ()
    """With verify="full": the hash of every tensor's bytes, in plan order."""
    shares: tuple[TensorShare, ...] = ()
    """A verified part of a sharded push from several senders: this sender's share of every
    tensor's hash, in its source's order; the receiver combines every part's into the content
    digest (`content_digest` is "": no sender holds every tensor whole)."""


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


class Committed(Message, frozen=True):
    """Receiver -> sender: `version` is committed and serving."""

    version: int
    times: SyncTimes = msgspec.field(default_factory=SyncTimes)
    """Where the receiver's sync went."""
    delta_base: str = ""
    """What a delta sync may now be based on here (as `Welcome.delta_base`)."""
    content_digest: str = ""
    """The content digest of the version committed ("" unverified): for a sharded sync from
    several senders, what the receiver combined from their shares, which none of them knows."""


class Abort(Message, frozen=True):
    """Sender -> receiver: the sync of `version` is abandoned (between syncs: it will not be
    offered)."""

    version: int
    reason: str
    adapter: str = ""
    """The LoRA adapter whose version it is, or "" for the base weights."""


class Failed(Message, frozen=True):
    """Receiver -> sender: the receiver rejected or failed the sync; `kind` is the error class."""

    version: int
    kind: str
    message: str


CORE_MESSAGES: tuple[type[Message], ...] = (
    Hello,
    Welcome,
    Auth,
    Offer,
    Accept,
    BucketReady,
    BucketDone,
    Commit,
    Committed,
    Abort,
    Failed,
)
"""The conversation every transport shares."""
