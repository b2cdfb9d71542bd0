"""Every side effect, one class per dependency, injected into the workers."""

from activities.admission import AdmissionActivities
from activities.node import NodeActivities
from activities.store import StoreActivities

__all__ = ["AdmissionActivities", "NodeActivities", "StoreActivities"]
