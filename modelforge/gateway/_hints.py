"""What unmodified clients say about a request beyond its model call: how urgent it is (vLLM's
`priority` body field, OpenAI's `service_tier`) and, from Open WebUI, which of its users asked.

**Priority.** ModelForge's classes are the catalog's (`[[queues]]`, or the built-in production >
interactive > background > benchmark > maintenance). A hint moves a request along its tenant's
home queue (the queue of its `default_priority`), relative to that default:

| hint | class |
|---|---|
| `service_tier` `auto`, `default`; vLLM `priority: 0` | the tenant's default |
| `service_tier` `flex` | one level below the default |
| `service_tier` `priority`, `scale`, `fast` | one level above the default |
| vLLM `priority: n` (lower is more urgent) | `n` levels below the default (`-n` above), within the queue |

A class above the tenant's ceiling (`max_priority`: the API key's tenant decides it) is capped
there, never refused: the answer's `X-ModelForge-Priority-Applied` header (and the access log's
`priority_applied`) says `<class> (asked <hint>[, capped at the key's ceiling <class>])`.
`X-ModelForge-Priority`, ModelForge's own header, names a class outright and wins over a hint
(the note says the hint was not used). The hints are ModelForge's: they never reach a model
server (vLLM refuses a non-zero `priority` unless started with priority scheduling).

**End user.** Open WebUI forwards its user in `X-OpenWebUI-User-Id` (and `-Name`, `-Email`,
`-Role`) when `ENABLE_FORWARD_USER_INFO_HEADERS` is on. The id alone is recorded (the access log's
`end_user`, and the `end_user` of the lease's `lease_granted` and `lease_released` events:
printable ASCII, at most 128 characters); name, e-mail and role are not kept. No header ever
changes the tenant: the API key decides it (docs/SECURITY.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelforge.domain import Catalog, PriorityClass
from modelforge.identifiers import MAX_END_USER_LENGTH

# OpenAI's service tiers: levels moved from the tenant's default (positive: less urgent).
SERVICE_TIERS = {"auto": 0, "default": 0, "flex": 1, "priority": -1, "scale": -1, "fast": -1}
END_USER_HEADER = "x-openwebui-user-id"
MAX_END_USER = MAX_END_USER_LENGTH


@dataclass(frozen=True)
class Hinted:
    """The class a hint asks for (None: no hint, or it could not be placed: the tenant's default
    as before), and what to say about it (empty: nothing to say)."""

    priority: str | None = None
    note: str = ""


def hint_of(call: Any) -> tuple[str, int] | None:
    """(what the body asked, as written; levels from the default) or None. `priority` and
    `service_tier` both asking for something is refused by the caller (`conflict`)."""
    priority = getattr(call, "priority", None)
    tier = getattr(call, "service_tier", None)
    if priority is not None:
        return f"priority={priority}", int(priority)
    if tier is not None:
        return f"service_tier={tier}", SERVICE_TIERS[tier]
    return None


def conflict(call: Any) -> bool:
    """Whether the body gives a vLLM `priority` and a `service_tier` that asks for something."""
    tier = getattr(call, "service_tier", None)
    return getattr(call, "priority", None) is not None and tier is not None and SERVICE_TIERS[tier] != 0


def hinted(catalog: Catalog, tenant_name: str, call: Any, header: str | None, *, keyed: bool) -> Hinted:
    """The class the body's hint maps to for `tenant_name` (module docstring)."""
    asked = hint_of(call)
    if asked is None:
        return Hinted()
    label, offset = asked
    if header is not None:
        return Hinted(None, f"{header} (X-ModelForge-Priority; {label} not used)")
    tenant = catalog.tenant(tenant_name)
    home = catalog.priority_class(tenant.default_priority) if tenant is not None else None
    if tenant is None or home is None:
        return Hinted()  # admission refuses an unknown tenant itself
    levels: list[PriorityClass] = [k for k in catalog.classes.values() if k.queue == home.queue]
    at = min(max(levels.index(home) + offset, 0), len(levels) - 1)
    target = levels[at]
    ceiling = catalog.priority_class(tenant.max_priority)
    if ceiling is not None and target.priority > ceiling.priority:
        target = next(k for k in levels if k.priority <= ceiling.priority)
        whose = "the key's" if keyed else "the tenant's"
        return Hinted(target.id, f"{target.id} (asked {label}, capped at {whose} ceiling {ceiling.id})")
    return Hinted(target.id, f"{target.id} (asked {label})")


def end_user(headers: Any) -> str:
    """Open WebUI's forwarded user id, as printable ASCII of at most MAX_END_USER characters
    ("" without one)."""
    value = str(headers.get(END_USER_HEADER) or "").strip()[:MAX_END_USER]
    escaped = "".join(c if 32 <= ord(c) < 127 else f"\\x{ord(c):02x}" for c in value)
    return escaped[:MAX_END_USER].strip()  # what modelforge.identifiers' END_USER takes
