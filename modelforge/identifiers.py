"""The rules for identifiers a client sends, and text that reaches the stores.

One home: the client, the CLI, the gateway and the scheduler's admission check all call these, so
an identifier that one entrance accepts every other accepts too, and one that reaches Temporal's
history, a Postgres row or a log line is plain printable ASCII of bounded length.

| identifier | rule |
| --- | --- |
| tenant | 1-64 of `A-Z a-z 0-9 . _ -`, starting with a letter or digit |
| request id | 1-128 of `A-Z a-z 0-9 . _ : -`, starting with a letter or digit |
| capability | 1-200 of `A-Z a-z 0-9 . _ : / + -`, starting with a letter or digit, then optionally `@version` |

Anything else (control characters, NUL, newlines, whitespace, non-ASCII letters, lone surrogates,
over-long names) is `REQUEST_INVALID` at the entrance, before any workflow starts. Free text
(messages, a model server's error, a runtime's output) is never refused: `storable_text` makes
it safe for Postgres (which rejects NUL in text and jsonb) and for UTF-8 (lone surrogates)."""

from __future__ import annotations

import re

from modelforge.failures import FailureClass, ModelForgeError

TYPE_CHECKING = False  # typing's, without importing typing: the CLI's fast path imports this module
if TYPE_CHECKING:
    from typing import Any

MAX_TENANT_LENGTH = 64
MAX_REQUEST_ID_LENGTH = 128
MAX_CAPABILITY_LENGTH = 200

TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
CAPABILITY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]*(@[A-Za-z0-9._-]+)?")
# Who an application says asked, within a tenant (Open WebUI's forwarded user id): recorded on the
# request's events, never a tenant. Printable ASCII, no leading space.
MAX_END_USER_LENGTH = 128
END_USER = re.compile(r"[!-~][ -~]{0,127}")

# A priority class: a level, or `queue.level` (matched whole, as every pattern here: `$` would
# also match before a trailing newline). The scheduler checks it against the catalog's queues.
CLASS_PART = re.compile(r"[a-z0-9][a-z0-9_-]{0,59}")
PRIORITY_CLASS = re.compile(r"[a-z0-9][a-z0-9_-]{0,59}(\.[a-z0-9][a-z0-9_-]{0,59})?")

# The numeric bounds of a request, one set for every entrance (client, CLI, gateway) and the
# scheduler's own admission check. The longest wait for admission (deadline_s, lease_timeout_s):
MAX_WAIT_S = 7 * 24 * 3600.0
# The shortest and longest lease a request may ask for (max_duration_s; a job's run time). One
# maximum: the stored payloads' retention floor (payloads.LONGEST_REQUEST_S) is the longest wait
# plus this, so a longer lease anywhere would outlive its own input.
MIN_DURATION_S = 1.0
MAX_DURATION_S = 7 * 24 * 3600.0

_RULES: dict[str, tuple[re.Pattern[str], int, str]] = {
    "tenant": (TENANT, MAX_TENANT_LENGTH, "1-64 of A-Z a-z 0-9 . _ -, starting with a letter or digit"),
    "request_id": (REQUEST_ID, MAX_REQUEST_ID_LENGTH, "1-128 of A-Z a-z 0-9 . _ : -, starting with a letter or digit"),
    "end_user": (END_USER, MAX_END_USER_LENGTH, "1-128 printable ASCII characters, not starting with a space"),
    "capability": (
        CAPABILITY,
        MAX_CAPABILITY_LENGTH,
        "1-200 of A-Z a-z 0-9 . _ : / + -, starting with a letter or digit, optionally @version",
    ),
}


def identifier_problem(kind: str, value: object) -> str | None:
    """Why `value` is not a valid identifier of `kind`, or None. The message quotes the value
    escaped and cut, so it is itself safe to store and print."""
    pattern, limit, rule = _RULES[kind]
    if not isinstance(value, str):
        return f"{kind} must be a string, not {type(value).__name__}"
    if len(value) > limit:
        return f"{kind} is {len(value)} characters; at most {limit} ({rule})"
    if not pattern.fullmatch(value):
        return f"{kind} {shown(value)} is not valid: {rule}"
    return None


def check_identifier(kind: str, value: object) -> str:
    """`value` if it is a valid identifier of `kind`; `REQUEST_INVALID` otherwise."""
    problem = identifier_problem(kind, value)
    if problem is not None:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, problem)
    assert isinstance(value, str)
    return value


def shown(value: str, limit: int = 80) -> str:
    """A value as a quoted, escaped, cut string: printable ASCII whatever it held."""
    cut = value[:limit]
    text = cut.encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if 32 <= ord(c) < 127 else f"\\x{ord(c):02x}" for c in text)
    return repr(text) + ("..." if len(value) > limit else "")


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable_text(value: str) -> str:
    """Text Postgres and UTF-8 accept: NUL and lone surrogates become visible escapes; everything
    else (any other Unicode) is kept as it is."""
    if not _UNSTORABLE.search(value):
        return value
    return _UNSTORABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", value)


def storable(value: Any, depth: int = 0) -> Any:
    """A JSON-like value with every string (keys too) made storable; nesting past 64 levels is
    cut with a marker (what the store keeps is for people to read, not to round-trip)."""
    if depth > 64:
        return "<nested too deep>"
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_text(str(k)): storable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable(v, depth + 1) for v in value]
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)  # jsonb has no NaN or infinity
    return value
