"""Queue order: class, then fair-share score (higher first), then submission time, then request id.

The order is recomputed on every decision pass, because scores move as usage decays, but never
by sorting the whole queue: requests are bucketed by (class, score) in one pass over the queue,
which is kept in (submission time, request id) order, so each bucket comes out already ordered.
"""

from __future__ import annotations

import itertools
from bisect import insort
from collections.abc import Iterator

from modelforge.domain import Catalog, fair_share_entity, queue_entity
from modelforge.policy._state import PoolState, QueuedRequest, TenantUsage


def class_rank(catalog: Catalog, class_id: str) -> int:
    """Sort key of a class (lower first). A class the catalog no longer has (a request queued
    before a reload that removed its queue) sorts after every known class."""
    klass = catalog.classes.get(class_id)
    return klass.rank if klass is not None else 1


def is_production(catalog: Catalog, class_id: str) -> bool:
    klass = catalog.classes.get(class_id)
    return klass is not None and klass.production


def runs_late(catalog: Catalog, class_id: str) -> bool:
    """Whether the class's level runs work late rather than refusing it for its deadline."""
    klass = catalog.classes.get(class_id)
    return klass is not None and klass.run_late


def starvation_bound(catalog: Catalog, class_id: str) -> float | None:
    """Seconds a waiting request of the class may be overtaken by work ordered after it while
    capacity for it exists (its level's `starvation_bound_s`); None: no bound."""
    klass = catalog.classes.get(class_id)
    return None if klass is None else klass.starvation_bound_s


def starving(catalog: Catalog, queued: QueuedRequest, now: float) -> bool:
    """Whether `queued` has waited past its class's starvation bound."""
    bound = starvation_bound(catalog, queued.priority)
    return bound is not None and now - queued.submitted_at >= bound


def production_ranks(catalog: Catalog) -> dict[int, bool]:
    """Ranks of production classes. The catalog keeps production and other levels on distinct
    priorities, so a rank alone says which admission rules apply."""
    return {klass.rank: True for klass in catalog.classes.values() if klass.production}


def may_preempt(catalog: Catalog, by: str, victim: str) -> bool:
    """Whether class `by` may stop preemptible work of class `victim` (its level's `preempts`)."""
    klass = catalog.classes.get(by)
    return klass is not None and victim in klass.preempts


def decayed_usage(usage: TenantUsage, half_life_s: float, now: float) -> float:
    if half_life_s <= 0:
        return usage.gpu_seconds
    decay: float = 0.5 ** (max(0.0, now - usage.updated_at) / half_life_s)
    return usage.gpu_seconds * decay


def fair_share_scores(state: PoolState, now: float) -> dict[str, float]:
    """The fair-share order: `score = priority * (1 + (target - consumed) / target)`, clamped at
    zero, where `target` is the entity's weighted share of all decayed usage and `consumed` its
    own.

    The entity is a tenant within a queue (`fair_share_entity`), weighted by the queue's weight
    times the tenant's: with the built-in single default queue that is the tenant alone.

    `priority` in the formula is the job's priority level. The queue is ordered by class
    first, so within a class that factor is the same for every request and the order is the
    deficit term alone: this returns it per tenant. Ordering by it converges each tenant's usage
    to its weight (the property tests check within 10% on a saturated two-tenant pool); using
    the weight as the factor instead would over-serve the heavier tenant (2:1 weights settle
    near 5:1)."""
    weights, total_weight = _fair_share_weights(state.catalog)
    half_life = state.config.fair_share_half_life_s
    usage = state.usage
    consumed: dict[str, float] = {}
    for entity in weights:
        used = usage.get(entity)
        consumed[entity] = 0.0 if used is None else decayed_usage(used, half_life, now)
    total = sum(consumed.values())
    scores: dict[str, float] = {}
    for entity, weight in weights.items():
        target = total * weight / total_weight
        if target <= 0:
            scores[entity] = 1.0 if total <= 0 else 0.0
            continue
        scores[entity] = max(0.0, 1 + (target - consumed[entity]) / target)
    return scores


def _fair_share_weights(catalog: Catalog) -> tuple[dict[str, float], float]:
    """Each fair-share entity's weight (its queue's weight times its tenant's) and their sum:
    the catalog's alone, so kept with it (immutable by contract)."""
    kept: tuple[dict[str, float], float] | None = catalog.__dict__.get("_policy_fair_share_weights")
    if kept is None:
        weights: dict[str, float] = {}
        queue_weights: dict[str, float] = {}
        for klass in catalog.classes.values():
            queue_weights.setdefault(klass.queue, klass.queue_weight)
        for queue, queue_weight in queue_weights.items():
            for tenant in catalog.tenants:
                if not tenant.queues or queue in tenant.queues:
                    weights[queue_entity(queue, tenant.name)] = queue_weight * tenant.weight
        kept = catalog.__dict__["_policy_fair_share_weights"] = (weights, sum(weights.values()) or 1.0)
    return kept


def submission_key(queued: QueuedRequest) -> tuple[float, str]:
    return (queued.submitted_at, queued.request_id)


def insert_in_submission_order(queue: list[QueuedRequest], queued: QueuedRequest) -> None:
    """Append, or insert in place when the request was submitted earlier than the tail (a
    preempted request goes back with its original submission time)."""
    if not queue or submission_key(queue[-1]) <= submission_key(queued):
        queue.append(queued)
    else:
        insort(queue, queued, key=submission_key)


def bucket_key(catalog: Catalog, scores: dict[str, float], priority: str, tenant: str) -> tuple[int, float]:
    """Where a (class, tenant)'s requests stand in the queue order, before submission time:
    class first, then fair-share score (higher first). `scores`: `fair_share_scores`."""
    return class_rank(catalog, priority), -scores.get(fair_share_entity(priority, tenant), 0.0)


def ordered_buckets(state: PoolState, now: float) -> list[list[QueuedRequest]]:
    """The queue in order, as consecutive buckets of equal (class, score): the decision pass
    walks them with plain loops, the hottest code of the scheduler.

    Relies on `state.queue` being in submission order, which every transition that adds to it
    keeps (`insert_in_submission_order`); the property tests check it after every step."""
    scores = fair_share_scores(state, now)
    catalog = state.catalog
    # One bucket per (class, tenant) key, built once per pass rather than once per request.
    keys: dict[tuple[str, str], tuple[int, float]] = {}
    buckets: dict[tuple[int, float], list[QueuedRequest]] = {}
    for queued in state.queue:
        key = keys.get((queued.priority, queued.tenant))
        if key is None:
            key = keys[(queued.priority, queued.tenant)] = bucket_key(catalog, scores, queued.priority, queued.tenant)
        bucket = buckets.get(key)
        if bucket is None:
            buckets[key] = [queued]
        else:
            bucket.append(queued)
    return [buckets[key] for key in sorted(buckets)]


def in_submission_order(queue: list[QueuedRequest]) -> bool:
    return all(submission_key(a) <= submission_key(b) for a, b in itertools.pairwise(queue))


def iter_queue_order(state: PoolState, now: float) -> Iterator[QueuedRequest]:
    for bucket in ordered_buckets(state, now):
        yield from bucket


def queue_order(state: PoolState, now: float) -> list[QueuedRequest]:
    """Class, then fair-share score (higher first), then submission time, then request id."""
    return list(iter_queue_order(state, now))
