"""LlamaIndex's own classes against the gateway, run in the venv scripts/test makes for them
(.venv-llamaindex: llama-index-core's `workflows` package shadows this project's). Prints one
JSON object of what each call answered; tests/apps/test_apps.py reads it."""

from __future__ import annotations

import asyncio
import json
import sys


async def main(base_url: str) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.ollama import Ollama
    from llama_index.llms.openai_like import OpenAILike

    seen: dict[str, object] = {}
    # Ollama's class always sends options with temperature (null unless set) and num_ctx.
    ollama = Ollama(model="small-chat", base_url=base_url, request_timeout=60.0)
    answer = await ollama.achat([ChatMessage(role="user", content="hello from llamaindex")])
    seen["ollama_chat"] = answer.message.content
    pieces = [chunk.delta async for chunk in await ollama.astream_chat([ChatMessage(role="user", content="stream me")])]
    seen["ollama_stream"] = "".join(p or "" for p in pieces)
    seen["ollama_complete"] = (await ollama.acomplete("complete me")).text
    # The OpenAI-like class, as users point it at vLLM: temperature and max tokens always sent.
    like = OpenAILike(
        model="small-chat",
        api_base=f"{base_url}/v1",
        api_key="unused",
        is_chat_model=True,
        temperature=0.1,
        max_tokens=64,
        timeout=60.0,
    )
    seen["openai_like_chat"] = (await like.achat([ChatMessage(role="user", content="hello like")])).message.content
    print(json.dumps(seen))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
