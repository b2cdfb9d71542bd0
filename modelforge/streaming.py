"""The key nodes and gateways share for streamed answers (MODELFORGE_STREAM_KEY, or the file
MODELFORGE_STREAM_KEY_FILE names): a node signs the stream id it pushes to, so a push cannot be
forged by whoever reads a request's history (which holds the id, never the key). And what both
ends know of a streamed chat choice: a whole message as a delta (`message_delta`), and deltas
back into whole choices (`ChoiceAssembler`)."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Any

from modelforge.failures import FailureClass, ModelForgeError

STREAM_KEY_ENV = "MODELFORGE_STREAM_KEY"
STREAM_KEY_FILE_ENV = "MODELFORGE_STREAM_KEY_FILE"
SIGNATURE_HEADER = "X-ModelForge-Stream-Signature"


def stream_key() -> bytes | None:
    """The key shared by the gateway and the nodes; None where none is configured (the
    gateway then takes pushes from loopback only)."""
    path = os.environ.get(STREAM_KEY_FILE_ENV)
    if path:
        try:
            return Path(path).read_text(encoding="utf-8").strip().encode() or None
        except OSError as error:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, f"{STREAM_KEY_FILE_ENV}: cannot read {path}: {error.strerror}"
            ) from None
    value = os.environ.get(STREAM_KEY_ENV, "")
    return value.encode() if value else None


def signature(key: bytes, stream_id: str) -> str:
    return hmac.new(key, stream_id.encode(), hashlib.sha256).hexdigest()


def message_delta(message: dict[str, Any]) -> dict[str, Any]:
    """A whole chat message as one streamed delta (what a runtime that answered in one piece
    streams): its fields as they are, each tool call with the `index` a delta's carry."""
    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        delta["tool_calls"] = [
            {"index": n, **call} if isinstance(call, dict) and "index" not in call else call
            for n, call in enumerate(calls)
        ]
    return delta


class ChoiceAssembler:
    """Streamed choices put back together as a whole answer's `choices` (OpenAI's chat
    completion shape): texts (content, reasoning_content, reasoning, refusal) joined, tool
    calls merged by their index (arguments joined), logprobs lists joined, the last finish
    reason. `rich` once anything beyond the first choice's plain text was seen."""

    _TEXTS = ("content", "reasoning_content", "reasoning", "refusal")

    def __init__(self) -> None:
        self._choices: dict[int, dict[str, Any]] = {}
        self.rich = False

    def _choice(self, index: int) -> dict[str, Any]:
        return self._choices.setdefault(
            index, {"index": index, "message": {"role": "assistant", "content": None}, "finish_reason": None}
        )

    def text(self, piece: str) -> None:
        message = self._choice(0)["message"]
        message["content"] = (message["content"] or "") + piece

    def add(self, choice: dict[str, Any]) -> None:
        index = choice.get("index")
        index = index if isinstance(index, int) and not isinstance(index, bool) and index >= 0 else 0
        entry = self._choice(index)
        message = entry["message"]
        raw = choice.get("delta")
        delta: dict[str, Any] = raw if isinstance(raw, dict) else {}
        for name, value in delta.items():
            if name == "role" or value is None:
                continue
            if name in self._TEXTS and isinstance(value, str):
                message[name] = (message.get(name) or "") + value
                if name != "content" or index != 0:
                    self.rich = True
            elif name == "tool_calls" and isinstance(value, list):
                self.rich = True
                self._tool_calls(message, value)
            else:  # a field of the server's own: the latest value
                self.rich = True
                message[name] = value
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            self.rich = True
            kept = entry.setdefault("logprobs", {})
            for name, value in logprobs.items():
                if isinstance(value, list):
                    kept[name] = [*(kept.get(name) or []), *value]
                else:
                    kept[name] = value
        if choice.get("finish_reason"):
            entry["finish_reason"] = str(choice["finish_reason"])
        if index != 0:
            self.rich = True

    @staticmethod
    def _tool_calls(message: dict[str, Any], calls: list[Any]) -> None:
        kept: list[dict[str, Any]] = message.setdefault("tool_calls", [])
        for call in calls:
            if not isinstance(call, dict):
                continue
            at = call.get("index")
            at = at if isinstance(at, int) and not isinstance(at, bool) and at >= 0 else len(kept)
            while len(kept) <= at:
                kept.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            target = kept[at]
            for name, value in call.items():
                if name == "index" or value is None:
                    continue
                if name == "function" and isinstance(value, dict):
                    function = target["function"]
                    for part, text in value.items():
                        if isinstance(text, str) and part in ("name", "arguments"):
                            function[part] = function.get(part, "") + text
                        elif text is not None:
                            function[part] = text
                else:
                    target[name] = value

    def choices(self, finish: str) -> list[dict[str, Any]]:
        """Every choice seen, by index; one without its own finish reason gets `finish`."""
        if not self._choices:
            self._choice(0)
        whole = []
        for index in sorted(self._choices):
            entry = dict(self._choices[index])
            entry["message"] = dict(entry["message"])
            entry["finish_reason"] = entry["finish_reason"] or finish
            whole.append(entry)
        return whole

    def finish_of(self, index: int) -> str | None:
        entry = self._choices.get(index)
        return entry["finish_reason"] if entry else None


def first_choice_delta(choices: list[Any]) -> dict[str, Any] | None:
    """The first choice's delta in one pushed record's `choices`, its pieces merged (texts
    joined, tool call pieces in order): for readers of the first choice only (the Ollama
    routes read it as the record's `choice_delta`). None when the record holds none of it."""
    merged: dict[str, Any] = {}
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0 or not isinstance(choice.get("delta"), dict):
            continue
        for name, value in choice["delta"].items():
            have = merged.get(name)
            if isinstance(have, str) and isinstance(value, str):
                merged[name] = have + value
            elif isinstance(have, list) and isinstance(value, list):
                merged[name] = [*have, *value]
            else:
                merged[name] = value
    return merged or None
