"""LangChain's Ollama classes against the gateway, in a process of their own as an application
runs them (their HTTP clients are never closed by LangChain, which a test's warnings-as-errors
would report). Prints one JSON object of what each call answered; test_apps.py reads it."""

from __future__ import annotations

import asyncio
import json
import sys


async def main(base_url: str) -> None:
    from langchain_core.tools import tool
    from langchain_ollama import ChatOllama, OllamaEmbeddings
    from pydantic import BaseModel

    seen: dict[str, object] = {}
    chat = ChatOllama(model="small-chat", base_url=base_url, temperature=0)
    seen["invoke"] = str((await chat.ainvoke("hello from langchain")).content)
    pieces = [str(chunk.content) async for chunk in chat.astream("stream from langchain")]
    seen["stream_pieces"] = len(pieces)
    seen["stream"] = "".join(pieces)

    # An agent's tool round through Ollama's `tools` (the toy server calls a tool the message names).
    @tool
    def lookup(city: str) -> str:
        """Look up the weather of a city."""
        return f"sunny in {city}"

    agent = ChatOllama(model="toy-chat", base_url=base_url, temperature=0).bind_tools([lookup])
    called = await agent.ainvoke("please lookup the weather in Paris")
    seen["tool_calls"] = [call["name"] for call in called.tool_calls]
    streamed = [chunk async for chunk in agent.astream("please lookup the weather in Oslo")]
    seen["streamed_tool_calls"] = [call["name"] for chunk in streamed for call in chunk.tool_calls]

    # with_structured_output: Ollama's `format` with the schema (a JSON-schema response_format).
    class Said(BaseModel):
        toy: bool
        said: str

    structured = ChatOllama(model="toy-chat", base_url=base_url).with_structured_output(Said)
    answer = await structured.ainvoke("give me json")
    seen["structured"] = answer.model_dump() if isinstance(answer, Said) else repr(answer)

    # OllamaEmbeddings sends 13 options, null unless set.
    embeddings = OllamaEmbeddings(model="all-MiniLM-L6-v2", base_url=base_url)
    vectors = await embeddings.aembed_documents(["one chunk", "two chunks"])
    seen["documents"] = [len(v) for v in vectors]
    seen["query"] = len(await embeddings.aembed_query("a query"))
    print(json.dumps(seen))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
