"""``FeatureLoader``: a loader stage that adds a FeatureCache's features to every batch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mmcache.errors import ConfigError

if TYPE_CHECKING:
    from mmcache.features import FeatureCache

__all__ = ["Augmenting", "FeatureLoader", "HasEpochs"]


@runtime_checkable
class HasEpochs(Protocol):
    """A loader that is told its epoch (:meth:`mmcache.DataLoader.set_epoch`)."""

    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class Augmenting(Protocol):
    """A loader that may augment its batches (``mmcache.DataLoader(augment=...)``; None:
    it does not)."""

    augment: Any


class FeatureLoader:
    """Batches of ``loader`` with ``"features"`` added (see :meth:`FeatureCache.wrap`).

    Iterating runs the FeatureCache on each batch in the iterating thread; at
    the end of an iteration the pending writes are flushed. ``len()`` and
    :meth:`set_epoch` pass through to the wrapped loader.
    """

    def __init__(
        self, loader: Iterable[Mapping[str, Any]], feats: FeatureCache, *, keep_images: bool = False
    ) -> None:
        self.loader = loader
        self.feats = feats
        self.keep_images = keep_images

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for batch in self.loader:
                out = dict(batch)
                out["features"] = self.feats(batch)
                if not self.keep_images:
                    out.pop("image", None)
                yield out
        finally:  # also when the training loop breaks out early
            self.feats.flush()

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """Forward to the wrapped loader's ``set_epoch`` (ConfigError if it has none)."""
        if not isinstance(self.loader, HasEpochs):
            raise ConfigError(f"{type(self.loader).__name__} has no set_epoch")
        self.loader.set_epoch(epoch)
