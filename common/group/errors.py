"""Why a rank group could not form, or stopped."""

from __future__ import annotations


class GroupError(ValueError):
    """The group cannot form: a rank never joined, a rank's config differs from the leader's,
    a rank failed while starting. A ValueError: `tpla` prints it and exits 2."""


class RankStartError(GroupError):
    """A follower rank could not start, for the reason it reported (a port in use, another
    config): that reason, not the collective that broke, is the group's error."""


class RankExited(RuntimeError):
    """A follower the leader spawned has exited while the group runs."""


class LeaderSilent(RuntimeError):
    """A follower waited a whole collective timeout for the leader's next plan and got
    neither a plan nor a ping: the leader hangs (an idle leader pings about every second)."""
