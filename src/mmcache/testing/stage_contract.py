"""The contract every :class:`~mmcache.transforms.stage.Stage` must pass, as a pytest base class.

Subclass it in a test module, set ``__test__ = True`` and implement
:meth:`StageContract.make_stage`, :meth:`StageContract.variants` and
:meth:`StageContract.make_input`::

    class TestMyStage(StageContract):
        __test__ = True

        def make_stage(self):
            return MyStage(strength=1)

        def variants(self):
            return [MyStage(strength=2), MyStage(strength=1, mode="other")]

        def make_input(self):
            return Image.new("RGB", (64, 48), (10, 20, 30))

A stage's fingerprint is part of every cache key, so the rules are about it:
it is a non-empty string; stable across calls, re-construction with the same
configuration (:meth:`StageContract.same_config`) and pickling into a spawned
worker process (:mod:`mmcache.testing.spawned`); different for every
configuration that changes the output (:meth:`StageContract.variants`). The
output follows the rules of the stage's kind (:meth:`StageContract.check_output`)
and is deterministic, in this process and in the worker.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
import pytest

from mmcache.testing.spawned import spawned_worker
from mmcache.transforms.stage import Stage

__all__ = ["StageContract"]


def _in_a_worker(stage: Stage, value: Any) -> tuple[str, Any]:
    """A worker's copy of ``stage``: its fingerprint and output (run in a spawned process)."""
    return stage.fingerprint(), stage(value)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b)


class StageContract:
    """Contract tests for a :class:`Stage`; subclasses provide the stage and its input."""

    __test__ = False

    def make_stage(self) -> Stage:
        """A new stage in a fixed configuration (each call builds it again)."""
        raise NotImplementedError

    def variants(self) -> Sequence[Stage]:
        """Stages whose configuration changes the output: each must have a fingerprint
        of its own (and unlike :meth:`make_stage`'s)."""
        raise NotImplementedError

    def same_config(self) -> Sequence[Stage]:
        """Stages built another way with :meth:`make_stage`'s configuration (from a
        file instead of an object, with settings that do not change the output): same
        fingerprint. None by default."""
        return []

    def make_input(self) -> Any:
        """A fresh input the stage accepts (a decoded ``PIL.Image``, a string...)."""
        raise NotImplementedError

    def check_output(self, stage: Stage, output: Any) -> None:
        """Assert the output rules of ``stage``'s kind; extend it for stage-specific shapes.

        ``"image"``: a C-contiguous ``uint8`` array ``[C, H, W]`` with 1 or 3 channels.
        ``"text"``: a non-empty dict of 1-D integer arrays of one length.
        """
        if stage.kind == "image":
            assert isinstance(output, np.ndarray), type(output)
            assert output.dtype == np.uint8 and output.ndim == 3, (output.dtype, output.shape)
            assert output.shape[0] in (1, 3) and output.flags.c_contiguous
        else:
            assert stage.kind == "text", stage.kind
            assert isinstance(output, dict) and output, type(output)
            lengths = set()
            for name, array in output.items():
                assert isinstance(name, str) and isinstance(array, np.ndarray), name
                assert array.ndim == 1 and np.issubdtype(array.dtype, np.integer), name
                lengths.add(array.shape[0])
            assert len(lengths) == 1, lengths

    @pytest.fixture(scope="class")
    @classmethod
    def worker(cls) -> Iterator[ProcessPoolExecutor]:
        """A spawn-started worker process (one per test class)."""
        with spawned_worker() as pool:
            yield pool

    # ------------------------------------------------------------------ fingerprint

    def test_is_a_stage(self) -> None:
        stage = self.make_stage()
        assert isinstance(stage, Stage)
        assert stage.kind in ("image", "text")

    def test_fingerprint_is_stable(self) -> None:
        stage = self.make_stage()
        fingerprint = stage.fingerprint()
        assert isinstance(fingerprint, str) and fingerprint
        assert stage.fingerprint() == fingerprint
        assert self.make_stage().fingerprint() == fingerprint  # re-constructed
        for other in self.same_config():
            assert other.fingerprint() == fingerprint, other

    def test_fingerprint_differs_when_configuration_differs(self) -> None:
        fingerprints = [self.make_stage().fingerprint()]
        fingerprints += [v.fingerprint() for v in self.variants()]
        assert len(fingerprints) >= 2, "give at least one variant"
        assert len(set(fingerprints)) == len(fingerprints), fingerprints

    # ------------------------------------------------------------------ output

    def test_output_follows_the_rules_of_its_kind(self) -> None:
        for stage in (self.make_stage(), *self.variants()):
            self.check_output(stage, stage(self.make_input()))

    def test_output_is_deterministic(self) -> None:
        stage = self.make_stage()
        first = stage(self.make_input())
        assert _equal(stage(self.make_input()), first)
        assert _equal(self.make_stage()(self.make_input()), first)

    def test_a_spawned_worker_has_the_same_stage(self, worker: ProcessPoolExecutor) -> None:
        stage = self.make_stage()
        fingerprint, output = worker.submit(_in_a_worker, stage, self.make_input()).result(
            timeout=300
        )
        assert fingerprint == stage.fingerprint(), "the fingerprint changed across pickling"
        assert _equal(output, stage(self.make_input()))
