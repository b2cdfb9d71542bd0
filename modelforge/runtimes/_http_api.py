"""The HTTP dialects a model server speaks, each a request builder and a strict response parser.

`openai_embeddings` (vLLM, llama.cpp's server, text-embeddings-inference's OpenAI route),
`openai_chat` (vLLM, llama.cpp's server: its chat route, and for an input with a `prompt` and no
`messages` its completions route, the prompt as it is and a `suffix` to fill in the middle of),
`tei_embed` (text-embeddings-inference's /embed) and
`rerank` (the Cohere/Jina-style `/v1/rerank` of vLLM, llama.cpp's server and TEI-compatible
servers). Whatever the dialect, the runtime answers in ModelForge's own output shape: `embeddings`
(and `embedding`, the first) for embedding capabilities, `text` and `finish_reason` for chat;
`choices` when the answer holds more than one text (`n`, tool calls, logprobs), `results`
(`[{"index", "relevance_score"}]`, highest score first) for a reranker, and `usage` when the
server reported token counts.

Request parameters (`temperature`, `tools`, `dimensions`... and any other field the server takes)
travel in the input's `parameters` object and reach an OpenAI-compatible server as they are; a
dialect that takes none (`tei_embed`) refuses them, naming them: a parameter is never dropped.
An embeddings input may be token ids (`token_ids`, a list of lists of ints, as OpenAI's `input`
takes them): `openai_embeddings` sends them as they are, `tei_embed` refuses them.

A streamed chat answer (`stream_record`) becomes the records the node pushes to the gateway
(activities/_stream_push.py): `{"delta": text}` for plain text of the first choice, and for
anything more (reasoning, tool calls, logprobs, a second choice, a choice's own finish) the
server's choices whole, `{"choices": [{"index", "delta", "logprobs"?, "finish_reason"?}],
"delta": <the first choice's text, if any>}`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from modelforge.failures import FailureClass, ModelForgeError

API_NAMES = ("openai_embeddings", "openai_chat", "tei_embed", "rerank")

# The functional health check: a paraphrase must be closer than an unrelated sentence.
HEALTH_TEXTS = ["A cat is sitting on the mat.", "A cat sits on a mat.", "Quarterly revenue rose by four percent."]
HEALTH_MESSAGES = [{"role": "user", "content": "Reply with the single word: ready"}]
# A reranker's: the document that answers the query must score above the unrelated one.
HEALTH_RERANK = {
    "query": "Where does the cat sit?",
    "documents": ["Quarterly revenue rose by four percent.", "The cat sits on the mat."],
}
# The most documents one rerank request may hold.
MAX_DOCUMENTS = 1000


# An `openai_chat` server's completions route: a prompt as it is, no chat template (Ollama's
# `raw`), and a `suffix` for the server to fill in the middle of (Ollama's `suffix`).
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class HttpCall:
    path: str
    body: dict[str, Any]
    expected: int  # vectors the answer must hold (1 for chat)

    @property
    def completion(self) -> bool:
        return self.path == COMPLETIONS_PATH


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


def token_ids_of(payload: dict[str, Any]) -> list[list[int]] | None:
    """The input's `token_ids` (None without): a non-empty list of non-empty lists of token ids."""
    ids = payload.get("token_ids")
    if ids is None:
        return None
    if (
        not isinstance(ids, list)
        or not ids
        or not all(
            isinstance(row, list)
            and row
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in row)
            for row in ids
        )
    ):
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID, "'token_ids' must be a non-empty list of non-empty lists of token ids"
        )
    return ids


# Fields of the server's request body that ModelForge itself fills (streaming: the gateway's
# `stream: true` asks for it): a parameter of that name is refused rather than overriding them.
_OWN_FIELDS = {
    "openai_embeddings": ("model", "input"),
    "openai_chat": ("model", "messages", "prompt", "suffix", "stream", "stream_options"),
    "rerank": ("model", "query", "documents", "top_n"),
}
# Options a chat input may also carry at its top level (older callers, the health check).
_CHAT_TOP_LEVEL = ("max_tokens", "temperature", "top_p", "stop")


def parameters_of(payload: dict[str, Any]) -> dict[str, Any]:
    """The input's `parameters` object ({} without one); REQUEST_INVALID if it is not an object."""
    parameters = payload.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict) or not all(isinstance(k, str) for k in parameters):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "'parameters' must be an object of name: value")
    return parameters


def _passed(api: str, parameters: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(name for name in parameters if name in _OWN_FIELDS.get(api, ()))
    if taken:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID,
            f"parameters: {', '.join(taken)} cannot be given as parameters"
            + (" (ask the gateway with stream: true)" if any(n.startswith("stream") for n in taken) else ""),
        )
    return parameters


def rerank_input(payload: dict[str, Any]) -> tuple[str, list[str], int | None]:
    """A rerank input's query, documents (text) and `top_n` (None: all), or REQUEST_INVALID."""
    query, documents, top_n = payload.get("query"), payload.get("documents"), payload.get("top_n")
    if not isinstance(query, str) or not query:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "a rerank request needs 'query', a non-empty string")
    if not isinstance(documents, list) or not documents or not all(isinstance(d, str) for d in documents):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "'documents' must be a non-empty list of strings")
    if len(documents) > MAX_DOCUMENTS:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"at most {MAX_DOCUMENTS} documents per rerank request")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "'top_n' must be a whole number of at least 1")
    return query, documents, top_n


def ranked(scores: list[float], top_n: int | None) -> list[dict[str, Any]]:
    """`[{"index", "relevance_score"}]`, highest score first (ties by index), cut to `top_n`."""
    order = sorted(range(len(scores)), key=lambda n: (-scores[n], n))
    return [{"index": n, "relevance_score": scores[n]} for n in order[:top_n]]


def build_call(api: str, served_model: str, payload: dict[str, Any]) -> HttpCall:
    parameters = parameters_of(payload)
    if api == "rerank":
        if "texts" in payload or "text" in payload or "token_ids" in payload or "messages" in payload:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                "this deployment is a reranker (api 'rerank'): it takes a query and documents (POST /v1/rerank), "
                "not texts to embed or messages",
            )
        query, documents, top_n = rerank_input(payload)
        body: dict[str, Any] = {"model": served_model, "query": query, "documents": documents}
        if top_n is not None:
            body["top_n"] = top_n
        body.update(_passed(api, parameters))
        return HttpCall("/v1/rerank", body, len(documents))
    if "query" in payload and "documents" in payload:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID,
            f"a rerank request (query and documents) needs a reranker; this deployment's server speaks {api!r}",
        )
    ids = token_ids_of(payload) if api != "openai_chat" else None
    if api == "openai_embeddings":
        inputs: list[Any] = ids if ids is not None else texts_of(payload)
        body = {"model": served_model, "input": inputs, **_passed(api, parameters)}
        return HttpCall("/v1/embeddings", body, len(inputs))
    if api == "tei_embed":
        if ids is not None:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                "token_ids: text-embeddings-inference's /embed (api 'tei_embed') is sent text here; send "
                "strings, or serve the model with api 'openai_embeddings' to pass token ids",
            )
        texts = texts_of(payload)
        if parameters:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"parameters {', '.join(sorted(parameters))}: text-embeddings-inference's /embed (api "
                "'tei_embed') takes none; serve the model with api 'openai_embeddings' to pass them",
            )
        return HttpCall("/embed", {"inputs": texts}, len(texts))
    messages = payload.get("messages")
    if messages is None and "prompt" in payload:
        return _completion_call(served_model, payload, parameters)
    if not isinstance(messages, list) or not messages:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "a chat request needs a non-empty 'messages' list")
    body = {"model": served_model, "messages": messages}
    for option in _CHAT_TOP_LEVEL:
        if option in payload:
            body[option] = payload[option]
    body.update(_passed(api, parameters))
    return HttpCall("/v1/chat/completions", body, 1)


def _completion_call(served_model: str, payload: dict[str, Any], parameters: dict[str, Any]) -> HttpCall:
    """A raw prompt (and a suffix to fill in the middle of) to the server's completions route."""
    prompt, suffix = payload.get("prompt"), payload.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "'suffix' must be a string")
    if not isinstance(prompt, str) or not (prompt or suffix):
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID, "a completion request needs 'prompt', a string (empty only with a suffix)"
        )
    body: dict[str, Any] = {"model": served_model, "prompt": prompt}
    if suffix:
        body["suffix"] = suffix
    for option in _CHAT_TOP_LEVEL:
        if option in payload:
            body[option] = payload[option]
    body.update(_passed("openai_chat", parameters))
    return HttpCall(COMPLETIONS_PATH, body, 1)


def _as_chat_choices(answer: Any) -> Any:
    """A completions answer (`choices[].text`) in a chat answer's shape (`choices[].message`),
    so one parser reads both; its logprobs (the completions API's own shape) pass as they are."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list):
        return answer
    shaped = []
    for choice in choices:
        if not isinstance(choice, dict) or "text" not in choice:
            shaped.append(choice)
            continue
        text = choice["text"]
        if not isinstance(text, str):
            raise _invalid("completion answer's choices[].text is not a string")
        chat = {k: v for k, v in choice.items() if k != "text"}
        chat["message"] = {"role": "assistant", "content": text}
        shaped.append(chat)
    return {**answer, "choices": shaped}


def _vector(value: Any, where: str) -> list[float]:
    if not isinstance(value, list) or not value:
        raise _invalid(f"{where} is not a non-empty list of numbers")
    vector = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int | float) or not math.isfinite(item):
            raise _invalid(f"{where} holds {item!r}, not a finite number")
        vector.append(float(item))
    return vector


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_of(answer: Any, chat: bool) -> dict[str, int] | None:
    """The token counts the server reported (OpenAI's `usage`), or None when it reported none
    or something that is not counts: the gateway then marks its own figures estimated."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt = _count(usage.get("prompt_tokens"))
    completion = _count(usage.get("completion_tokens", 0 if not chat else None))
    if prompt is None or completion is None:
        return None
    total = _count(usage.get("total_tokens"))
    counts = {"prompt_tokens": prompt, "total_tokens": total if total is not None else prompt + completion}
    if chat:
        counts["completion_tokens"] = completion
    return counts


# What a chat choice holds beyond its text; with any of these (or more than one choice) the
# output carries `choices` whole.
_PLAIN_MESSAGE = {"role", "content"}


def _choice(index: int, choice: Any) -> dict[str, Any]:
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        raise _invalid(f"chat answer's choices[{index}] has no message")
    message = dict(choice["message"])
    content = message.get("content")
    calls = message.get("tool_calls")
    # No content is an answer too (tool calls only, or a reasoning model cut short in its thinking).
    if content is not None and not isinstance(content, str):
        raise _invalid(f"chat answer's choices[{index}].message.content is not a string")
    if calls is not None and not isinstance(calls, list):
        raise _invalid(f"chat answer's choices[{index}].message.tool_calls is not a list")
    message.setdefault("role", "assistant")
    shaped: dict[str, Any] = {
        "index": index,
        "message": message,
        "finish_reason": str(choice.get("finish_reason") or ("tool_calls" if calls else "stop")),
    }
    if choice.get("logprobs") is not None:
        shaped["logprobs"] = choice["logprobs"]
    return shaped


def _index(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def stream_record(chunk: Any, finishes: dict[int, str]) -> dict[str, Any] | None:
    """One streamed chunk of an OpenAI-compatible server as the record the node pushes (module
    docstring), or None when it carries nothing to pass on (the role, a usage chunk). A plain
    chunk's finish reason is kept in `finishes` (choice index -> reason) for the end record; a
    choice that holds more is passed whole, its finish reason with it."""
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list):
        return None
    text: list[str] = []  # the first choice's text, in order
    whole: list[dict[str, Any]] = []
    plain: list[str] = []  # plain text of the first choice not yet placed in `whole`
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        index = _index(choice.get("index"))
        raw = choice.get("delta")
        if raw is None and isinstance(choice.get("text"), str):  # a completions chunk: its text
            raw = {"content": choice["text"]}
        delta = {k: v for k, v in raw.items() if v is not None} if isinstance(raw, dict) else {}
        logprobs = choice.get("logprobs")
        finish = choice.get("finish_reason")
        if finish:
            finishes[index] = str(finish)
        if index == 0:  # the gateway says the first choice's role itself
            delta.pop("role", None)
        if delta.get("content") == "":
            delta.pop("content")
        content = delta.get("content")
        if index == 0 and isinstance(content, str):
            text.append(content)
        if index == 0 and set(delta) <= {"content"} and logprobs is None:
            if isinstance(content, str):
                plain.append(content)
            continue
        if not delta and logprobs is None and not finish:
            continue
        if plain:
            whole.append({"index": 0, "delta": {"content": "".join(plain)}})
            plain = []
        shaped: dict[str, Any] = {"index": index, "delta": delta}
        if logprobs is not None:
            shaped["logprobs"] = logprobs
        if finish:
            shaped["finish_reason"] = str(finish)
        whole.append(shaped)
    said = "".join(text)
    if not whole:
        return {"delta": said} if said else None
    if plain:
        whole.append({"index": 0, "delta": {"content": "".join(plain)}})
    record: dict[str, Any] = {"choices": whole}
    if said:
        record["delta"] = said  # for who reads text only: the Ollama routes, an older gateway
    return record


def _rerank_output(answer: Any, expected: int) -> dict[str, Any]:
    """A `/v1/rerank` answer (vLLM, llama.cpp, TEI-compatible: `results` of `index` and
    `relevance_score`, TEI's own `/rerank` a bare list of `index` and `score`) as `results`,
    highest score first; each index once, within the documents sent."""
    rows = answer.get("results") if isinstance(answer, dict) else answer
    if not isinstance(rows, list) or not rows:
        raise _invalid("rerank answer has no results[]")
    scores: dict[int, float] = {}
    for n, row in enumerate(rows):
        index = row.get("index") if isinstance(row, dict) else None
        score = row.get("relevance_score", row.get("score")) if isinstance(row, dict) else None
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < expected or index in scores:
            raise _invalid(f"rerank answer's results[{n}].index is not a new index of the {expected} documents")
        if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
            raise _invalid(f"rerank answer's results[{n}].relevance_score is not a finite number")
        scores[index] = float(score)
    order = sorted(scores, key=lambda n: (-scores[n], n))
    output: dict[str, Any] = {"results": [{"index": n, "relevance_score": scores[n]} for n in order]}
    usage = usage_of(answer, chat=False)
    if usage is None and isinstance(answer, dict) and isinstance(answer.get("usage"), dict):
        total = _count(answer["usage"].get("total_tokens"))  # vLLM's and Jina's rerank usage: a total
        if total is not None:
            usage = {"prompt_tokens": total, "total_tokens": total}
    if usage is not None:
        output["usage"] = usage
    return output


def check_rerank(results: list[dict[str, Any]]) -> None:
    """HEALTH_RERANK's results: the document that answers the query first."""
    if not results or results[0]["index"] != 1:
        raise ModelForgeError(
            FailureClass.HEALTHCHECK_FAILED,
            f"the document that answers the query does not rank first (results {results[:2]})",
        )


def parse_response(api: str, answer: Any, expected: int, completion: bool = False) -> dict[str, Any]:
    """The server's JSON as ModelForge output; anything else is INVALID_OUTPUT, named.
    `completion`: the answer of the completions route (`COMPLETIONS_PATH`)."""
    if api == "rerank":
        return _rerank_output(answer, expected)
    if api == "openai_chat":
        if completion:
            answer = _as_chat_choices(answer)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or not choices:
            raise _invalid("chat answer has no choices[0].message.content")
        shaped = [_choice(n, choice) for n, choice in enumerate(choices)]
        first = shaped[0]
        output: dict[str, Any] = {
            "text": first["message"].get("content") or "",
            "finish_reason": first["finish_reason"],
        }
        if len(shaped) > 1 or any("logprobs" in c or set(c["message"]) - _PLAIN_MESSAGE for c in shaped):
            output["choices"] = shaped
        usage = usage_of(answer, chat=True)
        if usage is not None:
            output["usage"] = usage
        return output
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
    output = {"embeddings": vectors, "embedding": vectors[0], "dimensions": len(vectors[0])}
    usage = usage_of(answer, chat=False) if api == "openai_embeddings" else None
    if usage is not None:
        output["usage"] = usage
    return output


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
