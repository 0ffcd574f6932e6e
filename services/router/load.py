"""This router's own load: the one record of the work it has handed out and not seen end.

- request slots taken (at most max_inflight) and waited for (at most max_waiting): admission
  and the tpla:num_requests_running / _waiting gauges read them;
- requests held on each decode group (at most max_per_group): placement skips a full group;
- requests sent to each decode group since the registry snapshot they were chosen from: the
  policy adds them to the group's reported load, so a burst between refreshes spreads out (a
  newer snapshot's reports include them, and the count starts again);
- prompt tokens in flight on each prefill worker: the policy weighs them against the
  worker's reported queue. A newer snapshot does not restart them: the report lags by up to
  a heartbeat, and a burst of long prompts then piled onto whichever worker reported idle;
- prompt tokens each decode group prefills itself for this router's requests: the
  disaggregation policy bounds that queue (services/router/disagg_policy.py).

Plain bookkeeping, no waiting and no I/O: `Admission` and `Placement` wait on it, the routing
policy reads it. The request lifecycle it serves: DESIGN §2.
"""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Mapping

from services.router.policy import WorkerSnapshot


class RouterLoad:
    def __init__(self, max_inflight: int, max_waiting: int, max_per_group: int) -> None:
        self.max_inflight = max_inflight
        self.max_waiting = max_waiting
        self.max_per_group = max_per_group
        self._running = 0
        self._waiting = 0
        self._held: Counter[str] = Counter()  # decode group id -> requests
        self._sent: Counter[str] = Counter()  # decode group id -> requests since `_sent_for`
        self._sent_for: WorkerSnapshot | None = None
        self._prefill: Counter[str] = Counter()  # prefill worker id -> prompt tokens
        self._local: Counter[str] = Counter()  # decode group id -> prompt tokens it prefills

    # -- requests in the router --------------------------------------------------------------

    @property
    def running(self) -> int:
        """Request slots taken (a slot handed to a waiter counts from the hand-over)."""
        return self._running

    @property
    def waiting(self) -> int:
        return self._waiting

    def take_slot(self) -> bool:
        """Take a free request slot; False when all `max_inflight` are taken."""
        if self._running >= self.max_inflight:
            return False
        self._running += 1
        return True

    def free_slot(self) -> None:
        assert self._running > 0, "a slot freed that was never taken"
        self._running -= 1

    def line_full(self) -> bool:
        """No room to wait for a slot either."""
        return self._waiting >= self.max_waiting

    def start_waiting(self) -> None:
        self._waiting += 1

    def stop_waiting(self) -> None:
        assert self._waiting > 0, "a wait ended that never started"
        self._waiting -= 1

    # -- decode groups -----------------------------------------------------------------------

    def full_groups(self) -> frozenset[str]:
        """The decode groups holding `max_per_group` of this router's requests."""
        return frozenset(g for g, n in self._held.items() if n >= self.max_per_group)

    def join_group(self, group_id: str) -> None:
        """A request holds a reservation on `group_id` from now on."""
        self._held[group_id] += 1

    def leave_group(self, group_id: str) -> None:
        self._held[group_id] -= 1
        if self._held[group_id] <= 0:
            del self._held[group_id]

    def sent_since(self, snapshot: WorkerSnapshot) -> Mapping[str, int]:
        """Requests sent to each decode group since `snapshot` was taken (a live view)."""
        self._start_from(snapshot)
        return types.MappingProxyType(self._sent)

    def send_to_group(self, snapshot: WorkerSnapshot, group_id: str) -> None:
        """A request is sent to `group_id`, chosen from `snapshot`."""
        self._start_from(snapshot)
        self._sent[group_id] += 1

    def _start_from(self, snapshot: WorkerSnapshot) -> None:
        # A newer snapshot carries the groups' own reports, which include what was sent
        # before it was taken; only what is sent from now on is ours to add.
        if snapshot is not self._sent_for:
            self._sent.clear()
            self._sent_for = snapshot

    # -- prefill workers ---------------------------------------------------------------------

    def prefill_tokens(self) -> Mapping[str, int]:
        """Prompt tokens in flight on each prefill worker (a live view)."""
        return types.MappingProxyType(self._prefill)

    def start_prefill(self, worker_id: str, tokens: int) -> None:
        self._prefill[worker_id] += tokens

    def end_prefill(self, worker_id: str, tokens: int) -> None:
        self._prefill[worker_id] -= tokens
        if self._prefill[worker_id] <= 0:
            del self._prefill[worker_id]

    # -- prompts a decode group prefills itself ----------------------------------------------

    def local_prefill_tokens(self, group_id: str) -> int:
        """Prompt tokens `group_id` prefills itself for this router's requests now."""
        return self._local[group_id]

    def start_local_prefill(self, group_id: str, tokens: int) -> None:
        self._local[group_id] += tokens

    def end_local_prefill(self, group_id: str, tokens: int) -> None:
        self._local[group_id] -= tokens
        if self._local[group_id] <= 0:
            del self._local[group_id]
