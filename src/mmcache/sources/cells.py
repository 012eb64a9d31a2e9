"""Image cells of tabular sources (Parquet files, HF datasets): which Arrow types an image
column may have, and one cell's bytes, bounded before they are copied out of Arrow.

An image column holds encoded image bytes (``binary``, ``large_binary``,
``binary_view``, ``fixed_size_binary``) or the HF ``Image`` feature, a struct
``{bytes: binary, path: string}`` whose ``bytes`` may be null when ``path`` names the
file (and whose ``bytes`` field may be typed ``null``: pyarrow infers that type for a
column of structs whose bytes are all null, i.e. every row names a file by path).
Anything else (an int column named by mistake, a list, a string, a struct without
``bytes``) is refused when the source is opened, by :func:`check_image_type`, with the
file and the column named: before it, ``bytes(value)`` of an int cell allocated that many
zero bytes (``bytes(4_000_000_000)``), and other types crashed the epoch with a
``TypeError`` under ``on_error="skip"``.

:func:`image_cell` reads one cell: the size of its Arrow buffer is checked against the
pipeline's limit (:func:`~mmcache.sources.bytesproc.byte_limit`) before the bytes are
copied into Python, so an oversized cell is a :class:`~mmcache.errors.SampleError`
naming the row, not a second copy of it.

Stateless and thread-safe.
"""

from __future__ import annotations

import os
from typing import Any

from mmcache.errors import ManifestError, SampleError
from mmcache.sources.bytesproc import check_size

__all__ = ["check_image_type", "image_cell"]


def _is_bytes_type(pa: Any, t: Any) -> bool:
    view = getattr(pa.types, "is_binary_view", None)
    return bool(
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or (view is not None and view(t))
    )


def _is_text_type(pa: Any, t: Any) -> bool:
    view = getattr(pa.types, "is_string_view", None)
    return bool(
        pa.types.is_string(t) or pa.types.is_large_string(t) or (view is not None and view(t))
    )


def image_type_problem(arrow_type: Any) -> str | None:
    """Why an image column of ``arrow_type`` cannot hold images (``None``: it can)."""
    import pyarrow as pa

    if _is_bytes_type(pa, arrow_type) or pa.types.is_null(arrow_type):
        return None
    if pa.types.is_struct(arrow_type):
        names = [arrow_type.field(i).name for i in range(arrow_type.num_fields)]
        if "bytes" not in names:
            return f"a struct without a 'bytes' field ({arrow_type})"
        data = arrow_type.field("bytes").type
        if not (_is_bytes_type(pa, data) or pa.types.is_null(data)):
            return f"a struct whose 'bytes' field is {data}"
        if "path" in names and not _is_text_type(pa, arrow_type.field("path").type):
            return f"a struct whose 'path' field is {arrow_type.field('path').type}"
        return None
    return f"type {arrow_type}"


def check_image_type(arrow_type: Any, *, column: str, path: str) -> None:
    """ManifestError naming ``path`` and ``column`` unless ``arrow_type`` is an image type
    (see the module docstring)."""
    problem = image_type_problem(arrow_type)
    if problem is not None:
        raise ManifestError(
            f"image column {column!r} holds {problem}: it must be binary (encoded image "
            "bytes) or the HF Image struct {bytes: binary, path: string} (name another "
            "column with columns={'image': ...})",
            path=path,
        )


def _cell_bytes(value: Any, limit: int | None, *, sample_id: str, where: str | None) -> bytes:
    """The bytes of a binary scalar, refused by its buffer's size first."""
    buf = value.as_buffer()
    check_size(buf.size, limit, "the image cell", sample_id=sample_id, path=where)
    data: bytes = buf.to_pybytes()
    return data


def image_cell(
    value: Any,
    base_dir: str,
    *,
    limit: int | None = None,
    sample_id: str = "?",
    where: str | None = None,
) -> tuple[bytes | None, str | None]:
    """``(bytes, None)`` of a pyarrow image cell (``binary``, or the HF ``Image`` struct
    ``{bytes, path}``), ``(None, file)`` for a struct with null bytes and a ``path``
    (joined with ``base_dir`` when relative), ``(None, None)`` for a null image.

    Raises :class:`SampleError` naming ``sample_id`` and ``where`` for a cell over
    ``limit`` bytes (checked before the bytes are copied) or of a type no image column
    may have (a file whose schema was not checked)."""
    if not value.is_valid:
        return None, None
    if hasattr(value, "keys"):  # a struct scalar
        problem = image_type_problem(value.type)
        names = value.keys()
        data = value.get("bytes") if "bytes" in names else None
        if problem is None and data is not None and data.is_valid:
            return _cell_bytes(data, limit, sample_id=sample_id, where=where), None
        path = value.get("path") if "path" in names else None
        if problem is None and path is not None and path.is_valid and path.as_py():
            return None, os.path.normpath(os.path.join(base_dir, str(path.as_py())))
        if problem is None:
            return None, None
    else:
        problem = image_type_problem(value.type)
        if problem is None:
            return _cell_bytes(value, limit, sample_id=sample_id, where=where), None
    raise SampleError(
        f"the image cell holds {problem}, not image bytes", sample_id=sample_id, path=where
    )
