"""``Mixture``'s semantics without a loader: exact per-part counts for every option over
epochs and seeds, the walk of fractional parts through their samples, the draw's
independence from the other parts, and a ConfigError naming the part for every bad
option (Streaming's repeat / choose / proportion rules, see ``Mixture``'s docstring)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mmcache as mc
from mmcache.errors import ConfigError
from mmcache.sampler import EpochSampler
from mmcache.testing.sft import SyntheticSFTSource


def _src(n: int, seed: int = 0, **kw: object) -> SyntheticSFTSource:
    return SyntheticSFTSource(n, seed=seed, **kw)  # type: ignore[arg-type]


def _per_part(mix: mc.Mixture, seed: int, epoch: int) -> list[np.ndarray]:
    """Each part's samples of ``epoch`` (as positions in the part), counted."""
    drawn = mix.draw.indices(seed, epoch)
    offsets = mix.draw.offsets
    parts = mix.part_of(drawn)
    return [
        np.bincount(drawn[parts == k] - offsets[k], minlength=int(mix.draw.sizes[k]))
        for k in range(len(mix.part_names))
    ]


def _half_up(value: Fraction) -> int:
    return (2 * value.numerator + value.denominator) // (2 * value.denominator)


# A part: its size and one option, as a decimal the user writes (repeat in quarters and
# tenths, choose in samples) or none.
_options = st.one_of(
    st.just(("none", None)),
    st.builds(lambda k: ("repeat", k / 4), st.integers(0, 14)),
    st.builds(lambda k: ("repeat", k / 10), st.integers(0, 35)),
    st.builds(lambda k: ("choose", k), st.integers(0, 90)),
)
_parts = st.lists(st.tuples(st.integers(1, 30), _options), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(parts=_parts, seed=st.integers(0, 3))
def test_absolute_options_give_exact_counts_every_epoch(
    parts: list[tuple[int, tuple[str, float | int | None]]], seed: int
) -> None:
    mix = mc.Mixture(
        [
            mc.MixturePart(_src(n, seed=i), name=f"p{i}", **({} if kind == "none" else {kind: v}))
            for i, (n, (kind, v)) in enumerate(parts)
        ]
    )
    want = []
    for n, (kind, v) in parts:
        if kind == "none":
            want.append(n)
        elif kind == "choose":
            want.append(int(v))  # type: ignore[arg-type]
        else:
            want.append(_half_up(Fraction(str(v)) * n))
    assert len(mix) == sum(want)
    assert list(mix.counts.values()) == want
    for epoch in range(4):
        for k, counts in enumerate(_per_part(mix, seed, epoch)):
            n = parts[k][0]
            assert int(counts.sum()) == want[k]
            whole, extra = divmod(want[k], n)
            # each sample floor(r) times plus, for a fraction, once more (no repeat within)
            assert set(np.unique(counts).tolist()) <= {whole, whole + 1}
            assert int((counts == whole + 1).sum()) == extra
        # the sampler's order of the epoch is exactly these samples, shuffled
        sampler = EpochSampler(len(mix), seed=seed, draw=mix.draw)
        assert sorted(sampler.permutation(epoch).tolist()) == sorted(
            mix.draw.indices(seed, epoch).tolist()
        )


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 25), min_size=1, max_size=4),
    weights=st.lists(st.integers(0, 10), min_size=4, max_size=4),
    epoch_size=st.integers(0, 200),
)
def test_proportions_split_epoch_size_exactly(
    sizes: list[int], weights: list[int], epoch_size: int
) -> None:
    weights = weights[: len(sizes)]
    if not sum(weights):
        weights[0] = 1
    total = sum(weights)
    # proportions as decimals that sum to 1: k/total rounded to 6 places, the last made up
    props = [round(w / total, 6) for w in weights[:-1]]
    props.append(round(1 - sum(props), 6))
    if props[-1] < 0:
        return
    mix = mc.Mixture(
        [
            mc.MixturePart(_src(n, seed=i), name=f"p{i}", proportion=p)
            for i, (n, p) in enumerate(zip(sizes, props, strict=True))
        ],
        epoch_size=epoch_size,
    )
    assert len(mix) == epoch_size
    for k, count in enumerate(mix.counts.values()):
        quota = props[k] * epoch_size
        assert abs(count - quota) < 1 + 1e-6  # each count is its quota's floor or ceiling
        assert int(_per_part(mix, 7, 3)[k].sum()) == count


def test_epoch_size_without_proportions_rescales_the_parts() -> None:
    """Streaming: with no option and an epoch_size, parts in proportion to their size."""
    mix = mc.Mixture(
        [mc.MixturePart(_src(30), name="a"), mc.MixturePart(_src(10, seed=1), name="b")],
        epoch_size=20,
    )
    assert mix.counts == {"a": 15, "b": 5} and len(mix) == 20


@pytest.mark.parametrize(("n", "repeat"), [(10, 0.5), (12, 0.25), (9, 1 / 3), (8, 0.75)])
def test_a_fractional_part_walks_through_its_samples(n: int, repeat: float) -> None:
    """Epochs 0..k-1 with k * count a multiple of n see every sample equally often; any
    number of epochs sees no sample more than once more than another."""
    mix = mc.Mixture([mc.MixturePart(_src(n), name="a", repeat=repeat)])
    count = mix.counts["a"]
    for seed in range(3):
        seen = np.zeros(n, dtype=np.int64)
        for epoch in range(12):
            one = _per_part(mix, seed, epoch)[0]
            assert one.max() <= 1  # without replacement inside an epoch
            seen += one
            assert seen.max() - seen.min() <= 1
            if ((epoch + 1) * count) % n == 0:
                assert seen.min() == seen.max() == (epoch + 1) * count // n


def test_half_of_an_even_part_pairs_epochs_into_one_pass() -> None:
    mix = mc.Mixture([mc.MixturePart(_src(10), name="a", repeat=0.5)])
    for k in range(4):
        both = np.concatenate([mix.draw.indices(5, 2 * k), mix.draw.indices(5, 2 * k + 1)])
        assert sorted(both.tolist()) == list(range(10))
    # and the passes differ (a new permutation each time)
    assert sorted(mix.draw.indices(5, 0).tolist()) != sorted(mix.draw.indices(5, 2).tolist())


def test_the_draw_depends_on_seed_epoch_and_part_only() -> None:
    a = mc.MixturePart(_src(20), name="a", repeat=0.3)
    alone = mc.Mixture([a])
    more = mc.Mixture([mc.MixturePart(_src(7, seed=2), name="b", repeat=2), a])
    for epoch in range(3):
        mine = _per_part(alone, 1, epoch)[0]
        assert np.array_equal(mine, _per_part(more, 1, epoch)[1])  # another part added first
        assert np.array_equal(mine, _per_part(mc.Mixture([a]), 1, epoch)[0])  # rebuilt
    assert not np.array_equal(_per_part(alone, 1, 0)[0], _per_part(alone, 2, 0)[0])
    assert not np.array_equal(_per_part(alone, 1, 0)[0], _per_part(alone, 1, 1)[0])


def test_len_is_one_epoch_and_indices_cover_the_parts() -> None:
    mix = mc.Mixture([mc.MixturePart(_src(4), name="a", repeat=3), _src(5, seed=9)])
    assert len(mix) == 17 and mix.unique_samples == 9
    assert mix.part_names == ("a", "part1")
    assert mix.part_of([0, 3, 4, 8]).tolist() == [0, 0, 1, 1]
    assert mix.ids([4, 0]) == ["sft-000000", "sft-000000"]
    assert mix.key(4) == _src(5, seed=9).key(0)  # a part's own keys
    assert mix.to_item(5, mix.produce(5))["part"] == "part1"
    assert mix.planned_reads(0) == 3.0 and mix.planned_reads(8) == 1.0
    with pytest.raises(IndexError):
        mix.key_rows([9])


@pytest.mark.parametrize(
    ("part", "words"),
    [
        (dict(repeat=2, choose=3), "at most one of repeat, choose and proportion"),
        (dict(repeat=-1), "repeat must be a finite number >= 0"),
        (dict(repeat=float("nan")), "repeat must be a finite number >= 0"),
        (dict(repeat="2"), "repeat must be a finite number >= 0"),
        (dict(choose=-3), "choose must be an int >= 0"),
        (dict(choose=2.5), "choose must be an int >= 0"),
        (dict(choose=True), "choose must be an int >= 0"),
        (dict(proportion=1.5), "proportion must be in [0, 1]"),
        (dict(proportion=-0.1), "proportion must be a finite number >= 0"),
        (dict(proportion=0.5), "pass Mixture(..., epoch_size=N)"),
    ],
)
def test_every_bad_option_is_a_config_error_naming_the_part(
    part: dict[str, object], words: str
) -> None:
    with pytest.raises(ConfigError, match="'bad'") as err:
        mc.Mixture(
            [mc.MixturePart(_src(4), name="good"), mc.MixturePart(_src(4), name="bad", **part)]
        )  # type: ignore[arg-type]
    assert words in str(err.value)


def test_mixtures_of_parts_that_do_not_fit_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="'b' has choose=3 but part 'a' has proportion"):
        mc.Mixture(
            [
                mc.MixturePart(_src(4), name="a", proportion=1.0),
                mc.MixturePart(_src(4, seed=1), name="b", choose=3),
            ],
            epoch_size=10,
        )
    with pytest.raises(ConfigError, match=r"proportions must sum to 1, got 0\.8"):
        mc.Mixture(
            [
                mc.MixturePart(_src(4), name="a", proportion=0.5),
                mc.MixturePart(_src(4, seed=1), name="b", proportion=0.3),
            ],
            epoch_size=10,
        )
    with pytest.raises(ConfigError, match=r"'b' gives other batch fields .* pad token id 5"):
        mc.Mixture(
            [mc.MixturePart(_src(4), name="a"), mc.MixturePart(_src(4, pad_token_id=5), name="b")]
        )
    with pytest.raises(ConfigError, match="'b' has on_error='skip'"):
        mc.Mixture(
            [mc.MixturePart(_src(4), name="a"), mc.MixturePart(_src(4, on_error="skip"), name="b")]
        )
    with pytest.raises(ConfigError, match="parts 0 and 1 are both named 'a'"):
        mc.Mixture([mc.MixturePart(_src(4), name="a"), mc.MixturePart(_src(4), name="a")])
    with pytest.raises(ConfigError, match="'b' has no samples"):
        mc.Mixture([mc.MixturePart(_src(4), name="a"), mc.MixturePart(_src(0), name="b", choose=2)])
    with pytest.raises(ConfigError, match="part 'p': its source must be a mmcache source"):
        mc.Mixture([mc.MixturePart([1, 2, 3], name="p")])
    with pytest.raises(ConfigError, match="at least one part"):
        mc.Mixture([])
    with pytest.raises(ConfigError, match="epoch_size must be an int"):
        mc.Mixture([_src(3)], epoch_size=-1)
