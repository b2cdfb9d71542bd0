"""LangChain's Ollama classes against the gateway, in a process of their own as an application
runs them (their HTTP clients are never closed by LangChain, which a test's warnings-as-errors
would report). Prints one JSON object of what each call answered; test_apps.py reads it."""

from __future__ import annotations

import asyncio
import json
import sys


async def main(base_url: str) -> None:
    from langchain_ollama import ChatOllama, OllamaEmbeddings

    seen: dict[str, object] = {}
    chat = ChatOllama(model="small-chat", base_url=base_url, temperature=0)
    seen["invoke"] = str((await chat.ainvoke("hello from langchain")).content)
    pieces = [str(chunk.content) async for chunk in chat.astream("stream from langchain")]
    seen["stream_pieces"] = len(pieces)
    seen["stream"] = "".join(pieces)
    # OllamaEmbeddings sends 13 options, null unless set.
    embeddings = OllamaEmbeddings(model="all-MiniLM-L6-v2", base_url=base_url)
    vectors = await embeddings.aembed_documents(["one chunk", "two chunks"])
    seen["documents"] = [len(v) for v in vectors]
    seen["query"] = len(await embeddings.aembed_query("a query"))
    print(json.dumps(seen))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
