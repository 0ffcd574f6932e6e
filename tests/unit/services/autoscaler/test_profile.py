"""The performance profile: interpolation between measured points, edges held, a batch
beyond the measured refused, JSON round trip, the test data's profile loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.autoscaler.profile import (
    DecodeProfile,
    PerformanceProfile,
    PrefillProfile,
    load_profile,
    save_profile,
)

DATA = Path(__file__).resolve().parents[3] / "data" / "autoscaler_profile.json"


def small() -> PerformanceProfile:
    return PerformanceProfile(
        model="m",
        source="hand",
        prefill=PrefillProfile(1, (100, 1000), (1000.0, 4000.0)),
        decode=DecodeProfile(2, (1, 8), (100, 1100), ((0.010, 0.020), (0.020, 0.040))),
    )


def test_prefill_interpolates_and_holds_its_edges() -> None:
    p = small().prefill
    assert p.throughput(550) == pytest.approx(2500.0)
    assert p.throughput(10) == 1000.0 and p.throughput(5000) == 4000.0
    assert p.service_s(1000) == pytest.approx(0.25)


def test_decode_is_bilinear_and_bounded_by_the_largest_batch() -> None:
    d = small().decode
    assert d.itl(1, 600) == pytest.approx(0.015)
    assert d.itl(4.5, 100) == pytest.approx(0.015)
    assert d.itl(4.5, 600) == pytest.approx(0.0225)
    assert d.tokens_per_s(8, 100) == pytest.approx(400.0)
    with pytest.raises(ValueError, match="beyond"):
        d.itl(9, 100)


def test_malformed_profiles_are_refused() -> None:
    with pytest.raises(ValueError):
        PrefillProfile(1, (100, 100), (1.0, 2.0))
    with pytest.raises(ValueError):
        DecodeProfile(1, (1, 2), (10,), ((0.1,),))
    with pytest.raises(ValueError, match="missing"):
        PerformanceProfile.from_dict({"prefill": {}})


def test_round_trip(tmp_path: Path) -> None:
    save_profile(small(), tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == small()


def test_the_test_data_profile_loads() -> None:
    profile = load_profile(DATA)
    assert profile.decode.gpus == 2 and profile.prefill.gpus == 1
