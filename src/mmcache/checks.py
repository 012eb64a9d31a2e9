"""Validation of configuration values: the one int check every constructor uses.

Configuration is keyword-only and validated where it enters (STYLE habit 9);
this module holds the checks that would otherwise be written again in each
class, so that every message has the same form: the name, the rule, the value.
"""

from __future__ import annotations

from mmcache.errors import ConfigError

__all__ = ["SHOWN_CHARS", "check_int", "shown"]

#: The most characters of a value an error message shows: a value from a file or a
#: state dict may be megabytes long (a tampered ``ids``), and a message that echoes
#: it whole buries the rule it breaks.
SHOWN_CHARS = 200


def shown(value: object) -> str:
    """``repr(value)`` for an error message, cut to :data:`SHOWN_CHARS` characters.

    >>> shown("x" * 1000).endswith("xxx... (1002 characters)")
    True
    >>> shown(10**5000)
    '<an int of 16610 bits>'
    """
    try:
        text = repr(value)
    except ValueError:  # an int over sys.get_int_max_str_digits(): repr refuses it
        return f"<an int of {value.bit_length()} bits>" if isinstance(value, int) else "<?>"
    except RecursionError:  # a list nested thousands deep
        return f"<a deeply nested {type(value).__name__}>"
    if len(text) <= SHOWN_CHARS:
        return text
    return f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


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
        raise ConfigError(f"{name} must be an int{rule}, got {shown(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ConfigError(f"{name} must be{rule or ' an int'}, got {shown(value)}")
    return value
