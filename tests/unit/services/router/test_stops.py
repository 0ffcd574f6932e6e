"""Stop strings across token boundaries."""

from __future__ import annotations

import pytest

from services.router.stops import StopMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out, stopped = [], False
    for d in deltas:
        emit, stopped = m.push(d)
        out.append(emit)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped


def test_stop_split_across_tokens_is_never_emitted() -> None:
    m = StopMatcher(["END"])
    assert m.push("hello E") == ("hello ", False)  # "E" might start END: held back
    assert m.push("N") == ("", False)
    assert m.push("D and more") == ("", True)
    assert m.stopped and m.push("x") == ("", True) and m.flush() == ""


def test_stop_at_the_very_start() -> None:
    assert run(["Hel"], ["H", "el", "lo"]) == ("", True)
    assert run(["Hello"], ["Hello world"]) == ("", True)


def test_held_prefix_released_when_it_diverges() -> None:
    m = StopMatcher(["abc"])
    assert m.push("xab") == ("x", False)
    assert m.push("d") == ("abd", False)
    assert run(["abc"], ["xa", "b"]) == ("xab", False)  # flush releases the held tail


def test_earliest_of_several_stops_wins() -> None:
    assert run(["world", "lo w"], ["hel", "lo wor", "ld"]) == ("hel", True)
    assert run(["\n\n", "."], ["one\n", "\ntwo."]) == ("one", True)


def test_no_stops_passes_through() -> None:
    assert run([], ["a", "b"]) == ("ab", False)
    with pytest.raises(ValueError):
        StopMatcher([""])


@pytest.mark.parametrize("cut", range(1, 12))
def test_every_split_point_of_a_stop(cut: int) -> None:
    text = "say STOPWORD now"
    assert run(["STOPWORD"], [text[:cut], text[cut:]]) == ("say ", True)
