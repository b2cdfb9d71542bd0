"""The job tests' node (tests/runtimes/jobs.py), a fixture for every module here."""

from tests.runtimes.jobs import node

__all__ = ["node"]
