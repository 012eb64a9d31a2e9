import pickle

import pytest

from mmcache.errors import (
    CacheError,
    ConfigError,
    CorruptEntryError,
    ManifestError,
    MmcacheError,
    SampleError,
)
from mmcache.units import GiB, MiB, format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * MiB),
        ("1.5GiB", int(1.5 * GiB)),
        ("4096", 4096),
        (" 2 KiB ", 2048),
        ("10gib", 10 * GiB),
        (0, 0),
        (7, 7),
        ("3B", 3),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["10GB", "1 MB", "abc", "-1MiB", -5, "1.2.3GiB", True])
def test_parse_size_refuses(bad: object) -> None:
    with pytest.raises(ConfigError, match="size"):
        parse_size(bad)  # type: ignore[arg-type]


def test_si_units_are_refused_with_a_reason() -> None:
    with pytest.raises(ConfigError, match="IEC"):
        parse_size("10GB")


def test_format_size() -> None:
    assert format_size(100) == "100 B"
    assert format_size(3 * GiB) == "3.00 GiB"
    assert format_size(1536) == "1.50 KiB"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("7d", 7 * 86400.0), ("90s", 90.0), ("2h", 7200.0), ("5m", 300.0), (12, 12.0), ("1.5", 1.5)],
)
def test_parse_duration(text: str | int, expected: float) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("bad", ["7y", "soon", -1])
def test_parse_duration_refuses(bad: object) -> None:
    with pytest.raises(ConfigError):
        parse_duration(bad)  # type: ignore[arg-type]


def test_errors_subclass_builtins_callers_catch() -> None:
    assert issubclass(ManifestError, ValueError)
    assert issubclass(SampleError, ValueError)
    assert issubclass(CacheError, OSError)
    assert issubclass(CorruptEntryError, CacheError)
    assert issubclass(ConfigError, ValueError)
    for cls in (ManifestError, SampleError, CacheError, ConfigError):
        assert issubclass(cls, MmcacheError)


def test_manifest_error_message_and_pickle() -> None:
    err = ManifestError("missing key 'caption'", path="data/train.jsonl", line=7, sample_id="a1")
    assert str(err) == "data/train.jsonl:7 (id 'a1'): missing key 'caption'"
    back = pickle.loads(pickle.dumps(err))
    assert (back.path, back.line, back.sample_id, back.reason) == (
        "data/train.jsonl",
        7,
        "a1",
        "missing key 'caption'",
    )
    assert str(back) == str(err)


def test_sample_error_message_and_pickle() -> None:
    err = SampleError("file not found", sample_id="x", path="/d/x.jpg")
    assert str(err) == "sample 'x' (/d/x.jpg): file not found"
    back = pickle.loads(pickle.dumps(err))
    assert (back.sample_id, back.path, back.reason) == ("x", "/d/x.jpg", "file not found")


@pytest.mark.parametrize("huge", [2**62 + 1, 2**63, 2**70, "5000000TiB", "9" * 400 + "TiB"])
def test_sizes_beyond_any_machine_are_config_errors_naming_the_parameter(huge: object) -> None:
    """Not an OverflowError from deep inside LMDB or numpy: the parameter and the bound."""
    with pytest.raises(ConfigError, match=r"^disk must be at most 2\*\*62 bytes"):
        parse_size(huge, name="disk")  # type: ignore[arg-type]
    assert parse_size(2**62) == 2**62
