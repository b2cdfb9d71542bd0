"""The leases by request id, kept across submissions, so admission (`validate_request`,
`existing_admission`) and `cancel_request` look one request up instead of walking every lease;
and by deployment, so a pass's verdicts (`stamp_predictions`) read one deployment's leases.

`PoolState.leases` stays the truth. The index is derived from it and kept beside it (in the
state's `__dict__`, never serialized): per request id, the ids of its leases in the order they
were added. The policy's own transitions tell it (`apply_decisions` adds a granted lease,
`release_lease` takes one away); a lease dict replaced, or changed behind its back (its
identity, its length or its last key differ from what the index last saw), is re-indexed from
scratch. Every lease it returns is checked against the dict, so a lease that left is never
handed out. The one change it cannot see is a lease replaced, behind its back, under an id
already held by a lease of another request: nothing does that (a lease id is its request id and
the lease counter)."""

from __future__ import annotations

from modelforge.policy._state import Lease, PoolState

_KEY = "_policy_lease_index"


def _last(leases: dict[str, Lease]) -> str | None:
    return next(reversed(leases), None)


class LeaseIndex:
    __slots__ = ("by_deployment", "by_request", "last", "leases", "length")

    def __init__(self, leases: dict[str, Lease]) -> None:
        self.leases = leases
        self.by_request: dict[str, list[str]] = {}
        # deployment id -> its leases' ids, in the dict's order (a dict as an ordered set)
        self.by_deployment: dict[str, dict[str, None]] = {}
        for lease_id, lease in leases.items():
            self.by_request.setdefault(lease.request_id, []).append(lease_id)
            self.by_deployment.setdefault(lease.deployment, {})[lease_id] = None
        self.length = len(leases)
        self.last = _last(leases)

    def current(self, leases: dict[str, Lease]) -> bool:
        return self.leases is leases and self.length == len(leases) and self.last == _last(leases)

    def added(self, lease: Lease) -> None:
        """`lease` was just added to the indexed dict, under its id."""
        self.by_request.setdefault(lease.request_id, []).append(lease.lease_id)
        self.by_deployment.setdefault(lease.deployment, {})[lease.lease_id] = None
        self.length += 1
        self.last = lease.lease_id

    def removed(self, lease: Lease) -> None:
        """`lease` was just taken out of the indexed dict."""
        ids = self.by_request.get(lease.request_id)
        if ids is not None and lease.lease_id in ids:
            ids.remove(lease.lease_id)
            if not ids:
                del self.by_request[lease.request_id]
        of_deployment = self.by_deployment.get(lease.deployment)
        if of_deployment is not None:
            of_deployment.pop(lease.lease_id, None)
            if not of_deployment:
                del self.by_deployment[lease.deployment]
        self.length -= 1
        self.last = _last(self.leases)

    def held_for(self, request_id: str) -> list[tuple[str, Lease]]:
        """(id, lease) of each lease held for `request_id`, in the dict's order."""
        ids = self.by_request.get(request_id)
        if not ids:
            return []
        leases = self.leases
        found = []
        for lease_id in ids:
            lease = leases.get(lease_id)
            if lease is not None and lease.request_id == request_id:
                found.append((lease_id, lease))
        return found

    def of_deployment(self, deployment_id: str) -> list[Lease]:
        """The leases of `deployment_id`, in the dict's order."""
        leases = self.leases
        found = []
        for lease_id in self.by_deployment.get(deployment_id, ()):
            lease = leases.get(lease_id)
            if lease is not None and lease.deployment == deployment_id:
                found.append(lease)
        return found


def lease_index(state: PoolState) -> LeaseIndex:
    """The index of `state.leases`, rebuilt when the leases changed behind its back."""
    index: LeaseIndex | None = state.__dict__.get(_KEY)
    if index is None or not index.current(state.leases):
        index = state.__dict__[_KEY] = LeaseIndex(state.leases)
    return index


def current_lease_index(state: PoolState) -> LeaseIndex | None:
    """The index when it matches the leases as they are now, else None (it will be rebuilt)."""
    index: LeaseIndex | None = state.__dict__.get(_KEY)
    if index is None or not index.current(state.leases):
        return None
    return index
