"""The applications people point at an Ollama or OpenAI-compatible server, against the gateway
unchanged: their own client libraries (LangChain's Ollama classes, LiteLLM, LlamaIndex in its own
venv), and Open WebUI's and Continue's request sequences replayed as their source sends them
(neither app runs in CI). Each was failing on its first call before the clients round."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.gateway import GatewayConfig
from tests.gateway.serving import CATALOG, ON_DEMAND_AND_TOY_CHAT, Served, serve, toy_requests
from workers.stack import running_stack

ROOT = Path(__file__).resolve().parents[2]
LLAMAINDEX_PYTHON = ROOT / ".venv-llamaindex" / "bin" / "python"


@pytest.fixture
async def gateway(dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path) -> AsyncIterator[Served]:
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(CATALOG.read_text() + ON_DEMAND_AND_TOY_CHAT)
    async with running_stack(dev_server_env.client, database_url, catalog_path=catalog) as stack:
        async for served in serve(stack, GatewayConfig()):
            yield served


def _ndjson(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def test_open_webui_startup_chat_title_and_embeddings(gateway: Served) -> None:
    """Open WebUI's Ollama connection (backend/open_webui/routers/ollama.py): it lists /api/tags
    and /api/version, offers each `model`, appends `:latest` to a name without a tag, streams
    /api/chat, generates titles with `num_predict` at the body's root, embeds through /api/embed."""
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        tags = (await http.get("/api/tags")).json()["models"]
        assert (await http.get("/api/version")).status_code == 200
        offered = {m["model"] for m in tags}
        assert "small-chat:latest" in offered and "all-MiniLM-L6-v2:latest" in offered
        chat = await http.post(
            "/api/chat",
            json={
                "model": "small-chat:latest",
                "messages": [{"role": "user", "content": "hello from open webui"}],
                "stream": True,
                "options": {"temperature": 0.8, "num_ctx": 2048},
            },
        )
        assert chat.status_code == 200, chat.text
        lines = _ndjson(chat.text)
        assert lines[-1]["done"] is True
        assert "hello from open webui" in "".join(str(line["message"]["content"]) for line in lines)  # type: ignore[index]
        assert chat.headers["x-request-id"]
        title = await http.post(
            "/api/chat",
            json={
                "model": "small-chat:latest",
                "messages": [{"role": "user", "content": "### Task: generate a title"}],
                "stream": False,
                "num_predict": 1000,
                "metadata": {"task": "title_generation"},
            },
        )
        assert title.status_code == 200, title.text
        assert title.json()["done"] is True
        embed = await http.post(
            "/api/embed", json={"model": "all-MiniLM-L6-v2:latest", "input": ["a chunk", "another"]}
        )
        assert embed.status_code == 200, embed.text
        assert len(embed.json()["embeddings"]) == 2
        loaded = {m["model"] for m in (await http.get("/api/ps")).json()["models"]}
        assert "chat.small@1:latest" in loaded


async def test_continue_startup_chat_and_autocomplete(gateway: Served) -> None:
    """Continue's Ollama provider (core/llm/llms/Ollama.ts): /api/show for the template, the
    parameters and the context length; chat and generate with `keep_alive: 1800` and its
    options on every call. Autocomplete (core/autocomplete/generation/CompletionStreamer.ts):
    where the template has `.Suffix`, fill-in-the-middle (`/api/generate` with `prompt` the text
    before the cursor and `suffix` the text after); elsewhere its own FIM tokens in a `raw`
    prompt. Both were refused by name before (every autocomplete failed)."""
    options = {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "num_predict": 1024,
        "stop": ["<|im_end|>"],
        "num_ctx": 8192,
        "num_thread": 8,
        "use_mmap": True,
        "num_gpu": 99,
    }
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=60) as http:
        shown = (await http.post("/api/show", json={"name": "toy-chat"})).json()
        assert shown["model_info"]["subprocess_http.context_length"] == 32768
        assert "num_ctx 32768" in shown["parameters"]
        assert {"tools", "insert"} <= set(shown["capabilities"]) and ".Suffix" in shown["template"]
        chat = await http.post(
            "/api/chat",
            json={
                "model": "toy-chat",
                "messages": [{"role": "system", "content": "You are a coder"}, {"role": "user", "content": "hi"}],
                "options": options,
                "keep_alive": 1800,
                "stream": True,
            },
        )
        assert chat.status_code == 200, chat.text
        assert _ndjson(chat.text)[-1]["done"] is True
        assert "capped" in chat.headers["x-modelforge-keep-alive"]

        # Fill in the middle: the model server's completions route gets the prefix and suffix
        # as they are, Continue's options under the server's names.
        before, after = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
        filled = await http.post(
            "/api/generate",
            json={"model": "toy-chat", "prompt": before, "suffix": after, "options": options, "keep_alive": 1800},
        )
        assert filled.status_code == 200, filled.text
        lines = _ndjson(filled.text)
        assert lines[-1]["done"] is True and len(lines) > 2, "streamed, as Continue reads it"
        middle = "".join(str(line.get("response", "")) for line in lines)
        assert "fills in after" in middle and "print(add(1, 2))" in middle, middle
        [received] = [r for r in await toy_requests("chat.toy@1") if r["path"] == "/v1/completions"]
        sent = received["body"]
        assert (sent["prompt"], sent["suffix"]) == (before, after)
        assert (sent["max_tokens"], sent["stop"], sent["top_k"], sent["stream"]) == (1024, ["<|im_end|>"], 40, True)

        # No `.Suffix` in small-chat's template: Continue sends its own FIM tokens, raw.
        small = (await http.post("/api/show", json={"name": "small-chat"})).json()
        assert ".Suffix" not in small["template"] and "insert" not in small["capabilities"]
        fim = "<|fim_prefix|>def add(a, b):<|fim_suffix|>\n<|fim_middle|>"
        raw = await http.post(
            "/api/generate",
            json={"model": "small-chat", "prompt": fim, "raw": True, "options": options, "keep_alive": 1800},
        )
        assert raw.status_code == 200, raw.text
        assert fim in "".join(str(line.get("response", "")) for line in _ndjson(raw.text)), "the prompt as it is"
        # Raw through the toy server too, not streamed: its completions route, no chat template.
        plain = await http.post(
            "/api/generate", json={"model": "toy-chat", "prompt": fim, "raw": True, "stream": False}
        )
        assert plain.status_code == 200 and "continues" in plain.json()["response"], plain.text
        assert [r["body"]["prompt"] for r in await toy_requests("chat.toy@1") if r["path"] == "/v1/completions"][
            -1
        ] == fim


async def test_langchain_ollama_chat_stream_tools_structured_output_and_embeddings(gateway: Served) -> None:
    done = await _run([sys.executable, str(ROOT / "tests" / "apps" / "langchain_client.py"), gateway.base_url])
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "hello from langchain" in seen["invoke"]
    assert seen["stream_pieces"] > 1 and "stream from langchain" in seen["stream"]
    assert seen["tool_calls"] == ["lookup"] and seen["streamed_tool_calls"] == ["lookup"]
    assert seen["structured"] == {"toy": True, "said": "give me json"}
    assert seen["documents"] == [8, 8] and seen["query"] == 8


async def test_litellm_ollama_ollama_chat_and_openai_models(gateway: Served) -> None:
    done = await _run([sys.executable, str(ROOT / "tests" / "apps" / "litellm_client.py"), gateway.base_url])
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    for model in ("ollama/small-chat", "ollama_chat/small-chat", "openai/small-chat"):
        assert f"hello via {model}" in seen[model], seen
    assert seen["embedding"] == 8


async def test_llamaindex_ollama_and_openai_like(gateway: Served) -> None:
    """LlamaIndex's classes in their own venv (scripts/test makes it): llama-index-core installs a
    top-level `workflows` package, as this project has one."""
    if not LLAMAINDEX_PYTHON.exists():
        pytest.fail(f"{LLAMAINDEX_PYTHON} is missing: ./scripts/test makes it (LlamaIndex in its own venv)")
    client = ROOT / "tests" / "apps" / "llamaindex_client.py"
    done = await _run([str(LLAMAINDEX_PYTHON), str(client), gateway.base_url])
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert "hello from llamaindex" in seen["ollama_chat"]
    assert "stream me" in seen["ollama_stream"]
    assert "complete me" in seen["ollama_complete"]
    assert "hello like" in seen["openai_like_chat"]


async def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    import asyncio

    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd="/",
        env={**os.environ, "PYTHONPATH": ""},
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    return subprocess.CompletedProcess(argv, process.returncode or 0, out.decode(), err.decode())
