"""Sizes and durations as users write them: ``"512MiB"``, ``"10GiB"``, ``"7d"``.

Sizes are IEC only (KiB, MiB, GiB, TiB; powers of 1024). SI suffixes such as
``"10GB"`` are refused rather than guessed, because a factor of 1.07 on a
memory budget is exactly the kind of silent error a budget exists to prevent.

>>> parse_size("512MiB")
536870912
>>> format_size(3 * 1024**3)
'3.00 GiB'
>>> parse_duration("7d")
604800.0
"""

from __future__ import annotations

import re
from decimal import Decimal

from mmcache.errors import ConfigError

__all__ = [
    "DEFAULT_MEMORY_FRACTION",
    "MAX_SIZE",
    "GiB",
    "KiB",
    "MiB",
    "TiB",
    "format_size",
    "parse_duration",
    "parse_size",
]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

#: Largest size accepted (4 EiB, beyond any machine): file, mapping and shared-memory
#: calls take sizes as signed 64-bit numbers, and the stores add to a budget (LMDB's map
#: is twice the disk budget, a memory tier's largest slot rounds up), so a bound of
#: 2**63 - 1 would still end in OverflowError deep inside LMDB or numpy.
MAX_SIZE = 2**62

#: Share of the host's really-available memory that ``memory="auto"`` takes.
DEFAULT_MEMORY_FRACTION = 0.5

_SIZE_UNITS = {"": 1, "b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Return a byte count from an int or an IEC string (``"1.5GiB"``, ``"4096"``).

    Raises :class:`ConfigError` naming ``name`` (the parameter the caller was given:
    ``memory``, ``disk``...) for negative numbers, unknown or SI units, and sizes
    over :data:`MAX_SIZE` (2**62 bytes).
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an int or a string like '512MiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
        return _bounded(value, value, name)
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be an int or a string like '512MiB', got {value!r}")
    match = _SIZE_RE.match(value)
    if match is None:
        raise ConfigError(f"cannot parse {name} {value!r}: use an int or e.g. '512MiB', '10GiB'")
    number, unit = match.groups()
    factor = _SIZE_UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(
            f"unknown size unit {unit!r} in {name} {value!r}: use IEC units B, KiB, MiB, GiB,"
            " TiB (SI units such as GB are refused to avoid a silent 7% error)"
        )
    # Decimal, not float: "9" * 400 would be float infinity, and int(inf) an OverflowError.
    return _bounded(int(Decimal(number) * factor), value, name)


def _bounded(nbytes: int, value: int | str, name: str) -> int:
    if nbytes > MAX_SIZE:
        raise ConfigError(
            f"{name} must be at most 2**62 bytes (4 EiB), got {value!r}: pass the budget"
            " of the memory or disk it should use, e.g. '64GiB'"
        )
    return nbytes


def format_size(nbytes: float) -> str:
    """Format a byte count with the largest IEC unit that keeps it >= 1."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def parse_duration(value: float | int | str) -> float:
    """Return seconds from a number or a string with an s/m/h/d/w suffix (``"7d"``)."""
    if isinstance(value, bool):
        raise ConfigError(f"duration must be a number or e.g. '7d', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"duration must be >= 0, got {value}")
        return float(value)
    match = _DURATION_RE.match(value)
    if match is None:
        raise ConfigError(f"cannot parse duration {value!r}: use seconds or e.g. '90s', '7d'")
    number, unit = match.groups()
    factor = _DURATION_UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(f"unknown duration unit {unit!r} in {value!r}: use s, m, h, d or w")
    return float(number) * factor
