"""The operator's picture: `GET /ui`, a status page the gateway serves, and `GET /ui/status.json`,
what it shows (the page polls it every `POLL_S`; no build toolchain: one HTML page, its script
inline).

Each card is a bar of where its memory goes: held by processes ModelForge did not start (one
segment per process, named), resident models, leases beyond them, the reserve, and what is free
to schedule; then the residents with their state, leases and time to live, and the queue with
each waiting request's verdict (`_verdict_source.py`: position, reason, ETA).

Who may look: with API keys configured, an operator's or observer's key (MODELFORGE_GATEWAY_
OPERATORS / _OBSERVERS; the page shows every tenant's traffic); without keys, anyone who reaches
the gateway (loopback by default). A browser has no way to send a bearer token when it opens a
page, so these two routes also take the key as HTTP Basic's password (any user name): the
browser asks for it once and sends it with the page's own requests."""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse

from modelforge.failures import FailureClass
from modelforge.gateway import _context
from modelforge.gateway._verdict_source import VerdictSource
from modelforge.policy import pool_status

POLL_S = 2.0


def key_of(request: Request) -> str | None:
    """The key a caller presented: a bearer token, `x-api-key`, or HTTP Basic's password."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return value.strip() or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return request.headers.get("x-api-key")


def status_page_router(
    keyed: bool,
    tenant_of_key: Callable[[str | None], str | None],
    sees_everything: Callable[[str], bool],
    verdicts: VerdictSource,
) -> APIRouter:
    router = APIRouter(include_in_schema=False)

    def allowed(request: Request, challenge: bool = True) -> None:
        if not keyed:
            request.state.tenant = "operator"
            return
        tenant = tenant_of_key(key_of(request))
        if tenant is None:
            raise _context.GatewayError(
                FailureClass.REQUEST_INVALID,
                "the status page needs an operator's API key (as the password; any user name)",
                status=401,
                # The page asks the browser for the key; its polls do not (a challenge there
                # would open a prompt the page cannot answer): the browser sends the key it
                # was given for the page.
                headers={"WWW-Authenticate": 'Basic realm="ModelForge status", charset="UTF-8"'} if challenge else {},
            )
        request.state.tenant = tenant
        if not sees_everything(tenant):
            raise _context.GatewayError(
                FailureClass.REQUEST_INVALID,
                "the status page shows every tenant's traffic: it needs an operator's or observer's key "
                "(MODELFORGE_GATEWAY_OPERATORS, MODELFORGE_GATEWAY_OBSERVERS)",
                status=403,
                code="permission_denied",
            )

    @router.get("/ui")
    async def page(request: Request) -> HTMLResponse:
        allowed(request)
        # The first picture comes with the page (drawn before any fetch), so the page shows
        # the pools at once; the polls then fetch from the origin: a page opened with the key
        # in its URL (user:key@host) has a base URL fetch() refuses to resolve against.
        # JSON in a script: every "<" escaped, so no name in it can close the element.
        first = json.dumps(await picture(verdicts)).replace("<", "\\u003c")
        return HTMLResponse(PAGE.replace("__POLL_MS__", str(int(POLL_S * 1000))).replace("__FIRST__", first))

    @router.get("/ui/status.json")
    async def status(request: Request) -> JSONResponse:
        allowed(request, challenge=False)
        return JSONResponse(await picture(verdicts))

    return router


async def picture(verdicts: VerdictSource) -> dict[str, Any]:
    """Every pool's cards, residents and queue, as the page draws them."""
    now = time.time()
    pools = []
    for pool in await verdicts.pools():
        state = await verdicts.state(pool)
        if state is None:
            pools.append({"pool": pool, "answering": False, "cards": [], "residents": [], "queue": []})
            continue
        status = pool_status(state, now)
        cards = []
        for card in status.accelerators:
            observation = state.accelerators[card.id].observation if card.id in state.accelerators else None
            processes: list[dict[str, Any]] = [
                {"pid": p.pid, "name": p.name or f"pid {p.pid}", "bytes": p.used_bytes}
                for p in (observation.processes if observation else [])
                if not p.managed and p.used_bytes > 0
            ]
            named = sum(p["bytes"] for p in processes)
            if card.external_bytes > named:  # what NVML counts but names no process for
                processes.append({"pid": 0, "name": "unattributed", "bytes": card.external_bytes - named})
            cards.append(
                {
                    "id": card.id,
                    "node": card.node,
                    "model": card.model,
                    "simulated_card": card.simulated,
                    "healthy": card.healthy,
                    "fresh": card.fresh,
                    "pressure": card.pressure,
                    "total_bytes": card.total_bytes,
                    "external": processes,
                    "external_bytes": card.external_bytes,
                    "resident_bytes": card.resident_bytes,
                    "leased_bytes": card.leased_bytes,
                    "reserve_bytes": card.reserve_bytes,
                    "free_bytes": max(0, card.schedulable_bytes),
                }
            )
        residents = [
            {
                "deployment": r.deployment,
                "capability": r.capability,
                "accelerator": r.accelerator,
                "bytes": r.bytes,
                "state": r.state,
                "residency": r.residency,
                "active_leases": r.active_leases,
                "ttl_s": r.ttl_s,
                "expires_in_s": None if r.expires_at is None else round(r.expires_at - now, 1),
            }
            for r in status.residents
        ]
        pools.append(
            {
                "pool": pool,
                "answering": True,
                "cards": cards,
                "residents": residents,
                "queue": await verdicts.of_pool(pool),
            }
        )
    return {"now": now, "pools": pools}


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>ModelForge status</title>
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1b1f24; background: #f6f7f9; }
  h1 { font-size: 20px; margin: 0 0 .2em; } h2 { font-size: 16px; margin: 1.2em 0 .4em; }
  .muted { color: #65707d; } .card { background: #fff; border: 1px solid #dde1e6; border-radius: 6px;
  padding: .6em .8em; margin: .5em 0; } .bar { display: flex; height: 22px; border-radius: 4px;
  overflow: hidden; background: #e9ecef; margin: .4em 0; } .seg { height: 100%; min-width: 1px; }
  .external { background: #d9534f; } .external.n1 { background: #e0766f; } .external.n2 { background: #b94441; }
  .resident { background: #3b7dd8; } .leased { background: #7a5cc7; } .reserve { background: #f0ad4e; }
  .free { background: #5cb85c; } .legend span { display: inline-block; margin-right: 1em; }
  .legend i { display: inline-block; width: .8em; height: .8em; margin-right: .3em; border-radius: 2px; }
  table { border-collapse: collapse; width: 100%; background: #fff; } td, th { text-align: left;
  padding: .3em .6em; border-bottom: 1px solid #e6e8eb; } th { background: #eef0f3; font-weight: 600; }
  .bad { color: #b52a25; font-weight: 600; }
</style>
</head>
<body>
<h1>ModelForge status</h1>
<div class="muted" id="updated">loading...</div>
<div id="pools"></div>
<script>
"use strict";
const GiB = 1024 ** 3;
function gib(b) { return (b / GiB).toFixed(1) + " GiB"; }
function secs(s) {
  if (s === null || s === undefined) return "-";
  if (s < 90) return Math.round(s) + " s";
  if (s < 5400) return Math.round(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h";
}
function eta(e) {
  const how = " (" + e.basis + ", " + e.quality + ")";
  if (e.seconds !== null) return secs(e.seconds) + how;
  if (e.at_most_s !== null && e.at_most_s !== undefined) return "at most " + secs(e.at_most_s) + how;
  if (e.at_least_s !== null && e.at_least_s !== undefined) return "at least " + secs(e.at_least_s) + how;
  return "unknown";
}
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const child of children) node.append(child instanceof Node ? child : String(child));
  return node;
}
function table(headers, rows) {
  const t = el("table", {});
  t.append(el("tr", {}, ...headers.map(h => el("th", {}, h))));
  for (const row of rows) t.append(el("tr", {}, ...row.map(c => el("td", {}, c))));
  return t;
}
function card(c) {
  const box = el("div", {class: "card", "data-card": c.id});
  const flags = [c.simulated_card ? "simulated" : "", c.healthy ? "" : "UNHEALTHY", c.fresh ? "" : "stale",
                 c.pressure ? "external pressure" : ""].filter(Boolean).join(", ");
  box.append(el("div", {}, el("b", {}, c.id), " on ", c.node, " - ", c.model, " - ", gib(c.total_bytes),
                flags ? el("span", {class: "bad"}, " (" + flags + ")") : ""));
  const bar = el("div", {class: "bar"});
  const parts = [];
  c.external.forEach((p, n) => parts.push(["external n" + (n % 3), p.bytes, p.name + " (pid " + p.pid + ")"]));
  parts.push(["resident", c.resident_bytes, "resident models"], ["leased", c.leased_bytes, "leased"],
             ["reserve", c.reserve_bytes, "reserve"], ["free", c.free_bytes, "free"]);
  const legend = el("div", {class: "legend"});
  for (const [kind, bytes, label] of parts) {
    if (bytes <= 0) continue;
    const seg = el("div", {class: "seg " + kind, title: label + ": " + gib(bytes), "data-kind": kind.split(" ")[0]});
    seg.style.width = (100 * bytes / Math.max(1, c.total_bytes)) + "%";
    bar.append(seg);
    legend.append(el("span", {}, el("i", {class: kind}), label + " " + gib(bytes)));
  }
  box.append(bar, legend);
  return box;
}
function draw(data) {
  const root = document.getElementById("pools");
  root.replaceChildren();
  for (const pool of data.pools) {
    const section = el("section", {"data-pool": pool.pool});
    section.append(el("h2", {}, "Pool " + pool.pool + (pool.answering ? "" : " (its scheduler does not answer)")));
    for (const c of pool.cards) section.append(card(c));
    section.append(el("h2", {}, "Residents"));
    section.append(table(["deployment", "card", "state", "memory", "leases", "time to live"],
      pool.residents.map(r => [r.deployment, r.accelerator, r.state, gib(r.bytes), r.active_leases,
        r.residency === "pinned" ? "pinned" : (r.expires_in_s === null ? secs(r.ttl_s) : secs(r.expires_in_s))])));
    section.append(el("h2", {}, "Queue (" + pool.queue.length + " waiting)"));
    section.append(table(["#", "request", "capability", "class", "tenant", "why it waits", "waited", "ETA"],
      pool.queue.map((v, n) => [n + 1, v.request_id, v.capability,
        v.priority + " #" + v.position.in_class + " of " + v.position.class_depth, v.tenant,
        v.message || v.reason, secs(v.waited_s),
        eta(v.eta)])));
    root.append(section);
  }
  document.getElementById("updated").textContent = "updated " + new Date(data.now * 1000).toLocaleTimeString();
}
draw(__FIRST__);
async function poll() {
  try {
    const answer = await fetch(location.origin + "/ui/status.json", {credentials: "same-origin"});
    if (!answer.ok) throw new Error(answer.status + " " + (await answer.text()).slice(0, 200));
    draw(await answer.json());
  } catch (error) {
    document.getElementById("updated").textContent = "not updated: " + error.message;
  }
  setTimeout(poll, __POLL_MS__);
}
setTimeout(poll, __POLL_MS__);
</script>
</body>
</html>
"""
