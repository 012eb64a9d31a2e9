"""The frozen encoder of a FeatureCache: what identifies it, eval mode, and one forward pass.

:class:`FrozenEncoder` owns the encoder, its ``preprocess`` and output
selection, and the fingerprint that enters every feature key: pinned by
``name``/``version``, or hashed from the weights
(:func:`mmcache.transforms.fingerprint.encoder_fingerprint`). Weights that
change after construction (``load_state_dict``, an optimizer step, a replaced
``Parameter``) are noticed on every call by a
:class:`~mmcache.transforms.fingerprint.WeightWatch`, and the fingerprint is
recomputed: stale features are never served. Over an encoder that really
trains it is recomputed every step; a FeatureCache is meant for frozen encoders.

Eval mode. The encoder is put in eval mode once, at construction (features
computed with dropout would be random and not cacheable). It is never put back
in train mode; if the caller's code does (``model.train()`` on a parent module
is the usual way), the next call sets eval mode again and logs a warning once.

Driven by one thread, like the FeatureCache that holds it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mmcache import keys
from mmcache.errors import ConfigError
from mmcache.transforms.fingerprint import WeightWatch, encoder_fingerprint

__all__ = ["FrozenEncoder", "Output", "module_device", "output_name", "same_device"]

logger = logging.getLogger(__name__)

#: Which part of the encoder's output is the features: the output itself
#: (``None``), an index into a tuple/dict, or a key/attribute name.
Output = int | str | None


def output_name(output: Output) -> str:
    """The output selection as it enters the feature keys."""
    if output is None:
        return "tensor"
    if isinstance(output, int):
        return f"index:{output}"
    return f"name:{output}"


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same (an index left out matches any index)."""
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def module_device(encoder: Any) -> torch.device | None:
    """The device of a module's first tensor; None for a module without tensors or a callable."""
    if isinstance(encoder, torch.nn.Module):
        for t in itertools.chain(encoder.parameters(), encoder.buffers()):
            return t.device
    return None


class FrozenEncoder:
    """An encoder with its preprocessing, output selection and fingerprint (see the module).

    Arguments are those of :class:`mmcache.FeatureCache`, validated by :meth:`check`.
    """

    @staticmethod
    def check(encoder: object, *, output: object, name: object, version: object) -> None:
        """Raise ConfigError unless these arguments can make a FrozenEncoder."""
        if output is not None and (isinstance(output, bool) or not isinstance(output, (int, str))):
            raise ConfigError(f"output must be None, an int index or a name, got {output!r}")
        if version is not None and name is None:
            raise ConfigError("version= needs name= (the pair pins the encoder fingerprint)")
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"name must be a non-empty string, got {name!r}")
        if not callable(encoder):
            raise ConfigError(f"encoder must be callable, got {type(encoder).__name__}")
        if not isinstance(encoder, torch.nn.Module) and name is None:
            raise ConfigError(
                f"encoder is a {type(encoder).__name__}, not a torch.nn.Module, so its weights "
                "cannot be fingerprinted: pass name=/version= to pin the fingerprint"
            )

    def __init__(
        self,
        encoder: Callable[..., Any],
        *,
        preprocess: Callable[[torch.Tensor], Any] | None,
        output: Output,
        name: str | None,
        version: str | None,
    ) -> None:
        self.module = encoder
        self.preprocess = preprocess
        self.output = output
        self.name = name
        self.version = version
        if isinstance(encoder, torch.nn.Module) and encoder.training:
            encoder.eval()
            logger.info(
                "FeatureCache put the encoder in eval mode (features must be deterministic)"
            )
        self._warned_train = False
        self.fingerprint = self._compute_fingerprint()
        self._watch = WeightWatch(encoder if name is None else None)

    def _compute_fingerprint(self) -> str:
        if self.name is not None:
            return keys.digest("mmcache.encoder.pinned", self.name, self.version).hex()
        if not isinstance(self.module, torch.nn.Module):  # pragma: no cover - checked by caller
            raise ConfigError("unpinned encoders must be nn.Modules")
        t0 = time.perf_counter()
        fp = encoder_fingerprint(self.module, preprocess=self.preprocess)
        logger.info("encoder fingerprint %s computed in %.2f s", fp[:12], time.perf_counter() - t0)
        return fp

    def ensure_eval(self) -> None:
        """Put the encoder back in eval mode if something set train mode (warns once)."""
        enc = self.module
        if isinstance(enc, torch.nn.Module) and enc.training:
            enc.eval()
            if not self._warned_train:
                self._warned_train = True
                logger.warning(
                    "the encoder was back in train mode (model.train() on a parent module?); "
                    "FeatureCache set eval mode again: cached features come from eval mode "
                    "(logged once)"
                )

    def check_weights(self) -> None:
        """Recompute the fingerprint if the weights changed since it was taken."""
        if self.name is not None:
            return
        if self._watch.changed():
            logger.warning(
                "the encoder's weights changed since its fingerprint was computed; recomputing "
                "it (features of the old weights are no longer served). A FeatureCache is meant "
                "for frozen encoders."
            )
            self._watch = WeightWatch(self.module)
            self.fingerprint = self._compute_fingerprint()

    def select(self, out: Any) -> torch.Tensor:
        """The tensor ``output`` selects from what the encoder returned."""
        sel = self.output
        if sel is None:
            value = out
        elif isinstance(out, Mapping) and isinstance(sel, str):
            if sel not in out:
                raise ConfigError(f"encoder output has no key {sel!r}; keys: {list(out)}")
            value = out[sel]
        elif isinstance(sel, int):
            seq = list(out.values()) if isinstance(out, Mapping) else out
            try:
                value = seq[sel]
            except (IndexError, TypeError, KeyError) as exc:
                raise ConfigError(
                    f"cannot take output={sel} of a {type(out).__name__}: {exc}"
                ) from None
        else:
            if not hasattr(out, sel):
                raise ConfigError(f"encoder output {type(out).__name__} has no attribute {sel!r}")
            value = getattr(out, sel)
        if not isinstance(value, torch.Tensor):
            hint = "" if self.output is not None else " (pass output= to select one)"
            raise ConfigError(
                f"the encoder's selected output is a {type(value).__name__}, not a tensor{hint}"
            )
        return value

    def forward(self, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Preprocess + encoder + output selection on a device batch; ``dtype`` result."""
        x = self.preprocess(images) if self.preprocess is not None else images
        y = self.select(self.module(x))
        if y.dim() == 0 or y.shape[0] != images.shape[0]:
            raise ConfigError(
                f"the encoder returned shape {list(y.shape)} for a batch of {images.shape[0]}: "
                "the first dimension must be the batch"
            )
        return y.to(dtype)
