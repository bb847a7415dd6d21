"""Latency profiles: interpolation between profiled points, the online correction, JSON."""

from __future__ import annotations

import json

import pytest

from rlharvest.services.coexecutor.latency_profile import LatencyProfile, ProfileError


def profile() -> LatencyProfile:
    return LatencyProfile({"mono": ((1, 0.01), (512, 0.05), (2048, 0.2)),
                           "chunk": ((1, 0.01), (512, 0.05), (2048, 0.23))},
                          ((1, 0.02), (16, 0.03), (64, 0.06)))


def test_times_are_interpolated_between_points_and_extended_past_them():
    p = profile()
    assert p.prefill_s(512) == pytest.approx(0.05)
    assert p.prefill_s(1280) == pytest.approx(0.125)  # halfway between 512 and 2048
    assert p.prefill_s(3584) == pytest.approx(0.35)  # the last segment, extended
    assert p.prefill_s(2048, "chunk") == pytest.approx(0.23)
    assert p.decode_s(40) == pytest.approx(0.045)
    assert p.decode_s(0) == 0.0 and p.prefill_s(0) == 0.0


def test_the_correction_moves_predictions_toward_what_the_device_measures():
    p = profile()
    for _ in range(40):
        p.observe_decode(16, 0.06)  # the device is twice as slow as profiled
    assert p.decode_s(16) == pytest.approx(0.06, rel=1e-3)
    assert p.prefill_s(512) == pytest.approx(0.05)  # prefill is corrected on its own
    p.observe_prefill(512, "mono", float("nan"))  # a broken measurement teaches nothing
    assert p.prefill_s(512) == pytest.approx(0.05)


def test_a_profile_round_trips_through_json_and_a_bad_one_names_its_field():
    p = profile()
    again = LatencyProfile.from_dict(json.loads(json.dumps(p.to_dict())))
    assert again.prefill == p.prefill and again.decode == p.decode
    with pytest.raises(ProfileError, match="lacks modes"):
        LatencyProfile({"mono": ((1, 0.1),)}, ((1, 0.1),))
    with pytest.raises(ProfileError, match=r"decode: x must be >= 1 and strictly increasing"):
        LatencyProfile(p.prefill, ((4, 0.1), (2, 0.2)))
    with pytest.raises(ProfileError, match="format"):
        LatencyProfile.from_dict({"format": 99})
    with pytest.raises(ProfileError, match="malformed"):
        LatencyProfile.from_dict({"format": 1, "prefill": {}})


def test_the_linear_profile_charges_chunked_prefill_one_base_per_chunk():
    p = LatencyProfile.linear(prefill_base_s=0.01, prefill_per_token_s=1e-4, decode_base_s=0.02,
                              decode_per_seq_s=1e-3)
    assert p.prefill_s(1024, "chunk") == pytest.approx(p.prefill_s(1024, "mono") + 0.01)
    assert p.decode_s(8) == pytest.approx(0.028)
