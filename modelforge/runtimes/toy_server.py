"""ModelForge's own small model server: the OpenAI embeddings, chat and completions routes (a
prompt as it is, `suffix` for fill-in-the-middle), TEI's /embed, the
Cohere/Jina-style /v1/rerank (vLLM's) and a /health probe, on the standard library alone. It is
what the subprocess_http runtime is tested against, and a way to try that runtime without a real
model. Its vectors are hashed bags of
words (a paraphrase shares words, so it lands closer than an unrelated sentence); its chat
answers say they are from the toy server. `--fault` breaks it on purpose, as real servers break.

It takes OpenAI's request parameters as a real server does, so a test can see them act: `n`
choices (on completions too, with `echo` and the completions API's `logprobs`), `stop`,
`max_tokens` (its tokens are words and punctuation marks), `tools` (a call when
`tool_choice` names a function or is "required", or, with "auto" or none given, when the last
user message names one of the tools' functions: each named one is called, the first only with
`parallel_tool_calls: false`; arguments `{"said": <the message>}`), `response_format`
json_object/json_schema, `logprobs` (each token at logprob 0, `top_logprobs` alternatives of it),
and `dimensions` for embeddings, whose `input` may be token ids (`[[1, 2], [3]]`, as OpenAI's);
it reports `usage` in its own tokens. It reasons first as a reasoning model does
(`reasoning_content`, or the field `--reasoning-field` names) when started with `--reasoning`,
when the served model's name has "reason" in it, or when a request gives `reasoning_effort`
(not "none"). `stream: true` answers as OpenAI's server-sent chunks: reasoning, content (with
logprobs), tool calls (name first, then the arguments in pieces) and each choice's finish, the
`n` choices interleaved (with `stream_options.include_usage`, a usage chunk), and
`GET /streams` tells which streams' clients went away before the end; `--answer-tokens N` makes
every chat answer N tokens long (its usual words, then counting words), for long streams.
`/v1/rerank` scores each document by the share of the query's words it holds (`lexical_score`,
deterministic), answers vLLM's shape (`results` of `index`, `relevance_score` and `document`,
highest first, cut to `top_n`; `usage.total_tokens`).
`GET /received` answers the last request bodies it received (path and body), so a test can
check that parameters reached it.

    python -m modelforge.runtimes.toy_server --port 8081 [--fault never-ready|exit-at-start|
        crash-on-invoke|garbage|nan|hang] [--hold-mib 64] [--ready-after 0.5] [--ignore-term] [--orphan-worker]
        [--token-delay-ms 20] [--answer-tokens 512] [--reasoning] [--reasoning-field reasoning]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DIMENSIONS = 64
FAULTS = ("never-ready", "exit-at-start", "crash-on-invoke", "garbage", "nan", "hang")
# The most choices (`n`) it gives; past it, 400 as a real server answers a value it refuses.
MAX_CHOICES = 8
# Request bodies kept for GET /received.
RECEIVED_KEPT = 50
_TOKEN = re.compile(r"\w+|[^\w\s]")


def tokens(text: str) -> int:
    """The toy server's token count: words and punctuation marks."""
    return len(_TOKEN.findall(text))


def _cut(text: str, limit: int) -> str:
    """`text` up to the end of its `limit`-th token."""
    ends = [match.end() for match in _TOKEN.finditer(text)]
    return text if len(ends) <= limit else text[: ends[limit - 1] if limit > 0 else 0]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _to_length(text: str, count: int) -> str:
    """`text` cut or padded with counting words ("w9 w10 ...") to exactly `count` tokens."""
    have = tokens(text)
    if have >= count:
        return _cut(text, count)
    words = [f"w{n}" for n in range(have, count)]
    return " ".join([text, *words]) if text else " ".join(words)


def _called(body: dict[str, Any], said: str, last_role: Any) -> list[str]:
    """The functions a chat answer calls (module docstring), in the tools' order."""
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    names = [str((t.get("function") or {}).get("name") or "tool") for t in tools]
    choice = body.get("tool_choice")
    if not tools or choice == "none":
        return []
    if isinstance(choice, dict):
        return [str((choice.get("function") or {}).get("name") or names[0])]
    if choice == "required":
        mentioned = [n for n in names if re.search(rf"\b{re.escape(n)}\b", said)]
        return mentioned[:1] or names[:1] if body.get("parallel_tool_calls") is False else mentioned or names[:1]
    if last_role != "user":  # a tool's result came back: answer with text
        return []
    mentioned = [n for n in names if re.search(rf"\b{re.escape(n)}\b", said)]
    return mentioned[:1] if body.get("parallel_tool_calls") is False else mentioned


def reasons(body: dict[str, Any], always: bool = False) -> bool:
    """Whether the answer to `body` reasons first (module docstring)."""
    effort = body.get("reasoning_effort")
    return always or "reason" in str(body.get("model", "")).lower() or (effort is not None and effort != "none")


def _logprobs(text: str, top: Any) -> dict[str, Any]:
    alternatives = top if isinstance(top, int) and top > 0 else 0
    return {
        "content": [
            {
                "token": t,
                "logprob": 0.0,
                "bytes": list(t.encode()),
                "top_logprobs": [{"token": t, "logprob": 0.0, "bytes": list(t.encode())}] * min(1, alternatives),
            }
            for t in _TOKEN.findall(text)
        ]
    }


def _limited(content: str, body: dict[str, Any]) -> tuple[str, str]:
    """(content, finish_reason) under the request's `stop` and `max_tokens`."""
    finish = "stop"
    stops = body.get("stop")
    for stop in [stops] if isinstance(stops, str) else stops if isinstance(stops, list) else []:
        if isinstance(stop, str) and stop and stop in content:
            content = content[: content.index(stop)]
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(limit, int) and tokens(content) > limit:
        content, finish = _cut(content, limit), "length"
    return content, finish


def completion_answer(body: dict[str, Any], answer_tokens: int = 0) -> tuple[int, dict[str, Any]]:
    """OpenAI's completions answer to `body` (status, JSON): the prompt taken as it is (no chat
    template), and with a `suffix` a middle that leads up to it, as a fill-in-the-middle model
    answers; 400 for a prompt or suffix that is not a string, as a real server refuses it."""
    prompt, suffix = body.get("prompt"), body.get("suffix")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or (suffix is not None and not isinstance(suffix, str)):
        return 400, {"error": {"message": "prompt (and suffix) must be a string", "param": "prompt"}}
    if suffix:
        content = f"[toy server] fills in after {prompt[-60:]!r} before {suffix[:60]!r}"
    else:
        content = f"[toy server] continues {prompt[-80:]!r}"
    if answer_tokens > 0:
        content = _to_length(content, answer_tokens)
    content, finish = _limited(content, body)
    used, made = tokens(prompt) + tokens(suffix or ""), tokens(content)
    if body.get("echo"):
        content = prompt + content
    asked, wanted = body.get("n"), body.get("logprobs")
    count = asked if isinstance(asked, int) and 0 < asked <= MAX_CHOICES else 1
    logprobs = None
    if isinstance(wanted, int) and not isinstance(wanted, bool):  # the completions API's own shape
        found = list(_TOKEN.finditer(content))
        logprobs = {
            "tokens": [m.group() for m in found],
            "token_logprobs": [0.0] * len(found),
            "top_logprobs": [{m.group(): 0.0} for m in found] if wanted > 0 else None,
            "text_offset": [m.start() for m in found],
        }
    return 200, {
        "id": "cmpl-toy",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.get("model", "toy"),
        "choices": [{"index": n, "text": content, "finish_reason": finish, "logprobs": logprobs} for n in range(count)],
        "usage": {"prompt_tokens": used, "completion_tokens": count * made, "total_tokens": used + count * made},
    }


def chat_answer(
    body: dict[str, Any], answer_tokens: int = 0, reasoning: bool = False, reasoning_field: str = "reasoning_content"
) -> dict[str, Any]:
    """An OpenAI chat completion for `body`, honouring the parameters listed in the docstring;
    `answer_tokens` above 0: the answer's content is that many tokens long; `reasoning`: it
    reasons first (in `reasoning_field`) whatever the request."""
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    # What it answers is the last message that is not a system one (an agent may end its
    # conversation with a system message: Claude Code's environment).
    last = next((m for m in reversed(messages) if m.get("role") != "system"), messages[-1] if messages else {})
    text = _text_of(last.get("content"))
    said = text[:200]
    content = f"[toy server] ready. You said: {said}"
    if answer_tokens > 0:
        content = _to_length(content, answer_tokens)
    response_format = body.get("response_format")
    format_type = response_format.get("type") if isinstance(response_format, dict) else None
    if format_type in ("json_object", "json_schema"):
        content = json.dumps({"toy": True, "said": said})
    content, finish = _limited(content, body)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    called = _called(body, text, last.get("role"))
    if called:
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_toy_{n}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps({"said": said})},
                }
                for n, name in enumerate(called)
            ],
        }
        finish = "tool_calls"
    if reasons(body, reasoning):
        message[reasoning_field] = f"The user said {said!r}. I answer as the toy server does."
    asked = body.get("n")
    count = asked if isinstance(asked, int) and asked > 0 else 1
    choices = []
    for index in range(count):
        entry: dict[str, Any] = {"index": index, "message": message, "finish_reason": finish}
        if body.get("logprobs") and message.get("content"):
            entry["logprobs"] = _logprobs(message["content"], body.get("top_logprobs"))
        choices.append(entry)
    prompt = sum(tokens(_text_of(m.get("content"))) for m in messages if isinstance(m, dict))
    completion = count * tokens(message.get("content") or json.dumps(message.get("tool_calls")))
    return {
        "id": "chatcmpl-toy",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", "toy"),
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


def embed(text: str) -> list[float]:
    vector = [0.0] * DIMENSIONS
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        digest = hashlib.sha256(word.encode()).digest()
        vector[digest[0] % DIMENSIONS] += 1.0 if digest[1] % 2 else -1.0
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [round(x / norm, 6) for x in vector]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def lexical_score(query: str, document: str) -> float:
    """The share of the query's distinct words the document holds, 0..1, rounded to 6 places."""
    asked = set(_words(query))
    return round(len(asked & set(_words(document))) / len(asked), 6) if asked else 0.0


def rerank_answer(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """vLLM's /v1/rerank answer to `body` (status, JSON), or 400 as it refuses a bad request."""
    query, documents, top_n = body.get("query"), body.get("documents"), body.get("top_n")
    if not isinstance(query, str) or not isinstance(documents, list) or not documents:
        return 400, {"error": {"message": "query (a string) and documents (a non-empty list) are required"}}
    texts = [d.get("text") if isinstance(d, dict) else d for d in documents]
    if not all(isinstance(t, str) for t in texts):
        return 400, {"error": {"message": "each document is a string or {text}"}}
    scores = [lexical_score(query, str(t)) for t in texts]
    order = sorted(range(len(texts)), key=lambda n: (-scores[n], n))
    if isinstance(top_n, int) and top_n > 0:
        order = order[:top_n]
    used = tokens(query) * len(texts) + sum(tokens(str(t)) for t in texts)
    return 200, {
        "id": "rerank-toy",
        "model": body.get("model", "toy"),
        "usage": {"total_tokens": used},
        "results": [{"index": n, "document": {"text": texts[n]}, "relevance_score": scores[n]} for n in order],
    }


class _Handler(BaseHTTPRequestHandler):
    server: _ToyServer

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write("toy_server: " + format % args + "\n")

    def _answer(self, status: int, body: Any, raw: bytes | None = None) -> None:
        data = raw if raw is not None else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/info":  # what the server was started with, for tests and for users
            self._answer(
                200,
                {
                    "pid": os.getpid(),
                    "argv": sys.argv,
                    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "children": self.server.children,
                },
            )
        elif self.path == "/received":  # what it was asked, for tests that check parameters arrived
            self._answer(200, {"requests": list(self.server.received)})
        elif self.path == "/streams":  # every streamed answer: pieces sent, and whether its client left
            self._answer(200, {"streams": list(self.server.streams)})
        elif self.path != "/health":
            self._answer(404, {"error": "not found"})
        elif self.server.fault == "never-ready" or time.monotonic() < self.server.ready_at:
            self._answer(503, {"status": "loading"})
        else:
            self._answer(200, {"status": "ok"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            self._answer(400, {"error": "body is not JSON"})
            return
        self.server.received.append({"path": self.path, "body": body})
        del self.server.received[:-RECEIVED_KEPT]
        if self.path in ("/sleep?level=1", "/sleep"):  # vLLM's sleep mode: weights leave the card
            self.server.weights = bytearray()
            self.server.asleep = True
            self._answer(200, {"asleep": True})
            return
        if self.path == "/wake_up":
            self.server.weights = _touched(self.server.hold_mib)
            self.server.asleep = False
            self._answer(200, {"asleep": False})
            return
        if self.path == "/checkpoint":
            self.server.checkpoints += 1
            spec = body if isinstance(body, dict) else {}
            destination = spec.get("destination")
            if destination:  # the node's checkpoint store: write the state there
                os.makedirs(destination, exist_ok=True)
                target = os.path.join(destination, "toy-state.json")
                with open(target, "w", encoding="utf-8") as state:
                    json.dump({"checkpoints": self.server.checkpoints, "lease_id": spec.get("lease_id")}, state)
                self._answer(200, {"location": target})
            else:
                self._answer(200, {"location": f"toy://{os.getpid()}/checkpoint-{self.server.checkpoints}"})
            return
        if self.server.asleep:
            self._answer(503, {"error": "asleep: POST /wake_up first"})
            return
        fault = self.server.fault
        if fault == "crash-on-invoke":
            sys.stderr.write("toy_server: crashing on purpose (--fault crash-on-invoke)\n")
            sys.stderr.flush()
            os._exit(3)
        if fault == "hang":
            time.sleep(3600)
        if fault == "garbage":
            self._answer(200, None, raw=b"<html>definitely not JSON</html>")
            return
        if self.path == "/v1/embeddings":
            texts = body.get("input")
            if isinstance(texts, list) and texts and all(isinstance(t, int) for t in texts):
                texts = [texts]  # one input's token ids
            texts = [texts] if isinstance(texts, str) else texts
            if not isinstance(texts, list) or not texts:
                self._answer(400, {"error": "input must be a string, a list of strings or token id lists"})
                return
            # Token ids are embedded as words of their own ("t42"), as consistently as text.
            texts = [" ".join(f"t{i}" for i in t) if isinstance(t, list) else t for t in texts]
            vectors = [embed(str(t)) for t in texts]
            dimensions = body.get("dimensions")
            if isinstance(dimensions, int) and 0 < dimensions < DIMENSIONS:  # a matryoshka model's cut
                vectors = [v[:dimensions] for v in vectors]
            if fault == "nan":
                vectors[0][0] = float("nan")
            used = sum(tokens(str(t)) for t in texts)
            self._answer(
                200,
                {
                    "object": "list",
                    "model": body.get("model", "toy"),
                    "data": [{"object": "embedding", "index": n, "embedding": v} for n, v in enumerate(vectors)],
                    "usage": {"prompt_tokens": used, "total_tokens": used},
                },
            )
        elif self.path == "/v1/rerank":
            status, answer = rerank_answer(body if isinstance(body, dict) else {})
            self._answer(status, answer)
        elif self.path == "/embed":
            texts = body.get("inputs")
            texts = [texts] if isinstance(texts, str) else texts
            self._answer(200, [embed(str(t)) for t in texts or []])
        elif self.path == "/v1/chat/completions":
            if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
                self._answer(400, {"error": "messages must be a list"})
                return
            asked = body.get("n", 1)
            if not isinstance(asked, int) or not 1 <= asked <= MAX_CHOICES:  # as a real server refuses
                self._answer(400, {"error": {"message": f"n must be from 1 to {MAX_CHOICES}", "param": "n"}})
                return
            answer = chat_answer(body, self.server.answer_tokens, self.server.reasoning, self.server.reasoning_field)
            if body.get("stream"):
                chunks = stream_chunks(answer, self.server.reasoning_field, bool(body.get("logprobs")))
                self._stream(body, answer, chunks)
            else:
                self._answer(200, answer)
        elif self.path == "/v1/completions":
            status, answer = completion_answer(body if isinstance(body, dict) else {}, self.server.answer_tokens)
            if status == 200 and body.get("stream"):
                self._stream(body, answer, completion_chunks(answer), "text_completion")
            else:
                self._answer(status, answer)
        else:
            self._answer(404, {"error": "not found"})

    def _stream(
        self,
        body: dict[str, Any],
        answer: dict[str, Any],
        chunks: list[tuple[dict[str, Any], bool]],
        kind: str = "chat.completion.chunk",
    ) -> None:
        """The answer as OpenAI's server-sent chunks (`stream_chunks`, `completion_chunks`),
        `--token-delay-ms` apart. A client that goes away stops it: the stream is recorded as
        aborted (GET /streams), with how many pieces went out."""
        pieces = sum(1 for _, piece in chunks if piece)
        record = {"pieces": pieces, "sent": 0, "aborted": False, "done": False}
        self.server.streams.append(record)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        base = {
            "id": answer["id"],
            "object": kind,
            "created": answer["created"],
            "model": answer["model"],
        }

        def send(chunk: dict[str, Any] | str) -> None:
            data = chunk if isinstance(chunk, str) else json.dumps(chunk)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        try:
            for choice, piece in chunks:
                if piece:
                    time.sleep(self.server.token_delay_s)
                send({**base, "choices": [choice]})
                record["sent"] += 1 if piece else 0
            options = body.get("stream_options")
            if isinstance(options, dict) and options.get("include_usage"):
                send({**base, "choices": [], "usage": answer["usage"]})
            send("[DONE]")
            record["done"] = True
        except (BrokenPipeError, ConnectionResetError):
            record["aborted"] = True


def _pieces(text: str) -> list[str]:
    return re.findall(r"\S+\s*", text)


def completion_chunks(answer: dict[str, Any]) -> list[tuple[dict[str, Any], bool]]:
    """A whole completions answer as the streamed choices a server sends: each choice's text a
    piece at a time, then its finish (several choices one after another)."""
    out: list[tuple[dict[str, Any], bool]] = []
    for choice in answer["choices"]:
        index = choice["index"]
        out += [({"index": index, "text": piece, "finish_reason": None}, True) for piece in _pieces(choice["text"])]
        out.append(({"index": index, "text": "", "finish_reason": choice["finish_reason"]}, False))
    return out


def stream_chunks(answer: dict[str, Any], reasoning_field: str, logprobs: bool) -> list[tuple[dict[str, Any], bool]]:
    """A whole chat answer as the streamed choices a server sends, each with whether it is a
    generated piece (a token's worth: reasoning, content, a tool call's part): per choice its
    role, reasoning, content (with its logprobs), tool calls (id and name, then the arguments in
    pieces) and finish; several choices interleaved, as vLLM sends them."""
    per_choice: list[list[tuple[dict[str, Any], bool]]] = []
    for whole in answer["choices"]:
        index, message = whole["index"], whole["message"]
        out: list[tuple[dict[str, Any], bool]] = [
            ({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}, False)
        ]
        for piece in _pieces(message.get(reasoning_field) or ""):
            out.append(({"index": index, "delta": {reasoning_field: piece}, "finish_reason": None}, True))
        for piece in _pieces(message.get("content") or ""):
            choice: dict[str, Any] = {"index": index, "delta": {"content": piece}, "finish_reason": None}
            if logprobs:
                choice["logprobs"] = _logprobs(piece, 0)
            out.append((choice, True))
        for n, call in enumerate(message.get("tool_calls") or []):
            head = {
                "index": n,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            out.append(({"index": index, "delta": {"tool_calls": [head]}, "finish_reason": None}, True))
            arguments = call["function"]["arguments"]
            third = max(1, len(arguments) // 3)
            for at in range(0, len(arguments), third):
                part = {"index": n, "function": {"arguments": arguments[at : at + third]}}
                out.append(({"index": index, "delta": {"tool_calls": [part]}, "finish_reason": None}, True))
        out.append(({"index": index, "delta": {}, "finish_reason": whole["finish_reason"]}, False))
        per_choice.append(out)
    interleaved: list[tuple[dict[str, Any], bool]] = []
    for at in range(max(len(c) for c in per_choice)):
        interleaved.extend(c[at] for c in per_choice if at < len(c))
    return interleaved


class _ToyServer(ThreadingHTTPServer):
    daemon_threads = True
    fault: str = ""
    ready_at: float = 0.0
    children: list[int] = []
    weights: bytearray = bytearray()
    hold_mib: int = 0
    asleep: bool = False
    checkpoints: int = 0
    received: list[dict[str, Any]] = []
    streams: list[dict[str, Any]] = []
    token_delay_s: float = 0.0
    answer_tokens: int = 0
    reasoning: bool = False
    reasoning_field: str = "reasoning_content"


def _touched(mib: int) -> bytearray:
    """`mib` MiB with every page written, so it is resident memory, as loaded weights are."""
    weights = bytearray(mib * 1024 * 1024)
    for offset in range(0, len(weights), 4096):
        weights[offset] = 1
    return weights


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fault", choices=FAULTS, default="")
    parser.add_argument("--ready-after", type=float, default=0.3, help="seconds before /health answers 200")
    parser.add_argument("--hold-mib", type=int, default=0, help="host memory to hold, as a model's weights would")
    parser.add_argument("--note", default="", help="free text, ignored (shows in /info's argv)")
    parser.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM (a server that will not stop)")
    parser.add_argument("--token-delay-ms", type=float, default=0.0, help="time between streamed tokens")
    parser.add_argument(
        "--answer-tokens", type=int, default=0, help="every chat answer this many tokens long (0: as it comes)"
    )
    parser.add_argument("--reasoning", action="store_true", help="reason first, as a reasoning model (every answer)")
    parser.add_argument(
        "--reasoning-field",
        choices=("reasoning_content", "reasoning"),
        default="reasoning_content",
        help="the message field its reasoning goes in (vLLM's and DeepSeek's reasoning_content, or reasoning)",
    )
    parser.add_argument(
        "--orphan-worker",
        action="store_true",
        help="fork a worker into a session of its own, which outlives the server (memory left behind)",
    )
    options = parser.parse_args(argv)
    if options.fault == "exit-at-start":
        sys.stderr.write("toy_server: model file not found (--fault exit-at-start)\n")
        raise SystemExit(2)
    if options.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server = _ToyServer((options.host, options.port), _Handler)
    server.hold_mib = options.hold_mib
    server.weights = _touched(options.hold_mib)
    server.children = []
    server.received = []
    server.streams = []
    server.token_delay_s = options.token_delay_ms / 1000.0
    server.answer_tokens = max(0, options.answer_tokens)
    server.reasoning = options.reasoning
    server.reasoning_field = options.reasoning_field
    if options.orphan_worker:
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        server.children.append(worker.pid)
    server.fault = options.fault
    server.ready_at = time.monotonic() + options.ready_after
    sys.stderr.write(f"toy_server: listening on {options.host}:{options.port}, pid {os.getpid()}\n")
    sys.stderr.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
