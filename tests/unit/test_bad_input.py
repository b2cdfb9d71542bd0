"""Garbage in, a typed refusal out: hypothesis-generated catalogs, admission requests and HTTP
bodies (wrong types, negative or huge sizes, odd unicode, strings that look like shell or SQL)
always end in REQUEST_INVALID, CAPABILITY_UNAVAILABLE or a catalog error naming the field;
never a traceback, never a partial catalog."""

from __future__ import annotations

import asyncio
import copy
import json
import tomllib
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modelforge.catalog import CatalogError, example_catalog_path, parse_catalog
from modelforge.client import Result
from modelforge.domain import Catalog, Priority
from modelforge.failures import FailureClass
from modelforge.gateway import GatewayConfig, create_app
from modelforge.policy import AdmissionRejected, PoolStatus, validate_request
from tests.builders import ask, deployment, gpu, state, tenant
from tests.tiers import examples

NASTY_STRINGS = st.sampled_from(
    [
        "",
        " ",
        "'; DROP TABLE events; --",
        "$(rm -rf /)",
        "`reboot`",
        "../../etc/passwd",
        "rag.embedding@1\x00",
        "\u202eevil",
        "名前@1",
        "🙂" * 50,
        "a" * 5000,
        "NaN",
        "-1",
    ]
)
JUNK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | NASTY_STRINGS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=8,
)
EXAMPLE = tomllib.loads(example_catalog_path().read_text())
FIXED = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def broken_catalogs(draw: st.DrawFn) -> dict[str, Any]:
    """The example catalog with one to three values replaced by junk, anywhere in it."""
    data = copy.deepcopy(EXAMPLE)
    for _ in range(draw(st.integers(1, 3))):
        table = draw(st.sampled_from(sorted(data)))
        rows = data[table]
        if not rows:
            continue
        row = rows[draw(st.integers(0, len(rows) - 1))]
        key = draw(st.sampled_from([*sorted(row), "unexpected_field"]))
        row[key] = draw(JUNK)
    return data


@FIXED
@given(broken_catalogs())
def test_a_broken_catalog_is_refused_naming_the_field_or_parses_whole(data: dict[str, Any]) -> None:
    try:
        catalog, _ = parse_catalog(data)
    except CatalogError as error:
        assert error.failure == FailureClass.REQUEST_INVALID
        assert error.message.startswith("invalid catalog: ")
        # The message names where: a table and index, or a field path.
        assert any(table in error.message for table in ("accelerators", "deployments", "tenants", "external"))
        return
    assert isinstance(catalog, Catalog)
    assert len(catalog.deployments) == len(data["deployments"])  # all of it, never part


@FIXED
@given(
    capability=st.one_of(NASTY_STRINGS, st.text(max_size=300), st.just("emb@1")),
    tenant_name=st.one_of(NASTY_STRINGS, st.just("t")),
    priority=st.one_of(st.none(), st.sampled_from(list(Priority))),
    deadline=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    lease_timeout=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)),
    request_id=st.one_of(NASTY_STRINGS, st.just("r1")),
)
def test_admission_refuses_bad_requests_with_a_type(
    capability: str,
    tenant_name: str,
    priority: Priority | None,
    deadline: float | None,
    lease_timeout: float | None,
    request_id: str,
) -> None:
    pool = state([gpu("n/0")], [deployment("emb@1")], [tenant("t")])
    request = ask(
        request_id,
        capability,
        tenant_name,
        priority,
        deadline_s=deadline,
        lease_timeout_s=lease_timeout,
    )
    try:
        validate_request(pool, request)
    except AdmissionRejected as rejected:
        assert rejected.failure in (FailureClass.REQUEST_INVALID, FailureClass.CAPABILITY_UNAVAILABLE)
        assert rejected.message
        return
    # Admitted: then every field was sound.
    assert capability == "emb@1" and tenant_name == "t" and request_id
    for value in (deadline, lease_timeout):
        assert value is None or 0 < value <= 7 * 24 * 3600


class _RecordingRequester:
    """The gateway's seam to Temporal (the real one is ModelForgeClient): answers like a healthy
    pool and keeps what reached it, so the HTTP boundary is tested on its own."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def request(self, capability: str, input: dict[str, Any] | None = None, **_: Any) -> Result:
        payload = input or {}
        self.calls.append((capability, payload))
        texts = payload.get("texts", [])
        output = {"embeddings": [[0.0] * 4 for _ in texts], "text": "ok"}
        return Result(ok=True, request_id="r", capability=capability, output=output)

    async def status(self) -> PoolStatus:
        return PoolStatus(pool="default", now=0.0)


async def _catalog() -> Catalog:
    catalog, _ = parse_catalog(EXAMPLE)
    return catalog


_GARBAGE_GATEWAY: dict[str, Any] = {}


@FIXED
@given(
    path=st.sampled_from(["/v1/requests", "/v1/embeddings", "/v1/chat/completions"]),
    body=st.one_of(
        JUNK.map(lambda value: json.dumps(value).encode()),
        st.binary(max_size=200),
        st.fixed_dictionaries(
            {"model": st.one_of(NASTY_STRINGS, st.just("all-MiniLM-L6-v2")), "input": JUNK, "messages": JUNK}
        ).map(lambda value: json.dumps(value).encode()),
        st.fixed_dictionaries({"capability": st.one_of(NASTY_STRINGS, st.just("rag.embedding@1")), "input": JUNK}).map(
            lambda value: json.dumps(value).encode()
        ),
    ),
    tenant_header=st.one_of(st.none(), NASTY_STRINGS.filter(lambda s: s.isascii() and "\x00" not in s)),
)
def test_the_gateway_answers_garbage_with_a_typed_error(path: str, body: bytes, tenant_header: str | None) -> None:
    # One gateway for every example, as one serves every client (building it took 90 ms, nine
    # tenths of each example); what reached the requester is cleared for each.
    requester, app = _GARBAGE_GATEWAY.get("requester"), _GARBAGE_GATEWAY.get("app")
    if requester is None:
        requester = _GARBAGE_GATEWAY["requester"] = _RecordingRequester()
        app = _GARBAGE_GATEWAY["app"] = create_app(requester, _catalog, GatewayConfig())
    requester.calls.clear()
    headers = {"content-type": "application/json"}
    if tenant_header is not None:
        headers["x-modelforge-tenant"] = tenant_header

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            return await http.post(path, content=body, headers=headers)

    answer = asyncio.run(call())
    assert answer.status_code != 500, answer.text
    parsed = answer.json()
    if answer.status_code == 200:
        assert requester.calls, "a 200 without a request behind it"
        return
    assert parsed["failure_class"] in {f.value for f in FailureClass}
    assert parsed["error"]["modelforge_class"] == parsed["failure_class"] and parsed["error"]["message"]
    assert answer.status_code in (400, 401, 404, 413)
    assert not requester.calls, "refused input must not reach the scheduler"
