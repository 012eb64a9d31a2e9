"""What a rank checks before it serves an entry a peer sent (``scope="cluster"``).

Peers are the job's own ranks, and nothing they send is unpickled: a message is
plain arrays (:mod:`.wire`), gathered metadata plain tensors (:mod:`.topology`).
An entry is still only bytes from another process, so before it is put where the
loader finds it, it must be what this rank would have made itself:

* its **key** is the one this rank computes for that sample: the key holds this
  rank's pipeline fingerprint and the identity of the sample's input bytes, so an
  entry of another pipeline, or of another version of the input, is refused;
* its **checksum** holds (a damaged or truncated entry is refused);
* its **layout** (field names, dtypes, shapes: ``codec.layout_signature``) is the
  one this rank's own entries have, where the source makes every sample with the
  same shapes (no ``varying_fields``). The reference is learned from an entry of
  this node's own tiers (one the exchange reads to send); before there is one,
  key and checksum decide, and the loader's gather still compares each entry's
  layout with the batch's.

What no check can refuse is a peer that computes a valid checksum over other
pixels of the right layout: the checksum (xxh3) is not a MAC. The trust model is
that of torch.distributed: the ranks of one job trust each other.
Not thread-safe: used by the exchange's one thread.
"""

from __future__ import annotations

from mmcache import codec
from mmcache.codec.layout import layout_signature
from mmcache.errors import CorruptEntryError

__all__ = ["EntryCheck"]


class EntryCheck:
    """Refuses received entries that differ from what this rank would make."""

    def __init__(self, *, fixed_shapes: bool) -> None:
        self.fixed_shapes = fixed_shapes
        self.layout: bytes | None = None

    def learn(self, raw: bytes) -> None:
        """Take the layout of ``raw``, an entry of this node's own tiers, as the reference."""
        if self.fixed_shapes and self.layout is None:
            try:
                self.layout = layout_signature(codec.read_header(raw))
            except CorruptEntryError:
                return

    def refusal(self, expected: bytes | None, key: bytes, raw: bytes) -> str | None:
        """Why the entry ``raw`` a peer sent under ``key`` is refused, or None to accept
        it; ``expected`` is the key this rank computes for that sample (None: the sample
        index is out of range)."""
        if expected is None or key != expected:
            return "its key is not this rank's for that sample (another pipeline or input)"
        if not codec.verify(raw):
            return "damaged (its checksum does not match)"
        if self.layout is not None and layout_signature(codec.read_header(raw)) != self.layout:
            return "its fields or shapes differ from this pipeline's"
        return None
