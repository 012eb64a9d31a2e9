"""``group_by_length=True``: batches of samples of similar length, image and text-only apart.

LLaVA's ``group_by_modality_length`` idea, made a pure function of ``(seed, epoch)``
and of the source's token counts (:mod:`mmcache.loader.lengths`), so that it is the
same on every rank, in every worker, in the stat prefetcher and after a resume:

1. the epoch's whole-dataset permutation (:meth:`EpochSampler.permutation`), less
   the samples of length 0 (refused by the source), is split by modality (samples
   with an image, text-only samples), keeping its order;
2. each part is cut into *megabatches* of a few training steps' samples (up to
   :data:`_MEGA_STEPS` times ``world_size * batch_size``), each sorted by length,
   longest first (ties by the permutation's order), and cut into batches of
   ``batch_size`` (``drop_last`` drops batches short of ``batch_size``);
3. the full megabatches of both parts are shuffled (seeded by ``(seed, epoch)``),
   the two short ones (a part's last) follow, and the batches are laid out in
   that order: at every step before the short ones all ranks have batches of the
   same megabatch (similar lengths, one modality), so no rank waits for another's
   long batch;
4. ranks get equal counts as in ``DistributedSampler``: ``Distributed(drop_last=True)``
   drops the last ``total % world`` batches, otherwise the first ones are repeated;
   rank ``r`` takes batches ``r, r + world, ...``.

Every batch holds one modality: a model never pads a text-only batch with image
work, and a batch's longest row is close to its shortest (little padding).

Thread/process safety: immutable (a frozen dataclass over read-only arrays).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmcache.loader.stream import BatchOrder

__all__ = ["LengthGroupedOrder", "split_by_rank"]

#: Training steps per megabatch (fewer when the dataset is small: a quarter of it at
#: most, as transformers' ``LengthGroupedSampler``): more, less padding; fewer, more random.
_MEGA_STEPS = 16
#: Mixed into the epoch's seed for the megabatch shuffle (the permutation uses [seed, epoch]).
_SHUFFLE_SALT = 0x67726F7570  # "group"


def _rng(seed: int, epoch: int, salt: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, salt])))


def split_by_rank(
    batches: list[np.ndarray], *, rank: int, world_size: int, drop_last: bool
) -> list[np.ndarray]:
    """Rank ``rank``'s share of a global list of batches, every rank the same count:
    ``drop_last`` drops the last ``len % world`` batches, else the first are repeated."""
    total = len(batches)
    if total % world_size:
        if drop_last:
            batches = batches[: total - total % world_size]
        else:
            need = world_size - total % world_size
            reps = -(-need // total)
            batches = batches + (batches * reps)[:need]
    return batches[rank::world_size]


@dataclass(frozen=True, eq=False)
class LengthGroupedOrder(BatchOrder):
    """:class:`BatchOrder` whose batches group samples by length and modality.

    ``lengths``: tokens per sample (``int64 [N]``); ``has_image``: ``bool [N]``.
    """

    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    has_image: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def batches(self, epoch: int) -> list[np.ndarray]:
        s = self.sampler
        bs = self.batch_size
        perm = s.permutation(epoch)
        perm = perm[self.lengths[perm] > 0]  # 0: a sample the source refuses
        step = bs * s.world_size  # the batches of one training step, all ranks
        mega = step * max(1, min(_MEGA_STEPS, len(perm) // (step * 4)))
        full: list[list[np.ndarray]] = []
        tails: list[list[np.ndarray]] = []
        for flag in (True, False):
            part = perm[self.has_image[perm] == flag]
            for a in range(0, len(part), mega):
                chunk = part[a : a + mega]
                # Longest first; a stable sort keeps the permutation's order among ties.
                chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
                group = [chunk[i : i + bs] for i in range(0, len(chunk), bs)]
                if self.drop_last:
                    group = [b for b in group if len(b) == bs]
                if group:
                    (full if len(chunk) == mega else tails).append(group)
        if s.shuffle and full:
            order = _rng(s.seed, epoch, _SHUFFLE_SALT).permutation(len(full)).tolist()
            full = [full[k] for k in order]
        # The short megabatches last: each full one covers whole steps, so at every step
        # before them all ranks hold batches of one megabatch.
        flat = [b for g in full + tails for b in g]
        if not flat:
            return []
        return split_by_rank(flat, rank=s.rank, world_size=s.world_size, drop_last=s.drop_last)
