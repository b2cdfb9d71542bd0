"""Converters from real traces (`data/traces/` and files of the same format) to simulator
scenarios. See docs/SIMULATOR.md for the models and assumptions each one uses."""

from modelforge.traces._alibaba import AlibabaOptions, convert_alibaba
from modelforge.traces._azure import AzureOptions, convert_azure
from modelforge.traces._common import TraceError, to_toml, write_scenario

__all__ = [
    "AlibabaOptions",
    "AzureOptions",
    "TraceError",
    "convert_alibaba",
    "convert_azure",
    "to_toml",
    "write_scenario",
]
