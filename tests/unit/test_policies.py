import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmcache.errors import ConfigError
from mmcache.policies import (
    LRUPolicy,
    Policy,
    Residents,
    ValuePolicy,
    get_policy,
    policy_names,
    register_policy,
    validate_victims,
)


def test_registered_names() -> None:
    assert {"value", "keep", "lru", "fifo", "lfu"} <= set(policy_names())


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="lru"):
        get_policy("mru")


def test_register_custom_policy() -> None:
    @register_policy("test-largest-first")
    class Largest(Policy):
        def select_victims(self, residents, *, size, cost, need):  # type: ignore[no-untyped-def]
            return np.argsort(-residents.size)[:1]

    assert isinstance(get_policy("test-largest-first"), Largest)
    with pytest.raises(ConfigError):
        register_policy("test-largest-first")(Largest)


def test_keep_never_evicts() -> None:
    r = Residents.from_columns(size=[10, 10], cost=[0.0, 0.0])
    assert get_policy("keep").select_victims(r, size=10, cost=100.0, need=10) is None


def test_lru_evicts_least_recently_used_until_enough_is_free() -> None:
    r = Residents.from_columns(size=[10, 10, 10], atime=[5.0, 1.0, 3.0])
    assert get_policy("lru").select_victims(r, size=15, cost=0.0, need=15).tolist() == [1, 2]


def test_fifo_evicts_oldest_admission() -> None:
    r = Residents.from_columns(size=[10, 10, 10], atime=[0.0, 9.0, 9.0], seq=[7, 3, 5])
    assert get_policy("fifo").select_victims(r, size=10, cost=0.0, need=10).tolist() == [1]


def test_lfu_evicts_least_read() -> None:
    r = Residents.from_columns(size=[10, 10, 10], hits=[4, 0, 2])
    assert get_policy("lfu").select_victims(r, size=10, cost=0.0, need=10).tolist() == [1]


def test_eviction_policies_refuse_when_not_enough_can_be_freed() -> None:
    r = Residents.from_columns(size=[10])
    for name in ("lru", "fifo", "lfu"):
        assert get_policy(name).select_victims(r, size=50, cost=1.0, need=50) is None


def test_value_keeps_incumbent_on_equal_value() -> None:
    r = Residents.from_columns(size=[100, 100], cost=[1.0, 1.0])
    assert get_policy("value").select_victims(r, size=100, cost=1.0, need=100) is None


def test_value_ignores_noise_below_the_margin() -> None:
    r = Residents.from_columns(size=[100, 100], cost=[1.0, 1.0])
    assert ValuePolicy(margin=1.5).select_victims(r, size=100, cost=1.4, need=100) is None


def test_value_replaces_least_dense_when_clearly_worth_more() -> None:
    r = Residents.from_columns(size=[100, 100, 100], cost=[5.0, 1.0, 3.0])
    victims = get_policy("value").select_victims(r, size=100, cost=2.0, need=100)
    assert victims is not None
    assert victims.tolist() == [1]


def test_value_refuses_when_victims_needed_are_too_valuable() -> None:
    # Freeing 150 bytes needs the two least dense entries; the second is as dense as the newcomer.
    r = Residents.from_columns(size=[100, 100], cost=[0.1, 3.0])
    assert get_policy("value").select_victims(r, size=150, cost=4.0, need=150) is None


def test_value_margin_validated() -> None:
    with pytest.raises(ConfigError):
        ValuePolicy(margin=0.5)


@given(
    sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=40),
    need=st.integers(1, 5000),
    name=st.sampled_from(["lru", "fifo", "lfu", "value"]),
    seed=st.integers(0, 1000),
)
def test_victims_free_enough_and_are_distinct(
    sizes: list[int], need: int, name: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    n = len(sizes)
    r = Residents.from_columns(
        size=sizes, cost=rng.random(n), atime=rng.random(n), hits=rng.integers(0, 5, n)
    )
    policy = get_policy(name)
    victims = policy.select_victims(r, size=need, cost=1e9, need=need)
    checked = validate_victims(policy, r, victims, need=need)  # every built-in answer passes
    assert checked.problem is None and checked.admitted == (victims is not None)
    if victims is None:
        assert name == "value" or sum(sizes) < need
        return
    assert len(set(victims.tolist())) == len(victims)
    assert int(r.size[victims].sum()) >= need
    assert all(0 <= v < n for v in victims.tolist())


# -- the one check of a policy's answer (every tier calls validate_victims) ---------------
def test_validate_victims_accepts_rows_as_a_set() -> None:
    r = Residents.from_columns(size=[100, 50, 70, 30])
    lru = LRUPolicy()
    got = validate_victims(lru, r, np.array([3, 0, 3], dtype=np.int32), need=120)
    assert got.admitted and got.rows is not None and got.rows.tolist() == [0, 3]
    assert got.rows.dtype == np.int64 and got.freed == 130 and got.problem is None
    assert validate_victims(lru, r, [2], need=70).freed == 70  # a list, exactly enough
    refused = validate_victims(lru, r, None, need=10)
    assert not refused.admitted and refused.problem is None  # the policy said no: no bug
    nothing = validate_victims(lru, r, np.zeros(0), need=0)  # nothing needed, nothing chosen
    assert nothing.admitted and nothing.rows is not None and nothing.rows.size == 0


def test_validate_victims_refuses_answers_that_free_too_little() -> None:
    r = Residents.from_columns(size=[100, 50])
    lru = LRUPolicy()
    short = validate_victims(lru, r, [1], need=120)
    assert not short.admitted and short.freed == 50
    assert short.problem is not None and "50 of the 120 bytes" in short.problem
    full = validate_victims(lru, r, [], need=0, entries=1)  # a full index needs a free slot
    assert not full.admitted and full.problem is not None and "entries" in full.problem
    assert validate_victims(lru, r, [0], need=0, entries=1).admitted


@pytest.mark.parametrize(
    ("answer", "match"),
    [([2], "outside the 2 residents"), ([-1], "outside"), ([0.5], "float64"),
     (np.array([True, False]), "bool"), (["0"], "not row numbers")],
)  # fmt: skip
def test_validate_victims_raises_for_a_broken_policy(answer: object, match: str) -> None:
    r = Residents.from_columns(size=[100, 50])
    with pytest.raises(ConfigError, match=match) as info:
        validate_victims(LRUPolicy(), r, answer, need=10)
    assert "LRUPolicy()" in str(info.value)
