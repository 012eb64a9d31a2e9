"""Validation of configuration values: the one int check every constructor uses.

Configuration is keyword-only and validated where it enters (STYLE habit 9);
this module holds the checks that would otherwise be written again in each
class, so that every message has the same form: the name, the rule, the value.
"""

from __future__ import annotations

from mmcache.errors import ConfigError

__all__ = ["check_int"]


def check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) within ``[minimum, maximum]``.

    Raises :class:`ConfigError` naming ``name``, the rule and the value otherwise.

    >>> check_int("batch_size", 64, minimum=1)
    64
    """
    rule = (
        f" in [{minimum}, {maximum}]"
        if minimum is not None and maximum is not None
        else f" >= {minimum}"
        if minimum is not None
        else f" <= {maximum}"
        if maximum is not None
        else ""
    )
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int{rule}, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ConfigError(f"{name} must be{rule or ' an int'}, got {value}")
    return value
