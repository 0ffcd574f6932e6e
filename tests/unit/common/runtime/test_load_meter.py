"""A rank's loading is counted by the current meter of its thread, shown against its share
(capped below 100 % until loaded), and crosses the group's store as JSON."""

from __future__ import annotations

import threading

from common.runtime.load_meter import LoadMeter, RankLoad, current_meter, metering

GIB = 2**30


def test_progress_against_the_share() -> None:
    assert RankLoad(3, GIB // 2, 2 * GIB).describe() == "rank 3 512.0 MiB of ~2.00 GiB (25%)"
    # The share is an estimate: past it, a rank that has not loaded shows 99 %.
    assert RankLoad(3, 3 * GIB, 2 * GIB).describe() == "rank 3 3.00 GiB of ~2.00 GiB (99%)"
    assert RankLoad(1, GIB).describe() == "rank 1 1.00 GiB"
    assert RankLoad(1, joined=False).describe() == "rank 1 not joined yet"
    load = RankLoad(2, 5, 9, True)
    assert RankLoad.from_json(load.to_json()) == load


def test_the_meter_is_the_loading_threads() -> None:
    told: list[RankLoad] = []
    meter, seen = LoadMeter(0, told.append), []
    with metering(meter):
        assert current_meter() is meter
        other = threading.Thread(target=lambda: seen.append(current_meter()))
        other.start()
        other.join()
    assert seen == [None] and current_meter() is None
    meter.follow(lambda: [RankLoad(1, 1, 2)])
    assert not meter.loaded
    meter.finish()
    assert told == [RankLoad(0, 0, 0, True)]
    meter.follow(lambda: [RankLoad(1, 2, 2, True)])
    assert meter.loaded and [r.rank for r in meter.ranks()] == [0, 1]
