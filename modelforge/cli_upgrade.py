"""`modelforge upgrade` (a build becomes current, the schedulers and telemetry move to it) and
`modelforge status --builds` (which build each worker and each long-lived workflow runs).
modelforge/cli.py imports this module, which adds its command to the app; Worker Versioning
itself is modelforge/versioning.py."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer
from rich.markup import escape

from modelforge.cli_common import JsonOption, _compact_table, _fail, _json, _run, _settings, _table_console, app, out
from modelforge.failures import FailureClass, ModelForgeError

# How long `upgrade` waits for each scheduler and telemetry workflow to run on the new build.
MOVE_WAIT_S = 60.0


async def _targets(settings: Any, pool: str | None) -> tuple[Any, list[str], list[str]]:
    """The Temporal client, the pools (their running schedulers) and the nodes of their cards."""
    from modelforge.client import ModelForgeClient
    from modelforge.policy import PoolStatus

    client = await ModelForgeClient.connect(settings, pool)
    statuses = await client.statuses()
    pools = sorted(statuses)
    nodes = sorted({a.node for s in statuses.values() if isinstance(s, PoolStatus) for a in s.accelerators})
    return client.temporal, pools, nodes


def _unavailable(error: Exception) -> ModelForgeError:
    return ModelForgeError(FailureClass.CAPABILITY_UNAVAILABLE, f"Temporal refused: {error}")


def show_builds(as_json: bool, pool: str | None) -> None:
    """`status --builds`: the deployment's current build and its versions, each task queue's
    workers with their builds, each scheduler's and telemetry workflow's build."""
    from temporalio.service import RPCError

    from modelforge.names import scheduler_id, telemetry_id
    from modelforge.versioning import build_view

    settings = _settings()

    async def go() -> Any:
        temporal, pools, nodes = await _targets(settings, pool)
        ids = [scheduler_id(p) for p in pools] + [telemetry_id(n) for n in nodes]
        try:
            return await build_view(temporal, settings.worker_deployment, ids, nodes)
        except RPCError as error:
            raise _unavailable(error) from None

    view = _run(go)
    if as_json:
        _json(view)
        return
    console = _table_console()
    out.print(
        escape(f"deployment {view.deployment}: current build {view.current or '(none: unversioned)'}"),
        highlight=False,
        soft_wrap=True,
    )
    table = _compact_table("Builds")
    for column in ("what", "runs", "build"):
        table.add_column(column)
    for build, drainage in sorted(view.versions.items()):
        table.add_row("version", "current" if build == view.current else (drainage or "-"), build)
    for queue, builds in sorted(view.workers.items()):
        table.add_row("workers", queue, ", ".join(builds))
    for workflow_id, build in sorted(view.workflows.items()):
        table.add_row("workflow", workflow_id, build or "(unversioned)")
    console.print(table)


@app.command()
def upgrade(
    build_id: Annotated[
        str | None,
        typer.Option(
            help="The build to make current (default: this install's, MODELFORGE_WORKER_BUILD_ID or the version)."
        ),
    ] = None,
    pool: Annotated[str | None, typer.Option(help="Only this pool's scheduler and its nodes' telemetry.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Make a build current and move the pool schedulers and telemetry workflows to it now.

    New requests, jobs and residency changes start on the build from then on; those running
    finish on the build that started them. Each scheduler and each node's telemetry workflow
    continues as new at once (its state carried) and runs on the build. A loaded model's residency
    run (it lasts as long as the model stays loaded; in every pool) moves to the build when the
    build is a later release than its own. Stop the old build's control workers once `modelforge status --builds` shows
    its version drained. The same command with the previous build's id is the rollback (its
    control workers must be running): the models loaded under the newer build stay on it, listed,
    until they unload (`modelforge residency unload ... --drain`)."""
    from temporalio.common import WorkerDeploymentVersion
    from temporalio.service import RPCError

    from modelforge.names import scheduler_id, telemetry_id
    from modelforge.versioning import build_id as own_build
    from modelforge.versioning import roll, set_current, upgrade_residents

    settings = _settings()
    version = WorkerDeploymentVersion(settings.worker_deployment, build_id or own_build(settings))

    async def go() -> dict[str, Any]:
        temporal, pools, nodes = await _targets(settings, pool)
        try:
            await set_current(temporal, version)
        except RPCError as error:
            raise ModelForgeError(
                FailureClass.CAPABILITY_UNAVAILABLE,
                f"build {version.build_id} of {version.deployment_name} cannot be made current (are its "
                f"control workers running, with MODELFORGE_WORKER_VERSIONING on?): {error.message}",
            ) from None
        try:
            signalled = await roll(temporal, pools, nodes, f"upgrade to build {version.build_id}")
            moved = await _wait_moved(temporal, signalled, version.build_id)
            # After the schedulers moved: until then a scheduler's run on the old build may still
            # start a load (its residency run pinned there). Again until a pass moves none (one
            # a load started just before may not be listed yet).
            residents_moved: list[str] = []
            while True:
                more, residents_staying = await upgrade_residents(temporal, version)
                residents_moved += more
                if not more:
                    break
        except RPCError as error:
            raise _unavailable(error) from None
        ids = {scheduler_id(p) for p in pools} | {telemetry_id(n) for n in nodes}
        return {
            "deployment": version.deployment_name,
            "current": version.build_id,
            "moved": moved,
            "not_running": sorted(ids - set(signalled)),
            "residents_moved": sorted(residents_moved),
            "residents_staying": sorted(residents_staying),
        }

    answer = _run(go)
    if as_json:
        _json(answer)
    else:
        out.print(
            escape(f"build {answer['current']} of {answer['deployment']} is current"), highlight=False, soft_wrap=True
        )
        for workflow_id, build in sorted(answer["moved"].items()):
            out.print(escape(f"  {workflow_id}: runs build {build or '(unversioned)'}"), highlight=False)
        for workflow_id in answer["residents_moved"]:
            out.print(escape(f"  {workflow_id}: pinned to build {answer['current']}"), highlight=False)
        if answer["residents_staying"]:
            out.print(
                escape(
                    f"  {len(answer['residents_staying'])} loaded models stay on the newer build they loaded under"
                    " until they unload (`modelforge residency unload DEPLOYMENT ACCELERATOR --drain`); keep its"
                    f" control workers until then: {', '.join(answer['residents_staying'])}"
                ),
                highlight=False,
                soft_wrap=True,
            )
    if any(build != version.build_id for build in answer["moved"].values()):
        _fail(
            ModelForgeError(
                FailureClass.TIMEOUT,
                f"not every workflow moved to build {version.build_id} within {MOVE_WAIT_S:.0f} s "
                "(a scheduler continues as new once its running updates finish)",
            ),
            code=1,
        )


async def _wait_moved(temporal: Any, workflow_ids: list[str], build: str) -> dict[str, str]:
    """Each workflow's build once it runs `build`, or as it is when MOVE_WAIT_S have passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + MOVE_WAIT_S
    builds: dict[str, str] = {}
    while True:
        for workflow_id in workflow_ids:
            described = await temporal.get_workflow_handle(workflow_id).describe()
            info = described.raw_description.workflow_execution_info.versioning_info
            builds[workflow_id] = info.deployment_version.build_id
        if all(b == build for b in builds.values()) or loop.time() > deadline:
            return builds
        await asyncio.sleep(0.5)
