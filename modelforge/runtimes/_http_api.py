"""The HTTP dialects a model server speaks, each a request builder and a strict response parser.

`openai_embeddings` (vLLM, llama.cpp's server, text-embeddings-inference's OpenAI route),
`openai_chat` (vLLM, llama.cpp's server) and `tei_embed` (text-embeddings-inference's /embed).
Whatever the dialect, the runtime answers in ModelForge's own output shape: `embeddings` (and
`embedding`, the first) for embedding capabilities, `text` and `finish_reason` for chat."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from modelforge.failures import FailureClass, ModelForgeError

API_NAMES = ("openai_embeddings", "openai_chat", "tei_embed")

# The functional health check: a paraphrase must be closer than an unrelated sentence.
HEALTH_TEXTS = ["A cat is sitting on the mat.", "A cat sits on a mat.", "Quarterly revenue rose by four percent."]
HEALTH_MESSAGES = [{"role": "user", "content": "Reply with the single word: ready"}]


@dataclass(frozen=True)
class HttpCall:
    path: str
    body: dict[str, Any]
    expected: int  # vectors the answer must hold (1 for chat)


def _invalid(message: str) -> ModelForgeError:
    return ModelForgeError(FailureClass.INVALID_OUTPUT, message)


def texts_of(payload: dict[str, Any]) -> list[str]:
    texts = payload.get("texts")
    if texts is None:
        text = payload.get("text")
        if not isinstance(text, str) or not text:
            raise ModelForgeError(FailureClass.REQUEST_INVALID, "an embedding request needs 'text' or 'texts'")
        return [text]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "'texts' must be a non-empty list of non-empty strings")
    return texts


def build_call(api: str, served_model: str, payload: dict[str, Any]) -> HttpCall:
    if api == "openai_embeddings":
        texts = texts_of(payload)
        return HttpCall("/v1/embeddings", {"model": served_model, "input": texts}, len(texts))
    if api == "tei_embed":
        texts = texts_of(payload)
        return HttpCall("/embed", {"inputs": texts}, len(texts))
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "a chat request needs a non-empty 'messages' list")
    body: dict[str, Any] = {"model": served_model, "messages": messages}
    for option in ("max_tokens", "temperature", "top_p", "stop"):
        if option in payload:
            body[option] = payload[option]
    return HttpCall("/v1/chat/completions", body, 1)


def _vector(value: Any, where: str) -> list[float]:
    if not isinstance(value, list) or not value:
        raise _invalid(f"{where} is not a non-empty list of numbers")
    vector = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | float) or not math.isfinite(item):
            raise _invalid(f"{where} holds {item!r}, not a finite number")
        vector.append(float(item))
    return vector


def parse_response(api: str, answer: Any, expected: int) -> dict[str, Any]:
    """The server's JSON as ModelForge output; anything else is INVALID_OUTPUT, named."""
    if api == "openai_chat":
        try:
            choice = answer["choices"][0]
            text = choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise _invalid("chat answer has no choices[0].message.content") from None
        if not isinstance(text, str):
            raise _invalid("chat answer's content is not a string")
        return {"text": text, "finish_reason": str(choice.get("finish_reason") or "stop")}
    if api == "tei_embed":
        rows = answer
    else:
        try:
            data = sorted(answer["data"], key=lambda row: int(row.get("index", 0)))
            rows = [row["embedding"] for row in data]
        except (KeyError, TypeError, ValueError, AttributeError):
            raise _invalid("embedding answer has no data[].embedding") from None
    if not isinstance(rows, list) or len(rows) != expected:
        raise _invalid(
            f"expected {expected} vectors, got {len(rows) if isinstance(rows, list) else type(rows).__name__}"
        )
    vectors = [_vector(row, f"vector {n}") for n, row in enumerate(rows)]
    if len({len(v) for v in vectors}) != 1:
        raise _invalid("vectors of different lengths in one answer")
    return {"embeddings": vectors, "embedding": vectors[0], "dimensions": len(vectors[0])}


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def check_embeddings(vectors: list[list[float]], dimensions: int | None = None) -> None:
    """HEALTH_TEXTS' vectors: the expected width, and the paraphrase closer than the unrelated."""
    if dimensions is not None and len(vectors[0]) != dimensions:
        raise ModelForgeError(
            FailureClass.HEALTHCHECK_FAILED, f"{len(vectors[0])} dimensions, the catalog says {dimensions}"
        )
    paraphrase, unrelated = _cosine(vectors[0], vectors[1]), _cosine(vectors[0], vectors[2])
    if not paraphrase > unrelated:
        raise ModelForgeError(
            FailureClass.HEALTHCHECK_FAILED,
            f"a paraphrase is no closer than an unrelated sentence (cosine {paraphrase:.3f} vs {unrelated:.3f})",
        )
