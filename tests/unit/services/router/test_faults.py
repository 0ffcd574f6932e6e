"""Whose failure it was (services/router/faults.py): the one classification placement,
migration and quarantine act on."""

from __future__ import annotations

import pytest

from common.messages import FailureScope, TokenEvent
from common.rpc.proto_mapping import event_from_pb, event_to_pb
from common.runtime.errors import (
    DeadlineExceeded,
    InvalidRequest,
    RequestFailed,
    TransferFailed,
    Unavailable,
)
from services.router.faults import GroupFailed, GroupFault, finished, group_failure


def test_a_finished_choice_and_the_request_s_own_failure() -> None:
    assert finished("stop", None) == "stop" and finished("length", None) == "length"
    with pytest.raises(RequestFailed) as caught:
        finished("error: structured output: no", FailureScope.REQUEST)
    error = caught.value
    # The request's own: a 400 that never reads as the group's (not Unavailable).
    assert not isinstance(error, Unavailable) and isinstance(error, InvalidRequest)
    assert error.http_status == 400 and error.code == "request_failed"
    assert error.message == "structured output: no"


@pytest.mark.parametrize(
    ("reason", "scope"),
    [
        ("error: rank 1 died", FailureScope.GROUP),
        ("error: broadcast timed out", None),  # a peer that does not say whose: the group's
        ("abort", None),  # an end the router did not ask for: the group dropped it
    ],
)
def test_the_group_s_failures(reason: str, scope: FailureScope | None) -> None:
    with pytest.raises(GroupFailed) as caught:
        finished(reason, scope)
    assert caught.value.fault is GroupFault.GROUP_ERROR and caught.value.detail == reason
    assert isinstance(caught.value, Unavailable)  # a 503 when it cannot move


def test_calls_that_failed_are_the_group_s_and_the_same_reason_is_told_apart() -> None:
    a = group_failure(Unavailable("connect to 127.0.0.1:5001 refused"), GroupFault.UNREACHABLE)
    b = group_failure(Unavailable("connect to 127.0.0.1:5002 refused"), GroupFault.UNREACHABLE)
    assert a.cause == b.cause  # the same reason on two groups, whatever their addresses
    assert group_failure(a, GroupFault.STALLED) is a  # classified once, where it was seen
    pushed = group_failure(TransferFailed("push to rank 1 failed"), GroupFault.TRANSFER)
    assert pushed.cause != a.cause and pushed.fault is GroupFault.TRANSFER
    with pytest.raises(GroupFailed) as one:
        finished("error: rank 1 died", FailureScope.GROUP)
    with pytest.raises(GroupFailed) as two:
        finished("error: rank 0 died", FailureScope.GROUP)
    assert one.value.cause != two.value.cause
    # The request's own deadline is neither: it ends the request.
    assert not isinstance(DeadlineExceeded("late"), Unavailable)


def test_the_scope_crosses_the_wire() -> None:
    for scope in (None, FailureScope.REQUEST, FailureScope.GROUP):
        event = TokenEvent.failed(scope, "x", index=2) if scope else TokenEvent(None, "stop")
        back = event_from_pb(event_to_pb(event))
        assert (back.failure, back.finish_reason, back.index) == (
            scope,
            event.finish_reason,
            event.index,
        )
