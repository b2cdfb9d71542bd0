"""`ModelForgeClient.request(max_duration_s=...)` and `submit_job`: a duration from 1 s to 7 days
reaches the request workflow's input (the lease's limit), anything else is REQUEST_INVALID before
anything is sent; a job's args, card count and nvlink go in its input. The command line's
JobClient is submit_job."""

from __future__ import annotations

from typing import Any, cast

import pytest
from temporalio.client import Client

from modelforge.cli_jobs import JobClient
from modelforge.client import ModelForgeClient, Result
from modelforge.identifiers import MAX_DURATION_S
from modelforge.messages import RequestInput
from modelforge.names import CONTROL_TASK_QUEUE
from modelforge.policy import AdmissionRejected, validate_request
from tests.builders import ask, deployment, gpu, state


class _Sent(Exception):
    def __init__(self, request: RequestInput) -> None:
        super().__init__("sent")
        self.request = request


class _Capturing(ModelForgeClient):
    """Stops at the workflow start and shows what would have been sent."""

    async def _start_and_wait(self, request: RequestInput, *args: Any, **kwargs: Any) -> Any:
        raise _Sent(request)

    async def _task_queue(self, *args: Any) -> str:
        return CONTROL_TASK_QUEUE  # no Temporal here to ask for the warm node


def _client() -> ModelForgeClient:
    return _Capturing(cast(Client, None), "default")  # bound to a pool: no pool routing call


@pytest.mark.parametrize("duration", [0, 0.5, -3, MAX_DURATION_S + 1, float("nan"), float("inf"), True, "1h"])
async def test_a_max_duration_outside_1s_to_7_days_is_request_invalid_before_anything_is_sent(duration: Any) -> None:
    result = await _client().request("merge.job@1", {}, tenant="lab", max_duration_s=duration)
    assert isinstance(result, Result) and not result.ok and result.failure_class == "REQUEST_INVALID"
    assert "max_duration_s must be from 1 to 604800 seconds (7 days)" in result.message
    job = await _client().submit_job("merge.job@1", [], max_duration_s=duration, tenant="lab")
    assert job.failure_class == "REQUEST_INVALID" and "max_duration_s" in job.message


@pytest.mark.parametrize("duration", [1, 4 * 3600, MAX_DURATION_S])
async def test_a_max_duration_reaches_the_request_workflows_input(duration: float) -> None:
    with pytest.raises(_Sent) as sent:
        await _client().request("merge.job@1", {"x": 1}, tenant="lab", max_duration_s=duration)
    assert sent.value.request.max_duration_s == duration and sent.value.request.input == {"x": 1}


async def test_without_a_max_duration_a_request_keeps_the_default() -> None:
    with pytest.raises(_Sent) as sent:
        await _client().request("rag.embedding@1", {}, tenant="rag")
    assert sent.value.request.max_duration_s == RequestInput("r", "c").max_duration_s == 600.0


async def test_submit_job_sends_its_args_gpu_count_duration_and_class() -> None:
    with pytest.raises(_Sent) as sent:
        await _client().submit_job(
            "merge.job@1",
            ["--layers", "8"],
            max_duration_s=4 * 3600,
            gpu_count=2,
            tenant="lab",
            queue="merge",
            priority="critical",
            request_id="job-1",
        )
    request = sent.value.request
    assert request.input == {"args": ["--layers", "8"], "gpu_count": 2}
    assert (request.max_duration_s, request.priority, request.request_id, request.tenant) == (
        4 * 3600,
        "merge.critical",
        "job-1",
        "lab",
    )
    with pytest.raises(_Sent) as bare:
        await _client().submit_job("merge.job@1", max_duration_s=60)
    assert bare.value.request.input == {}


@pytest.mark.parametrize(
    ("args", "gpu_count", "message"),
    [
        ("--layers 8", None, "args must be a list of strings"),
        ([1, 2], None, "args must be a list of strings"),
        (None, None, "args must be a list of strings"),
        ([], 0, "gpu_count must be from 1 to 1024"),
        ([], 1025, "gpu_count must be from 1 to 1024"),
        ([], True, "gpu_count must be from 1 to 1024"),
    ],
)
async def test_submit_job_refuses_bad_args_and_card_counts(args: Any, gpu_count: Any, message: str) -> None:
    result = await _client().submit_job("merge.job@1", args, max_duration_s=60, gpu_count=gpu_count)
    assert result.failure_class == "REQUEST_INVALID" and message in result.message


async def test_the_command_lines_job_client_is_submit_job() -> None:
    jobs = JobClient(cast(Client, None))
    assert type(jobs.client) is ModelForgeClient  # a plain client: no private override any more
    result = await jobs.submit_job("merge.job@1", [], max_duration_s=0.5)
    assert result.failure_class == "REQUEST_INVALID" and "max_duration_s" in result.message


async def test_submit_job_sends_nvlink_only_when_asked_and_refuses_anything_but_a_bool() -> None:
    with pytest.raises(_Sent) as sent:
        await _client().submit_job("merge.gang@1", ["--t", "0.5"], max_duration_s=60, gpu_count=2, nvlink=True)
    assert sent.value.request.input == {"args": ["--t", "0.5"], "gpu_count": 2, "nvlink": True}
    with pytest.raises(_Sent) as plain:
        await _client().submit_job("merge.gang@1", max_duration_s=60, nvlink=False)
    assert plain.value.request.input == {}  # nothing asked: the input as before
    for bad in ("true", 1, None):
        result = await _client().submit_job("merge.gang@1", max_duration_s=60, nvlink=cast(bool, bad))
        assert result.failure_class == "REQUEST_INVALID" and "nvlink must be true or false" in result.message


async def test_the_command_lines_job_client_passes_nvlink_to_submit_job() -> None:
    jobs = JobClient(cast(Client, None))
    jobs.client = _client()
    with pytest.raises(_Sent) as sent:
        await jobs.submit_job("merge.gang@1", [], max_duration_s=60, gpu_count=2, nvlink=True, tenant="lab")
    assert sent.value.request.input == {"gpu_count": 2, "nvlink": True} and sent.value.request.tenant == "lab"


@pytest.mark.parametrize(("duration", "admitted"), [(MAX_DURATION_S, True), (MAX_DURATION_S + 1, False)])
def test_the_scheduler_admits_the_same_longest_lease_as_the_client(duration: float, admitted: bool) -> None:
    """One maximum (identifiers.MAX_DURATION_S): a request that skipped the client's check (one
    started on Temporal directly) meets the same limit at admission, so the stored payloads'
    retention floor (payloads.LONGEST_REQUEST_S) covers every lease the scheduler grants."""
    pool = state([gpu("g0")], [deployment("merge.job@1")])
    if admitted:
        validate_request(pool, ask("r1", "merge.job@1", max_duration_s=duration))
    else:
        with pytest.raises(AdmissionRejected, match="max_duration_s must be between 0 and 604800 seconds"):
            validate_request(pool, ask("r1", "merge.job@1", max_duration_s=duration))
