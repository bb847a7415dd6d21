"""The token bucket that emulates a slow link: a sender that waits as told never gets ahead of
``burst + rate x elapsed`` bytes, and a long transfer takes exactly as long as the rate says."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlharvest.services.transfer_agent.throttle import TokenBucket


def send_all(bucket: TokenBucket, chunks: list[int], start: float = 0.0) -> list[float]:
    """A sender on a simulated clock: each chunk goes when the bucket says; returns send times."""
    now, times = start, []
    for n in chunks:
        now += bucket.reserve(n, now)
        times.append(now)
    return times


def test_a_full_bucket_lets_one_burst_through_at_once():
    bucket = TokenBucket(rate=100.0, burst=1000.0, now=0.0)
    assert bucket.reserve(600, 0.0) == 0.0
    assert bucket.reserve(400, 0.0) == 0.0
    assert bucket.reserve(100, 0.0) == pytest.approx(1.0)  # 100 bytes of debt at 100 B/s


def test_a_chunk_larger_than_the_burst_passes_after_paying_its_debt():
    bucket = TokenBucket(rate=1000.0, burst=100.0, now=0.0)
    assert bucket.reserve(1100, 0.0) == pytest.approx(1.0)
    # The debt is paid by time 1.0: the next byte waits only for itself.
    assert bucket.reserve(10, 1.0) == pytest.approx(0.01)


def test_idle_time_refills_tokens_but_never_beyond_the_burst():
    bucket = TokenBucket(rate=10.0, burst=50.0, now=0.0)
    assert bucket.reserve(50, 0.0) == 0.0
    assert bucket.reserve(30, 3.0) == 0.0  # 30 tokens back after 3 s
    assert bucket.reserve(50, 1000.0) == 0.0  # a long idle refills to 50, not 10 000
    assert bucket.reserve(1, 1000.0) == pytest.approx(0.1)


def test_a_long_transfer_takes_what_the_rate_says():
    bucket = TokenBucket(rate=1e6, burst=1e5, now=0.0)
    times = send_all(bucket, [10_000] * 1000)  # 10 MB in 10 kB chunks
    assert times[-1] == pytest.approx((10e6 - 1e5) / 1e6)


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(1.0, 1e9), burst=st.floats(1.0, 1e8),
       chunks=st.lists(st.integers(0, 1 << 24), min_size=1, max_size=50),
       start=st.floats(0.0, 1e6))
def test_a_sender_that_waits_never_gets_ahead_of_the_link(rate, burst, chunks, start):
    bucket = TokenBucket(rate, burst, now=start)
    clock_ulp = 1e-9 * max(start, 1.0)  # float clock readings far from 0 are coarse
    sent = 0
    for n, at in zip(chunks, send_all(bucket, chunks, start)):
        sent += n
        assert sent <= burst + rate * (at - start + clock_ulp) + 1e-9 * sent
        # ...and it is never held back longer than the link needs.
        assert at - start <= max(0.0, (sent - burst) / rate) + clock_ulp + 1e-9 * (at - start)


@pytest.mark.parametrize("rate,burst", [(0, 1), (1, 0), (-5, 10)])
def test_a_bucket_without_rate_or_burst_is_refused(rate, burst):
    with pytest.raises(ValueError, match="rate > 0 and burst > 0"):
        TokenBucket(rate, burst, now=0.0)
