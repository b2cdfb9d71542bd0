"""The gateway's edge against hostile or careless clients, over real sockets (uvicorn as
`gateway_server` builds it), with a recording stand-in for Temporal: the key is checked before
anything else, a body is read only up to its limit and within its deadline, headers have a
deadline of their own, and identifiers are checked before anything reaches the scheduler."""

from __future__ import annotations

import asyncio
import json
import logging
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from modelforge.catalog import example_catalog_path, parse_catalog
from modelforge.client import Result
from modelforge.domain import Catalog
from modelforge.failures import ModelForgeError
from modelforge.gateway import GatewayConfig, create_app, gateway_server
from modelforge.logging import configure
from modelforge.policy import Lease, PoolStatus

KEY = "sk-team-0123456789abcdef"
OBSERVER_KEY = "sk-prom-0123456789abcdef"
LIMIT = 2 * 1024 * 1024  # MODELFORGE_MAX_PAYLOAD_BYTES in the test that sets it


class _Recording:
    """Answers like a healthy pool and keeps what reached it. Like ModelForgeClient, a request
    id names one run: asking with the id of one in flight (or finished) gets that run's result,
    whoever asked first. `hold` keeps each call in flight until it is set."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.runs: dict[tuple[str, str], Result] = {}

    async def request(self, capability: str, input: dict[str, Any] | None = None, **options: Any) -> Result:
        self.calls.append({"capability": capability, "input": input, **options})
        key = (capability, options["request_id"])
        if key not in self.runs:
            texts = (input or {}).get("texts", [])
            output = {"embeddings": [[0.5] * 4 for _ in texts], "text": "ok", "secret": f"{options['tenant']}'s"}
            lease = Lease(
                lease_id="l", request_id=key[1], workflow_id=f"request:{key[0]}:{key[1]}", capability=capability,
                deployment=capability, accelerator="gpu-node/0", node="gpu-node", resident_key="r", bytes=0,
                granted_at=0.0, priority="interactive", tenant=options["tenant"],
            )  # fmt: skip
            self.runs[key] = Result(ok=True, request_id=key[1], capability=capability, output=output, lease=lease)
        await self.hold.wait()
        return self.runs[key]

    async def status(self) -> PoolStatus:
        return PoolStatus(pool="default", now=0.0)


async def _catalog() -> Catalog:
    catalog, _ = parse_catalog(tomllib.loads(example_catalog_path().read_text()))
    return catalog


class _Gateway:
    def __init__(self, port: int, requester: _Recording) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.requester = requester


@asynccontextmanager
async def _gateway(config: GatewayConfig, header_timeout_s: float = 10.0) -> AsyncIterator[_Gateway]:
    requester = _Recording()
    server = gateway_server(create_app(requester, _catalog, config), "127.0.0.1", 0, header_timeout_s=header_timeout_s)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    try:
        yield _Gateway(server.servers[0].sockets[0].getsockname()[1], requester)
    finally:
        server.should_exit = True
        await task


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers["content-length"]))
    return status, json.loads(body)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except ConnectionError:
        pass


def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_with_keys_every_route_needs_one_whatever_the_path_or_model() -> None:
    keys = GatewayConfig(api_keys={KEY: "rag"})
    async with _gateway(keys) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        calls = [
            ("GET", "/v1/status", None),
            ("GET", "/v1/models", None),
            ("GET", "/openapi.json", None),
            ("GET", "/docs", None),
            ("GET", "/v1/no-such-route", None),
            ("DELETE", "/v1/models", None),
            ("POST", "/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": "x"}),
            ("POST", "/v1/embeddings", {"model": "no-such-model", "input": "x"}),
            ("POST", "/v1/chat/completions", {"model": "small-chat", "messages": [{"role": "user", "content": "x"}]}),
            ("POST", "/v1/requests", {"capability": "rag.embedding@1"}),
            ("POST", "/v1/requests", {"capability": "no.such@1"}),
        ]
        for authorization in (None, "Bearer sk-wrong-wrong-wrong-wrong", f"Basic {KEY}", "Bearer"):
            headers = {"Authorization": authorization} if authorization else {}
            answers = set()
            for method, path, body in calls:
                answer = await http.request(method, path, json=body, headers=headers)
                assert answer.status_code == 401, (method, path, authorization, answer.text)
                assert answer.headers["www-authenticate"] == "Bearer"
                answers.add(json.dumps(answer.json(), sort_keys=True))
            # One answer for all: nothing tells a route or a model name apart without a key.
            assert len(answers) == 1 and json.loads(answers.pop())["failure_class"] == "REQUEST_INVALID"
        assert gw.requester.calls == []

        team = {"Authorization": f"Bearer {KEY}"}
        assert (await http.get("/healthz")).status_code == 200  # the compose healthcheck's, keyless
        assert (await http.get("/v1/status", headers=team)).status_code == 200
        assert "rag.embedding@1" in {m["id"] for m in (await http.get("/v1/models", headers=team)).json()["data"]}
        spec = (await http.get("/openapi.json", headers=team)).json()
        assert "/v1/embeddings" in spec["paths"] and spec["components"]["securitySchemes"]
        assert "swagger" in (await http.get("/docs", headers=team)).text.lower()
        missing = await http.get("/v1/no-such-route", headers=team)
        assert (missing.status_code, missing.json()["failure_class"]) == (404, "REQUEST_INVALID")


async def test_the_key_is_checked_before_the_body_is_read() -> None:
    async with _gateway(GatewayConfig(api_keys={KEY: "rag"})) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        # A body is announced and never sent: a wrong key is refused without waiting for it.
        writer.write(_head("/v1/embeddings", {"Authorization": "Bearer sk-nope", "Content-Length": "1000"}))
        await writer.drain()
        status, body = await asyncio.wait_for(_read_response(reader), 5)
        assert (status, body["failure_class"]) == (401, "REQUEST_INVALID")
        await _close(writer)


async def test_a_body_past_the_limit_is_refused_without_being_read_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # The limit is the configured maximum payload size (no hard-coded figure).
    monkeypatch.setenv("MODELFORGE_MAX_PAYLOAD_BYTES", str(LIMIT))
    async with _gateway(GatewayConfig(api_keys={KEY: "rag"})) as gw:
        auth = {"Authorization": f"Bearer {KEY}"}
        # Declared too big: refused at once, nothing sent.
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(_head("/v1/requests", {**auth, "Content-Length": str(300 * 1024 * 1024)}))
        await writer.drain()
        status, body = await asyncio.wait_for(_read_response(reader), 5)
        assert (status, body["failure_class"]) == (413, "REQUEST_INVALID")
        await _close(writer)

        # Chunked, with no length: refused once past the limit, while the client is still
        # sending (the body never ends), so nothing waits for, or holds, the whole of it.
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(_head("/v1/requests", {**auth, "Transfer-Encoding": "chunked"}))
        chunk = b"x" * 65536
        for _ in range(LIMIT // len(chunk) + 4):
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
        status, body = await asyncio.wait_for(_read_response(reader), 5)
        assert (status, body["failure_class"]) == (413, "REQUEST_INVALID")
        assert str(LIMIT) in body["error"]["message"]
        await _close(writer)
        assert gw.requester.calls == []


async def test_a_client_too_slow_with_its_body_gets_408() -> None:
    async with _gateway(GatewayConfig(body_timeout_s=1.0)) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(_head("/v1/requests", {"Content-Length": "100"}) + b'{"capability": ')
        await writer.drain()
        status, body = await asyncio.wait_for(_read_response(reader), 5)
        assert (status, body["failure_class"]) == (408, "REQUEST_INVALID")
        await _close(writer)
        assert gw.requester.calls == []


async def test_a_client_too_slow_with_its_headers_is_cut_off() -> None:
    async with _gateway(GatewayConfig(), header_timeout_s=1.0) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v1/requests HTTP/1.1\r\nHost: gateway\r\n")
        loop = asyncio.get_running_loop()
        started = loop.time()
        # A header byte every 0.2 s (slowloris): each byte arrives, the headers never end.
        closed = False
        for _ in range(50):
            try:
                writer.write(b"X")
                await writer.drain()
                closed = await asyncio.wait_for(reader.read(1), 0.2) == b""
            except TimeoutError:
                continue
            except ConnectionError:
                closed = True
            if closed:
                break
        assert closed
        assert loop.time() - started < 3.0
        await _close(writer)

        # An ordinary client is unaffected, kept alive across requests.
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            for _ in range(2):
                assert (await http.get("/healthz")).status_code == 200


async def test_identifiers_are_checked_before_anything_reaches_the_scheduler() -> None:
    async with _gateway(GatewayConfig()) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        refused: list[tuple[str, dict[str, Any], dict[str, str]]] = [
            ("/v1/requests", {"capability": "rag.embedding@1\n"}, {}),
            ("/v1/requests", {"capability": "rag.embedding@1", "request_id": "a\x00b"}, {}),
            ("/v1/requests", {"capability": "rag.embedding@1", "request_id": "x" * 129}, {}),
            ("/v1/requests", {"capability": "rag.embedding@1", "request_id": "../../etc"}, {}),
            ("/v1/requests", {"capability": "rag.embedding@1", "tenant": "rag\u202e"}, {}),
            ("/v1/requests", {"capability": "rag.embedding@1"}, {"X-ModelForge-Tenant": "t" * 65}),
            ("/v1/requests", {"capability": "rag.embedding@1"}, {"X-Request-Id": "id with space"}),
            ("/v1/embeddings", {"model": "all-MiniLM\x1b[2J", "input": "x"}, {}),
            ("/v1/embeddings", {"model": "é" * 300, "input": "x"}, {}),
            ("/v1/chat/completions", {"model": "\ud800", "messages": [{"role": "user", "content": "x"}]}, {}),
            ("/v1/embeddings", {"model": "all-MiniLM-L6-v2", "input": "x"}, {"X-ModelForge-Tenant": "rag:prod"}),
        ]
        for path, body, headers in refused:
            answer = await http.post(path, content=json.dumps(body), headers=headers)
            assert (answer.status_code, answer.json()["failure_class"]) == (400, "REQUEST_INVALID"), (body, headers)
            assert answer.json()["error"]["message"].isascii()
        assert gw.requester.calls == []

        accepted = await http.post(
            "/v1/requests",
            json={"capability": "rag.embedding@1", "request_id": "team:2026-12-01.run_7"},
            headers={"X-ModelForge-Tenant": "rag"},
        )
        assert accepted.status_code == 200, accepted.text
        assert gw.requester.calls[-1]["request_id"] == "team:2026-12-01.run_7"


async def test_deeply_nested_json_is_request_invalid() -> None:
    async with _gateway(GatewayConfig()) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        for depth in (80, 300, 100_000):
            nested = '{"a":' * depth + "1" + "}" * depth
            for path, body in [
                ("/v1/requests", '{"capability": "rag.embedding@1", "input": ' + nested + "}"),
                (
                    "/v1/chat/completions",
                    '{"model": "small-chat", "messages": [{"role": "user", "content": [' + nested + "]}]}",
                ),
                ("/v1/embeddings", "[" * depth + "]" * depth),
            ]:
                answer = await http.post(path, content=body)
                assert (answer.status_code, answer.json()["failure_class"]) == (400, "REQUEST_INVALID"), (path, depth)
        assert gw.requester.calls == []
        shallow = {"capability": "rag.embedding@1", "input": json.loads('{"a":' * 20 + "1" + "}" * 20)}
        assert (await http.post("/v1/requests", json=shallow)).status_code == 200


async def test_the_priority_header_is_honoured_on_every_route() -> None:
    async with _gateway(GatewayConfig()) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        background = {"X-ModelForge-Priority": "background"}
        ok = await http.post("/v1/requests", json={"capability": "rag.embedding@1"}, headers=background)
        assert ok.status_code == 200 and gw.requester.calls[-1]["priority"] == "background"
        ok = await http.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x"}, headers=background)
        assert ok.status_code == 200 and gw.requester.calls[-1]["priority"] == "background"
        same = await http.post(
            "/v1/requests", json={"capability": "rag.embedding@1", "priority": "background"}, headers=background
        )
        assert same.status_code == 200 and gw.requester.calls[-1]["priority"] == "background"
        calls = len(gw.requester.calls)
        for body, headers in [
            ({"capability": "rag.embedding@1", "priority": "interactive"}, background),  # which one?
            ({"capability": "rag.embedding@1"}, {"X-ModelForge-Priority": "Background"}),
            ({"capability": "rag.embedding@1", "priority": "batch\n"}, {}),
        ]:
            answer = await http.post("/v1/requests", json=body, headers=headers)
            assert (answer.status_code, answer.json()["failure_class"]) == (400, "REQUEST_INVALID"), body
            assert "priority" in answer.json()["error"]["message"].lower()
        assert len(gw.requester.calls) == calls


async def test_a_request_id_answers_only_the_tenant_that_started_it() -> None:
    async with _gateway(GatewayConfig()) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        call = {"capability": "rag.embedding@1", "request_id": "shared-1"}
        gw.requester.hold.clear()
        first = asyncio.create_task(http.post("/v1/requests", json=call, headers={"X-ModelForge-Tenant": "rag"}))
        while not gw.requester.calls:
            await asyncio.sleep(0.01)
        # In flight: another tenant's request with the id is refused at once, naming no one.
        other = await http.post("/v1/requests", json=call, headers={"X-ModelForge-Tenant": "ocr"})
        assert (other.status_code, other.json()["failure_class"]) == (409, "REQUEST_INVALID")
        assert "rag" not in other.text and "shared-1" in other.json()["error"]["message"]
        # The same tenant asking again attaches to its own request.
        again = asyncio.create_task(http.post("/v1/requests", json=call, headers={"X-ModelForge-Tenant": "rag"}))
        await asyncio.sleep(0.1)
        gw.requester.hold.set()
        for answer in (await first, await again):
            assert answer.status_code == 200 and answer.json()["output"]["secret"] == "rag's"
        # Finished: the run's result is still not another tenant's to read.
        late = await http.post("/v1/requests", json=call, headers={"X-ModelForge-Tenant": "ocr"})
        assert (late.status_code, late.json()["failure_class"]) == (409, "REQUEST_INVALID")
        assert "rag" not in late.text


def _samples(text: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """The samples of one metric in Prometheus' text format, by their labels."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[frozenset(sample.labels.items())] = sample.value
    return found


async def test_every_request_is_logged_and_counted_without_keys_or_bodies(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = structlog.get_config()
    configure(logging.INFO)
    try:
        # `prom`: an observer (Prometheus's key) reads every tenant's series; `rag`'s key its own.
        config = GatewayConfig(api_keys={KEY: "rag", OBSERVER_KEY: "prom"}, observer_tenants=frozenset({"prom"}))
        async with _gateway(config) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            team = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "logged-1"}
            secret_text = "the text of a private document"
            ok = await http.post(
                "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": secret_text}, headers=team
            )
            assert ok.status_code == 200, ok.text
            refused = await http.post("/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x"})
            assert refused.status_code == 401
            unknown = await http.post("/v1/embeddings", json={"model": "gpt-\x1b[2J", "input": "x"}, headers=team)
            assert unknown.status_code == 400
            missing = await http.post("/v1/embeddings", json={"model": "gpt-17", "input": "x"}, headers=team)
            assert missing.status_code == 404
            assert (await http.get("/metrics")).status_code == 401  # behind the key like every route
            own = await http.get("/metrics", headers=team)
            scraped = await http.get("/metrics", headers={"Authorization": f"Bearer {OBSERVER_KEY}"})
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    finally:
        structlog.configure(**saved)

    requests = _samples(scraped.text, "modelforge_gateway_requests_total")
    labels = {"route": "/v1/embeddings", "capability": "rag.embedding@1", "tenant": "rag", "priority": "interactive"}
    assert requests[frozenset({**labels, "status": "200", "failure_class": ""}.items())] == 1
    # A refusal before any key is counted with no tenant; an unknown model with no capability.
    anonymous = {"route": "/v1/embeddings", "capability": "", "tenant": "", "priority": ""}
    assert requests[frozenset({**anonymous, "status": "401", "failure_class": "REQUEST_INVALID"}.items())] == 1
    unresolved = {**anonymous, "tenant": "rag", "status": "404", "failure_class": "CAPABILITY_UNAVAILABLE"}
    assert requests[frozenset(unresolved.items())] == 1
    # A tenant's key reads its own series only: not the anonymous refusal's.
    mine = _samples(own.text, "modelforge_gateway_requests_total")
    assert mine and all(dict(key)["tenant"] == "rag" for key in mine), mine
    assert mine[frozenset({**labels, "status": "200", "failure_class": ""}.items())] == 1
    seconds = _samples(scraped.text, "modelforge_gateway_request_seconds_count")
    assert seconds[frozenset({**labels, "status": "200"}.items())] == 1
    tokens = _samples(scraped.text, "modelforge_gateway_tokens_total")
    estimated = {"capability": "rag.embedding@1", "tenant": "rag", "priority": "interactive", "estimated": "true"}
    assert tokens[frozenset({**estimated, "kind": "prompt"}.items())] == 8  # 30 characters, ~4 a token

    access = [line for line in lines if line.get("event") == "gateway_request"]
    assert [(a["route"], a["status"]) for a in access] == [
        ("/v1/embeddings", 200),
        ("/v1/embeddings", 401),
        ("/v1/embeddings", 400),
        ("/v1/embeddings", 404),
    ]  # /metrics is logged at debug only
    first = access[0]
    assert (first["tenant"], first["capability"], first["request_id"], first["priority"]) == (
        "rag",
        "rag.embedding@1",
        "logged-1",
        "interactive",
    )
    assert first["model"] == "all-MiniLM-L6-v2" and first["prompt_tokens"] == 8 and first["tokens_estimated"]
    assert first["level"] == "info" and first["duration_ms"] >= 0 and first["method"] == "POST"
    assert access[2]["failure_class"] == "REQUEST_INVALID" and access[2]["model"] == "gpt-\\x1b[2J"
    everything = json.dumps(lines)
    assert KEY not in everything and secret_text not in everything and "Bearer" not in everything


async def test_the_log_level_setting(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    saved = structlog.get_config()
    try:
        monkeypatch.setenv("MODELFORGE_LOG_LEVEL", "warning")
        async with _gateway(GatewayConfig()) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            assert (await http.get("/v1/models")).status_code == 200
            assert (await http.post("/v1/embeddings", json={"model": "nope-1", "input": "x"})).status_code == 404
        quiet = capsys.readouterr().err
        assert "gateway_request" not in quiet  # info lines (4xx included) are below warning
        monkeypatch.setenv("MODELFORGE_LOG_LEVEL", "debug")
        async with _gateway(GatewayConfig()) as gw, httpx.AsyncClient(base_url=gw.url) as http:
            assert (await http.get("/healthz")).status_code == 200
        [health] = [json.loads(x) for x in capsys.readouterr().err.splitlines() if "gateway_request" in x]
        assert (health["route"], health["level"]) == ("/healthz", "debug")
        monkeypatch.setenv("MODELFORGE_LOG_LEVEL", "loud")
        with pytest.raises(ModelForgeError, match="MODELFORGE_LOG_LEVEL"):
            gateway_server(create_app(_Recording(), _catalog, GatewayConfig()), "127.0.0.1", 0)
    finally:
        structlog.configure(**saved)


class _Failing(_Recording):
    """A pool that refuses every request with one failure class."""

    def __init__(self, failure: str) -> None:
        super().__init__()
        self.failure = failure

    async def request(self, capability: str, input: dict[str, Any] | None = None, **options: Any) -> Result:
        self.calls.append({"capability": capability, "input": input, **options})
        return Result(
            ok=False, request_id=options["request_id"], capability=capability, failure_class=self.failure, message="no"
        )


@pytest.mark.parametrize(
    ("failure", "error", "status", "kind", "retry_after"),
    [
        ("QUEUE_FULL", openai.RateLimitError, 429, "rate_limit_error", "5"),
        ("INSUFFICIENT_SCHEDULABLE_VRAM", openai.InternalServerError, 503, "server_error", "10"),
        ("CAPABILITY_UNAVAILABLE", openai.InternalServerError, 503, "server_error", None),
        ("RUNTIME_CRASH", openai.InternalServerError, 502, "server_error", None),
        ("DEADLINE_CANNOT_BE_MET", openai.InternalServerError, 504, "server_error", None),
        ("REQUEST_INVALID", openai.BadRequestError, 400, "invalid_request_error", None),
    ],
)
async def test_failures_are_the_openai_sdks_exceptions_with_the_class_beside(
    failure: str, error: type[openai.APIStatusError], status: int, kind: str, retry_after: str | None
) -> None:
    requester = _Failing(failure)
    server = gateway_server(create_app(requester, _catalog, GatewayConfig()), "127.0.0.1", 0)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            with pytest.raises(error) as raised:
                await client.embeddings.create(model="all-MiniLM-L6-v2", input="x")
        answer = raised.value
        assert answer.status_code == status and answer.type == kind
        assert answer.body["modelforge_class"] == failure  # type: ignore[index]
        assert answer.response.headers.get("retry-after") == retry_after
        assert len(requester.calls) == 1
    finally:
        server.should_exit = True
        await task


async def test_parameters_on_v1_requests_are_refused_where_the_runtime_takes_none() -> None:
    async with _gateway(GatewayConfig()) as gw, httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
        given = {"capability": "rag.embedding@1", "input": {"texts": ["x"], "parameters": {"temperature": 0.1}}}
        refused = await http.post("/v1/requests", json=given)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("unsupported_parameter", "input.parameters.temperature")
        assert "simulated" in error["message"] and gw.requester.calls == []
        harmless = {"capability": "rag.embedding@1", "input": {"texts": ["x"], "parameters": {"n": 1}}}
        assert (await http.post("/v1/requests", json=harmless)).status_code == 200
