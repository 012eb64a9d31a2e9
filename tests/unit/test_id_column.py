"""``IdColumn.ids`` (issue 28: the warm path reads a batch's ids every batch).

An ASCII column serves a batch's ids as slices of one str made once; any other column
decodes each id from the UTF-8 buffer. Both must give exactly the ids the column was
made of, in the order asked, and a pickled column (what the workers get) carries only
its two arrays.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from mmcache.sources.ids import IdColumn


@pytest.mark.parametrize(
    "values",
    [
        ["a", "bb", "", "ccc", "dd/ee.jpg"],  # ASCII: str slices
        ["é", "x", "日本", "", "\udcff"],  # not ASCII (a lone surrogate too): decoded per id
        ["", "", "", "", ""],  # an empty buffer
    ],
)
def test_ids_are_the_column_values_in_the_order_asked(values: list[str]) -> None:
    col = IdColumn.of_strings(values)
    idx = np.array([4, 0, 1, 1, 3, 2], dtype=np.int64)
    want = [values[i] for i in idx.tolist()]
    assert col.ids(idx) == want
    assert col.ids(idx) == want  # again, with the str made by the first call
    assert [col.id(i) for i in idx.tolist()] == want
    again = pickle.loads(pickle.dumps(col))
    assert again.__dict__.get("_text") is None  # not pickled: workers get the arrays only
    assert again.ids(idx) == want
    assert col.take(idx).ids(np.arange(len(idx))) == want
