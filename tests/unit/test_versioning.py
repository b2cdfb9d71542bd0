"""Which build a run is pinned to, and which builds are newer: what `modelforge upgrade` and
`modelforge dev` decide from when they move runs between builds (modelforge/versioning.py)."""

from __future__ import annotations

import pytest
from temporalio.api.deployment.v1 import WorkerDeploymentVersion
from temporalio.api.workflow.v1 import VersioningOverride, WorkflowExecutionInfo, WorkflowExecutionVersioningInfo
from temporalio.common import VersioningBehavior

from modelforge.versioning import newer, pinned_build

OLD = WorkerDeploymentVersion(deployment_name="modelforge", build_id="0.1.0")
NEW = WorkerDeploymentVersion(deployment_name="modelforge", build_id="0.2.0")


def _run(
    behavior: VersioningBehavior, ran_on: WorkerDeploymentVersion | None, override: VersioningOverride | None
) -> WorkflowExecutionInfo:
    versioning = WorkflowExecutionVersioningInfo()
    versioning.behavior = int(behavior)  # type: ignore[assignment]
    if ran_on is not None:
        versioning.deployment_version.CopyFrom(ran_on)
    if override is not None:
        versioning.versioning_override.CopyFrom(override)
    return WorkflowExecutionInfo(versioning_info=versioning)


PINNED_TO_NEW = VersioningOverride(
    pinned=VersioningOverride.PinnedOverride(behavior=VersioningOverride.PINNED_OVERRIDE_BEHAVIOR_PINNED, version=NEW)
)


@pytest.mark.parametrize(
    ("behavior", "ran_on", "override", "pinned_to"),
    [
        (VersioningBehavior.PINNED, OLD, None, "0.1.0"),  # a pinned run stays where it ran
        (VersioningBehavior.PINNED, OLD, PINNED_TO_NEW, "0.2.0"),  # moved, before its next task
        (VersioningBehavior.PINNED, OLD, VersioningOverride(auto_upgrade=True), None),  # follows the current
        (VersioningBehavior.AUTO_UPGRADE, OLD, None, None),
        (VersioningBehavior.UNSPECIFIED, None, None, None),  # an unversioned worker's run
    ],
)
def test_the_build_a_run_is_pinned_to(
    behavior: VersioningBehavior,
    ran_on: WorkerDeploymentVersion | None,
    override: VersioningOverride | None,
    pinned_to: str | None,
) -> None:
    found = pinned_build(_run(behavior, ran_on, override))
    assert (found.build_id if found is not None else None) == pinned_to


def test_only_release_numbers_are_ordered() -> None:
    assert newer("0.2.0", "0.1.0") and newer("0.10.0", "0.9.1") and not newer("0.1.0", "0.2.0")
    assert not newer("0.2.0", "0.2.0")
    # A build id that is not a release number is never newer, nor older: `modelforge upgrade`
    # leaves the residency runs of such a build where they are.
    assert not newer("feature-x", "0.1.0") and not newer("0.1.0", "feature-x")
