"""Where a gang's cards may go: its shape (`gpu_per_node` cards on each of `gpu_count /
gpu_per_node` nodes), anti-affinity (no two cards on one node, or in one rack), rack affinity
(inside one rack: required, preferred, or no matter), and a floor on the nodes' network
bandwidth. Pure: it chooses among cards that already have room, best fit first."""

from __future__ import annotations

from dataclasses import dataclass

from modelforge.domain import Accelerator, Deployment

RACK_AFFINITIES = ("preferred", "required", "none")
ANTI_AFFINITIES = ("", "node", "rack")


@dataclass(frozen=True)
class GangShape:
    count: int
    gpu_per_node: int = 0  # 0: any split
    anti_affinity: str = ""
    rack_affinity: str = "preferred"
    min_network_bandwidth_gbps: float = 0.0

    @classmethod
    def of(cls, deployment: Deployment) -> GangShape:
        return cls(
            deployment.gpu_count,
            deployment.gpu_per_node,
            deployment.anti_affinity,
            deployment.rack_affinity,
            deployment.min_network_bandwidth_gbps,
        )

    def describe(self) -> str:
        parts = [f"{self.count} cards"]
        if self.gpu_per_node:
            parts.append(f"{self.gpu_per_node} per node on {self.count // self.gpu_per_node} nodes")
        if self.anti_affinity:
            parts.append(f"no two on one {self.anti_affinity}")
        if self.rack_affinity == "required":
            parts.append("inside one rack")
        if self.min_network_bandwidth_gbps:
            parts.append(f"nodes with >= {self.min_network_bandwidth_gbps:g} Gb/s")
        return ", ".join(parts)


def shape_problems(deployment: Deployment) -> list[str]:
    """What makes a deployment's gang shape impossible to satisfy anywhere, for the catalog."""
    problems = []
    if deployment.anti_affinity not in ANTI_AFFINITIES:
        problems.append(f"anti_affinity: {deployment.anti_affinity!r} is not one of node, rack (or empty)")
    if deployment.rack_affinity not in RACK_AFFINITIES:
        problems.append(f"rack_affinity: {deployment.rack_affinity!r} is not one of {', '.join(RACK_AFFINITIES)}")
    if deployment.gpu_per_node:
        if deployment.gpu_count % deployment.gpu_per_node:
            problems.append(f"gpu_per_node: {deployment.gpu_per_node} does not divide gpu_count {deployment.gpu_count}")
        if deployment.anti_affinity == "node" and deployment.gpu_per_node > 1:
            problems.append("anti_affinity: 'node' cannot hold with more than one card per node")
    if deployment.anti_affinity == "rack" and deployment.rack_affinity == "required" and deployment.gpu_count > 1:
        problems.append("anti_affinity: 'rack' and rack_affinity 'required' contradict each other")
    return problems


def _pick(room: list[tuple[int, str]], shape: GangShape, topology: dict[str, Accelerator]) -> list[str] | None:
    """`shape.count` cards from `room` ((leftover bytes, card), best fit first) honouring the
    shape's split and anti-affinity, with the least left over; None if it cannot be done."""
    if shape.gpu_per_node or shape.anti_affinity:
        by: dict[str, list[tuple[int, str]]] = {}
        for left, card in room:
            acc = topology[card]
            where = acc.rack if shape.anti_affinity == "rack" else acc.node
            if shape.anti_affinity == "rack" and not where:
                continue  # a card with no rack label cannot prove it is in another rack
            by.setdefault(where, []).append((left, card))
        take = shape.gpu_per_node or 1
        places = [(sum(left for left, _ in cards[:take]), where, cards[:take]) for where, cards in by.items()]
        places = sorted(p for p in places if len(p[2]) == take)
        wanted = shape.count // take
        if len(places) < wanted:
            return None
        return [card for _, _, cards in places[:wanted] for _, card in cards]
    if len(room) < shape.count:
        return None
    return [card for _, card in room[: shape.count]]


def choose_gang(room: list[tuple[int, str]], shape: GangShape, topology: dict[str, Accelerator]) -> list[str] | None:
    """The cards for a gang: inside one node if it may and can be, else inside one rack, else
    (unless the rack is required) across the pool; best fit at the first level that has one."""
    if shape.min_network_bandwidth_gbps:
        room = [
            (left, card)
            for left, card in room
            if topology[card].network_bandwidth_gbps >= shape.min_network_bandwidth_gbps
        ]
    levels: list[str] = []
    if not shape.anti_affinity and (not shape.gpu_per_node or shape.gpu_per_node == shape.count):
        levels.append("node")
    if shape.rack_affinity != "none" and shape.anti_affinity != "rack":
        levels.append("rack")
    if shape.rack_affinity != "required":
        levels.append("pool")
    for level in levels:
        scopes: dict[str, list[tuple[int, str]]] = {}
        for left, card in room:
            acc = topology[card]
            key = acc.node if level == "node" else acc.rack if level == "rack" else ""
            if level == "rack" and not key:
                continue  # unlabelled cards share no rack
            scopes.setdefault(key, []).append((left, card))
        best: tuple[int, str, list[str]] | None = None
        for key in sorted(scopes):
            chosen = _pick(scopes[key], shape, topology)
            if chosen is None:
                continue
            leftover = sum(left for left, card in scopes[key] if card in chosen)
            if best is None or (leftover, key) < best[:2]:
                best = (leftover, key, chosen)
        if best is not None:
            return best[2]
    return None
