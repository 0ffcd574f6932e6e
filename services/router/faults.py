"""Whose failure ended a request's stay on a decode group: the request's own, or the group's.

The one classification the router acts on. A request's own failure (its grammar cannot go on,
a parameter the group cannot apply, an internal error its input caused) is deterministic: it
would fail the same on any group, so the request ends with its error and the group is not
blamed. A group's failure (it is unreachable, stalled, its stream broke, its leader reports a
rank or collective failure) quarantines the group and may move the request to another one.
The decode leader says which kind its own errors are (`FailureScope` on the stream's event);
everything else is judged here from the typed error a call raised.
"""

from __future__ import annotations

import enum

from common.messages import FailureScope
from common.runtime.errors import RequestFailed, Unavailable


class GroupFault(enum.Enum):
    """How a decode group failed a request: the reason it is quarantined for, as
    `tpla:worker_healthy`'s `reason` label and `/admin/workers` show it."""

    RESERVE = "reserve_failed"  # Reserve did not answer, or failed
    TRANSFER = "transfer_failed"  # a prefill worker could not push the KV to it
    LOCAL_PREFILL = "local_prefill_failed"  # its own prefill of a prompt failed
    UNREACHABLE = "unreachable"  # its Generate stream failed (connection lost, refused)
    STALLED = "stalled"  # its stream sent nothing for token_timeout_s
    CUT = "stream_cut"  # its stream ended before every choice had finished
    GROUP_ERROR = "group_error"  # its leader ended the request for a group failure


class GroupFailed(Unavailable):
    """A decode group failed a request (the group's fault, never the request's)."""

    def __init__(self, fault: GroupFault, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.fault = fault
        self.detail = detail  # what the group said (its leader's error), if anything

    @property
    def cause(self) -> tuple[GroupFault, str]:
        """What two failures must share to be "the same reason": the fault and what the
        group said, not which group it was or its address."""
        return self.fault, self.detail


def group_failure(exc: Unavailable, fault: GroupFault) -> GroupFailed:
    """`exc` (a call to a group raised it) as that group's failure of kind `fault`."""
    if isinstance(exc, GroupFailed):
        return exc
    return GroupFailed(fault, exc.message)


def finished(reason: str, failure: FailureScope | None) -> str:
    """A choice's finish reason from its leader: "stop" or "length", or the error it ended
    with: RequestFailed (the request's own) or GroupFailed (the group's; also a peer that
    does not say whose, and an "abort" the router did not ask for: the group dropped it)."""
    if reason in ("stop", "length"):
        return reason
    if failure is FailureScope.REQUEST:
        raise RequestFailed(reason.removeprefix("error: "))
    raise GroupFailed(
        GroupFault.GROUP_ERROR, f"decode group ended the request: {reason}", detail=reason
    )
