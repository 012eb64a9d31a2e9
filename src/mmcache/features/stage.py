"""``FeatureLoader``: a loader stage that adds a FeatureCache's features to every batch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from mmcache.errors import ConfigError

if TYPE_CHECKING:
    from mmcache.features import FeatureCache

__all__ = ["FeatureLoader"]


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
        set_epoch = getattr(self.loader, "set_epoch", None)
        if set_epoch is None:
            raise ConfigError(f"{type(self.loader).__name__} has no set_epoch")
        set_epoch(epoch)
