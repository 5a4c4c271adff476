import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attn_probe.live.schedules import any_of, as_schedule, every, log_spaced


@given(n=st.integers(1, 500), offset=st.integers(0, 50), step=st.integers(0, 5000))
def test_every_fires_exactly_on_the_grid(n, offset, step):
    assert every(n, offset)(step) == (step >= offset and (step - offset) % n == 0)


def test_every_lists():
    assert [t for t in range(25) if every(10)(t)] == [0, 10, 20]
    assert [t for t in range(25) if every(10, offset=5)(t)] == [5, 15]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"], ids=repr)
def test_every_rejects_bad_n(bad):
    with pytest.raises(ValueError, match="every="):
        every(bad)


def test_log_spaced_is_dense_early_sparse_late():
    sched = log_spaced(per_decade=5)
    fired = [t for t in range(100_001) if sched(t)]
    assert fired[:6] == [0, 1, 2, 3, 4, 6]
    # the points are round(10 ** (k / 5)); each decade gets 5 of them
    expected = sorted({0} | {int(round(10 ** (k / 5))) for k in range(26)})
    assert fired == expected
    gaps = [b - a for a, b in zip(fired[1:], fired[2:], strict=False)]
    assert gaps[0] == 1 and gaps[-1] > 30_000
    for lo in (10, 100, 1000, 10_000):
        assert sum(lo <= t < 10 * lo for t in fired) == 5


def test_log_spaced_max_interval_bounds_the_gaps():
    sched = log_spaced(per_decade=3, max_interval=500)
    fired = [t for t in range(20_001) if sched(t)]
    assert max(b - a for a, b in zip(fired, fired[1:], strict=False)) <= 500
    assert all(sched(t) for t in range(0, 20_001, 500))


def test_log_spaced_start():
    sched = log_spaced(per_decade=1, start=7)
    assert [t for t in range(1000) if sched(t)] == [0, 7, 70, 700]
    with pytest.raises(ValueError):
        log_spaced(per_decade=0)


def test_as_schedule_and_combination():
    assert as_schedule(None) is None
    s = as_schedule(4)
    assert [t for t in range(10) if s(t)] == [0, 4, 8]

    def primes(t: int) -> bool:
        return t > 1 and all(t % d for d in range(2, int(math.isqrt(t)) + 1))

    assert as_schedule(primes) is primes
    both = any_of(every(10), primes)
    assert [t for t in range(12) if both(t)] == [0, 2, 3, 5, 7, 10, 11]
    with pytest.raises(TypeError):
        as_schedule("often")
