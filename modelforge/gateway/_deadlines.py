"""A request's deadline from clients that never heard of `deadline_s`: the time they will wait.

A client that gives up after T seconds gains nothing from work that cannot finish within T: the
scheduler refuses it early (DEADLINE_CANNOT_BE_MET, 504) when its load and measured service
cannot fit, instead of leaving it to run for nobody. Where the gateway finds the wait:

| header | sent by | applies to |
|---|---|---|
| `X-Request-Timeout: <seconds>` | any client that sets it | every call |
| `X-Stainless-Timeout: <seconds>` | the `anthropic` package (its request timeout) | calls answered whole |
| `X-Stainless-Read-Timeout: <seconds>` | the `openai` and `anthropic` packages (read timeout) | calls answered whole |

A deadline in the body (`POST /v1/requests`' `deadline_s`) wins over every header. The SDKs'
headers are read timeouts (600 s unless the client sets `timeout=`): for an answer sent whole
the client reads nothing until it is done, so the read timeout bounds the whole wait; a streamed
answer sends bytes as it goes (and, while it waits, its verdict lines), so only
`X-Request-Timeout` gives a stream a deadline.

The deadline applied is the wait less a margin (`margin_s`: a fifth of it, at most a
second), so that a refusal reaches the client before it stops listening (a refusal at the
deadline takes a scheduler pass and two workflow hops to reach the client: half a second on a
loaded host). The deadline counts from the request's start, so the time its admission takes to
reach the scheduler is not added to the client's wait. The answer says what was
applied in `X-ModelForge-Deadline-Applied: <seconds> (from <header> <value>)`, also logged
(`deadline_applied`). A malformed or out-of-range `X-Request-Timeout` is REQUEST_INVALID (400);
a malformed SDK header is left aside (the caller did not write it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from starlette.datastructures import Headers

from modelforge.failures import FailureClass, ModelForgeError

# The longest deadline a request may carry (the client's and the scheduler's bound: 7 days).
MAX_DEADLINE_S = 7 * 24 * 3600.0
EXPLICIT_HEADER = "x-request-timeout"
# The SDKs' own: the anthropic package's request timeout, then both packages' read timeout.
SDK_HEADERS = ("x-stainless-timeout", "x-stainless-read-timeout")


@dataclass(frozen=True)
class AppliedDeadline:
    deadline_s: float
    note: str  # what X-ModelForge-Deadline-Applied says


def margin_s(timeout_s: float) -> float:
    """What is kept back from a client's wait so a refusal still reaches it in time."""
    return min(1.0, timeout_s / 5)


def _seconds(text: str) -> float | None:
    try:
        value = float(text.strip())
    except ValueError:
        return None
    return value if math.isfinite(value) and 0 < value <= MAX_DEADLINE_S else None


def header_deadline(headers: Headers, *, streamed: bool) -> AppliedDeadline | None:
    """The deadline a call's headers give it (see the module's table), or None."""
    explicit = headers.get(EXPLICIT_HEADER)
    if explicit is not None:
        seconds = _seconds(explicit)
        if seconds is None:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"X-Request-Timeout: give seconds, more than 0 and at most {MAX_DEADLINE_S:.0f} "
                f"(not {explicit[:40]!r})",
            )
        return _applied(seconds, "X-Request-Timeout")
    if streamed:
        return None
    for name in SDK_HEADERS:
        given = headers.get(name)
        seconds = _seconds(given) if given is not None else None
        if seconds is not None:
            return _applied(seconds, "-".join(part.capitalize() for part in name.split("-")))
    return None


def _applied(timeout_s: float, source: str) -> AppliedDeadline:
    deadline = round(timeout_s - margin_s(timeout_s), 3)
    return AppliedDeadline(deadline, f"{deadline:g} (from {source} {timeout_s:g})")


def body_deadline(deadline_s: float) -> AppliedDeadline:
    return AppliedDeadline(deadline_s, f"{deadline_s:g} (from the body's deadline_s)")


def apply_deadline(state: object, headers: Headers, options: dict[str, object]) -> None:
    """Set `options["deadline_s"]` (the request's, for `Requester.request`) from the body's or
    the headers', and note it in `state.deadline_applied` for the answer's header and the log."""
    given = options.get("deadline_s")
    if isinstance(given, int | float) and not isinstance(given, bool):
        applied: AppliedDeadline | None = body_deadline(float(given))
    else:
        applied = header_deadline(headers, streamed=options.get("stream") is not None)
    if applied is None:
        return
    options["deadline_s"] = applied.deadline_s
    state.deadline_applied = applied.note  # type: ignore[attr-defined]
