"""The Postgres store: migrations, catalog, event log."""

from modelforge.store._store import Store, redact

__all__ = ["Store", "redact"]
