"""Ollama's request and answer shapes, translated to and from what ModelForge's runtimes take
(the OpenAI chat shape an `openai_chat` model server reads), and Ollama's `keep_alive` decided
against the catalog and the caller's rights. Pure functions: `_ollama.py` routes, this module
translates, so each rule has one home and a table test (tests/unit/test_ollama_translate.py).

The rules, as the README's "Ollama API" section states them:
- Null is absent, in the body and in `options` (LlamaIndex and LangChain send every option,
  null unless set).
- An option that only steers the runner (`num_thread`, `num_gpu`, `use_mmap`...) is accepted
  and changes nothing; `num_ctx` is accepted up to the deployment's `context_length` (past it,
  400 naming the limit). A sampling option reaches the model server under its OpenAI-compatible
  name (`num_predict` -> `max_tokens`, `repeat_penalty` -> `repetition_penalty`...); a runtime
  that passes no sampling options refuses one by name, since the answer would not be what was
  asked.
- `tools`, `format`, `think`, images and tool-call messages map to their OpenAI equivalents for
  an `openai_chat` server, and its answer maps back (`message.tool_calls`, `message.thinking`).
- `keep_alive` is a hint (`keep_alive_decision`): honoured up to what the catalog keeps, never
  past it, never the reason a request fails; only an operator's key unloads a model the catalog
  keeps warm. The answer says what was applied (`X-ModelForge-Keep-Alive`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from modelforge.domain import Deployment, Residency

# Ollama option -> the name an OpenAI-compatible server (vLLM, llama.cpp's server) takes it by.
SAMPLING_OPTIONS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "max_tokens",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repeat_penalty": "repetition_penalty",
}
# Options that steer how the runner loads and computes, not what it answers: accepted, unused
# (the catalog's runtime decides them for every caller alike).
RUNNER_OPTIONS = frozenset(
    {
        "num_thread",
        "num_gpu",
        "main_gpu",
        "use_mmap",
        "use_mlock",
        "num_batch",
        "low_vram",
        "f16_kv",
        "vocab_only",
        "numa",
        "num_keep",
        "logits_all",
    }
)
# Sampling options of Ollama's llama.cpp runner that OpenAI-compatible servers have no name
# for: refused by name when given (each changes the answer).
_UNMAPPED_SAMPLING = frozenset(
    {"mirostat", "mirostat_eta", "mirostat_tau", "tfs_z", "repeat_last_n", "penalize_newline"}
)
# Ollama's message roles and OpenAI's (a role a model server does not know is its 400).
MESSAGE_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class TranslationError(ValueError):
    """A request that cannot be served as asked: the message names the field and what to do."""


def present(mapping: dict[str, Any] | None) -> dict[str, Any]:
    """The entries that are not null (null means absent)."""
    return {name: value for name, value in (mapping or {}).items() if value is not None}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Options:
    """`options` read: what reaches the model server, and what was accepted without effect."""

    sampling: dict[str, Any]  # by the server's names
    accepted: tuple[str, ...]  # runner options and num_ctx: accepted, no effect on the answer
    num_ctx: int | None = None


def read_options(
    options: dict[str, Any] | None, deployment: Deployment, *, taken: frozenset[str] | None = None
) -> Options:
    """Ollama's `options` for this deployment (see the module's rules); TranslationError names
    the first one that cannot be served. `taken`: the sampling parameters (by the server's names)
    the runtime honours; None: all (an OpenAI-compatible server)."""
    sampling: dict[str, Any] = {}
    accepted: list[str] = []
    num_ctx: int | None = None
    for name, value in present(options).items():
        if name in RUNNER_OPTIONS:
            accepted.append(name)
        elif name == "num_ctx":
            if not _number(value) or int(value) != value or value <= 0:
                raise TranslationError("options.num_ctx: a positive whole number of tokens")
            limit = deployment.context_length
            if limit and value > limit:
                raise TranslationError(
                    f"options.num_ctx: {int(value)} is past {deployment.deployment_id}'s context length of "
                    f"{limit} tokens; ask for at most {limit} or leave num_ctx out"
                )
            num_ctx = int(value)
            accepted.append(name)
        elif name == "stop":
            stops = [value] if isinstance(value, str) else value
            if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
                raise TranslationError("options.stop: give up to 16 non-empty strings")
            if stops:
                sampling["stop"] = stops
        elif name == "num_predict":
            if not _number(value) or int(value) != value or value < -2:
                raise TranslationError("options.num_predict: a whole number of tokens (-1: no limit)")
            if value > 0:
                sampling["max_tokens"] = int(value)
        elif name == "seed":
            if not _number(value) or int(value) != value:
                raise TranslationError("options.seed: a whole number")
            sampling["seed"] = int(value)
        elif name in SAMPLING_OPTIONS:
            if not _number(value):
                raise TranslationError(f"options.{name}: a number")
            if name in ("top_p", "min_p", "typical_p") and not 0 <= value <= 1:
                raise TranslationError(f"options.{name}: a number from 0 to 1")
            if name in ("temperature", "top_k", "repeat_penalty") and value < 0:
                raise TranslationError(f"options.{name}: a number, 0 or more")
            sampling[SAMPLING_OPTIONS[name]] = int(value) if name == "top_k" else value
        elif name in _UNMAPPED_SAMPLING:
            raise TranslationError(
                f"options.{name} changes the answer and OpenAI-compatible model servers have no such option; "
                "leave it out"
            )
        else:
            accepted.append(name)  # an option Ollama may add later: ignored, as Ollama ignores unknown ones
    lost = sorted(set(sampling) - taken) if taken is not None else []
    if lost:
        takes = f"takes only {', '.join(sorted(taken or ()))}" if taken else "takes no sampling options"
        raise TranslationError(
            f"options ({', '.join(lost)}): {deployment.capability} (runtime {deployment.runtime}) {takes}, "
            "so the answer would not be what they ask; leave them out, or serve the model from an "
            "OpenAI-compatible server (subprocess_http, api openai_chat)"
        )
    return Options(sampling, tuple(accepted), num_ctx)


def response_format(format_: Any) -> dict[str, Any] | None:
    """Ollama's `format` ("json" or a JSON schema) as OpenAI's `response_format`."""
    if format_ in (None, ""):
        return None
    if format_ == "json":
        return {"type": "json_object"}
    if isinstance(format_, dict):
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": format_, "strict": True}}
    raise TranslationError('format: "json" or a JSON schema object')


def thinking(think: Any) -> dict[str, Any]:
    """Ollama's `think` as the parameters OpenAI-compatible servers read: a level as
    `reasoning_effort`; true/false as the chat template's `enable_thinking` (vLLM, llama.cpp)."""
    if think is None:
        return {}
    if isinstance(think, bool):
        return {"chat_template_kwargs": {"enable_thinking": think}}
    if think in ("low", "medium", "high"):
        return {"reasoning_effort": think}
    raise TranslationError('think: true, false, "low", "medium" or "high"')


def _image_part(image: str) -> dict[str, Any]:
    url = image if image.startswith("data:") else f"data:image/png;base64,{image}"
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_call_out(n: int, m: int, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise TranslationError(f"messages[{n}].tool_calls[{m}]: needs function.name")
    arguments = function.get("arguments", {})
    return {
        "id": str(call.get("id") or f"call_{n}_{m}"),
        "type": "function",
        "function": {
            "name": function["name"],
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }


def chat_messages(messages: list[dict[str, Any]], *, rich: bool) -> list[dict[str, Any]]:
    """Ollama's messages as OpenAI's. `rich`: the server takes images, tool calls and tool
    results (openai_chat); otherwise a message carrying any is refused by name."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # the last assistant turn's tool calls, answered in order
    for n, message in enumerate(messages):
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise TranslationError(
                f"messages[{n}].role: {str(role)[:40]!r} is not a role (system, user, assistant or tool)"
            )
        content = message.get("content") or ""
        images = present({"images": message.get("images")}).get("images") or []
        calls = message.get("tool_calls") or []
        if not rich:
            for field in ("images", "tool_calls", "thinking"):
                if message.get(field):
                    raise TranslationError(
                        f"messages[{n}].{field}: this model takes role and content only; serve it from an "
                        "OpenAI-compatible server (subprocess_http, api openai_chat) for images and tools"
                    )
            if role == "tool":
                raise TranslationError(f"messages[{n}]: tool results need a model served with api openai_chat")
            out.append({"role": role, "content": content})
            continue
        shaped: dict[str, Any] = {"role": role}
        if images:
            shaped["content"] = [{"type": "text", "text": content}, *(_image_part(str(i)) for i in images)]
        else:
            shaped["content"] = content
        if calls:
            shaped["tool_calls"] = [_tool_call_out(n, m, call) for m, call in enumerate(calls)]
            pending = list(shaped["tool_calls"])
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not call_id:
                named = [c for c in pending if c["function"]["name"] == message.get("tool_name")]
                candidates = named or pending
                if candidates:
                    call_id = candidates[0]["id"]
                    pending.remove(candidates[0])
                else:
                    call_id = f"call_{n}"
            shaped["tool_call_id"] = str(call_id)
        out.append(shaped)
    return out


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def ollama_tool_calls(calls: Any) -> list[dict[str, Any]]:
    """OpenAI's tool calls as Ollama's (`arguments` an object, not a JSON string)."""
    shaped = []
    for index, call in enumerate(calls if isinstance(calls, list) else []):
        function = (call or {}).get("function") or {}
        shaped.append(
            {
                "id": call.get("id") or f"call_{index}",
                "function": {
                    "index": index,
                    "name": function.get("name", ""),
                    "arguments": _arguments(function.get("arguments") or {}),
                },
            }
        )
    return shaped


def reasoning_of(message: dict[str, Any]) -> str | None:
    value = message.get("reasoning_content", message.get("reasoning"))
    return value if isinstance(value, str) and value else None


def ollama_message(output: dict[str, Any]) -> dict[str, Any]:
    """The first choice of a runtime's chat output as Ollama's `message`."""
    choices = output.get("choices")
    first = choices[0].get("message") if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    first = first if isinstance(first, dict) else {}
    text = output.get("text")
    message: dict[str, Any] = {"role": "assistant", "content": text if isinstance(text, str) else ""}
    thought = reasoning_of(first)
    if thought:
        message["thinking"] = thought
    if first.get("tool_calls"):
        message["tool_calls"] = ollama_tool_calls(first["tool_calls"])
    return message


def ollama_logprobs(output: dict[str, Any]) -> list[dict[str, Any]] | None:
    """OpenAI's `choices[0].logprobs.content` as Ollama's `logprobs` list."""
    choices = output.get("choices")
    if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
        return None
    content = (choices[0].get("logprobs") or {}).get("content")
    if not isinstance(content, list):
        return None
    return [
        {
            "token": entry.get("token", ""),
            "logprob": entry.get("logprob", 0.0),
            "top_logprobs": [
                {"token": top.get("token", ""), "logprob": top.get("logprob", 0.0)}
                for top in entry.get("top_logprobs") or []
            ],
        }
        for entry in content
        if isinstance(entry, dict)
    ]


# --- keep_alive -----------------------------------------------------------------------------


def idle_limit_s(deployment: Deployment) -> float:
    """How long the catalog keeps this deployment loaded after its last request."""
    if deployment.residency == Residency.ALWAYS_WARM:
        return math.inf
    if deployment.residency == Residency.KEEP_WARM:
        return deployment.ttl_s
    return 0.0  # load_on_demand and none: unloaded once its last lease ends and nobody waits


def _seconds(value: float) -> str:
    return "forever" if value == math.inf else f"{value:g}s"


@dataclass(frozen=True)
class KeepAlive:
    """What a keep_alive hint does for this caller: `applied_s` is how long the model stays
    loaded after this request by the catalog's rules; `unload` asks for the model's unload once
    the call is done (an operator's keep_alive 0 only); `note` says why, for the answer."""

    asked_s: float
    applied_s: float
    unload: bool
    note: str

    def header(self) -> str:
        return f"asked={_seconds(self.asked_s)}; applied={_seconds(self.applied_s)}; {self.note}"


def keep_alive_decision(deployment: Deployment, asked_s: float | None, *, operator: bool) -> KeepAlive | None:
    """Ollama's keep_alive as ModelForge honours it. A tenant's hint releases its own hold (its
    lease ends with its request whatever it says) and may ask the model to stay as long as the
    catalog keeps it; it never unloads, shortens or pins what the catalog keeps for everyone,
    and it never fails a request. An operator's keep_alive 0 unloads a keep_warm model once the
    call is done (recorded with who asked); pinning stays `modelforge pin`."""
    if asked_s is None:
        return None
    limit = idle_limit_s(deployment)
    name = deployment.deployment_id
    kept = (
        f"the catalog keeps {name} loaded until evicted (always_warm)"
        if limit == math.inf
        else f"the catalog keeps {name} {limit:g}s after its last request (keep_warm ttl_s)"
        if limit > 0
        else f"{name} is unloaded when its last request ends ({deployment.residency.value})"
    )
    if asked_s == 0:
        if limit == 0:
            return KeepAlive(0.0, 0.0, False, kept)
        if operator and limit != math.inf:
            return KeepAlive(0.0, 0.0, True, f"unloaded when done, as an operator asked; {kept} otherwise")
        why = (
            "unloading a model the catalog keeps warm for everyone is an operator's action"
            if not operator
            else "an always_warm model is unloaded with `modelforge unload`"
        )
        return KeepAlive(0.0, limit, False, f"your hold is released; not unloaded: {why}; {kept}")
    if asked_s == math.inf:
        if limit == math.inf:
            return KeepAlive(asked_s, limit, False, kept)
        return KeepAlive(asked_s, limit, False, f"pinning is an operator's action (modelforge pin); {kept}")
    if asked_s > limit:
        return KeepAlive(asked_s, limit, False, f"capped: {kept}")
    if asked_s < limit:
        return KeepAlive(asked_s, limit, False, f"at least what was asked: {kept}")
    return KeepAlive(asked_s, limit, False, kept)
