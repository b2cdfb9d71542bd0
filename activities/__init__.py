"""Every side effect, one class per dependency, injected into the workers."""

from activities.gateway import SchedulerGatewayActivities
from activities.node import NodeActivities
from activities.store import StoreActivities

__all__ = ["NodeActivities", "SchedulerGatewayActivities", "StoreActivities"]
