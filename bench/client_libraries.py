"""The apps' client libraries timing the same small chat through the gateway, in a process of their
own, as an application runs them: `bench/serving.py --clients-only` starts this with the gateway's
address and reads one JSON object of per-call seconds from its last line.

Why a process of its own: run on the event loop that also serves the gateway and the workers, a
library call that blocks its loop (LiteLLM's background work, most likely) waits on a server that
cannot answer until the call returns: the first version of this bench never finished. tests/apps
runs LiteLLM in a process of its own for the same reason.

    .venv/bin/python -m bench.client_libraries GATEWAY_URL DIRECT_URL ROUNDS MAX_TOKENS

DIRECT_URL is the model server itself (an OpenAI-compatible one): the OpenAI-protocol libraries are
timed against it too, so a library's own cost (LiteLLM's bookkeeping) is told apart from anything
the gateway does differently for it. LangChain's ChatOllama always streams (`stream: true`), so its
plain counterpart is the `ollama` package streaming the same chat.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

# LiteLLM fetches its model price map from the internet at import unless told not to.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

CALL_TIMEOUT_S = 60.0
MODEL = "toy-chat"


async def main(base_url: str, direct_url: str, rounds: int, max_tokens: int) -> dict[str, list[float]]:
    import litellm
    import ollama
    import openai
    from langchain_ollama import ChatOllama
    from langchain_openai import ChatOpenAI

    said = [{"role": "user", "content": "hello there, tell me about the weather today please"}]
    plain_openai = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )
    plain_ollama = ollama.AsyncClient(host=base_url, timeout=CALL_TIMEOUT_S)
    direct_openai = openai.AsyncOpenAI(
        base_url=f"{direct_url}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )

    def lc_openai_at(url: str) -> ChatOpenAI:
        return ChatOpenAI(
            model=MODEL,
            base_url=f"{url}/v1",
            api_key="unused",  # type: ignore[arg-type]
            max_retries=0,
            timeout=CALL_TIMEOUT_S,
            max_completion_tokens=max_tokens,
        )

    lc_openai, lc_openai_direct = lc_openai_at(base_url), lc_openai_at(direct_url)
    lc_ollama = ChatOllama(
        model=MODEL, base_url=base_url, num_predict=max_tokens, client_kwargs={"timeout": CALL_TIMEOUT_S}
    )

    async def openai_plain(client: openai.AsyncOpenAI) -> None:
        await client.chat.completions.create(model=MODEL, messages=said, max_completion_tokens=max_tokens)  # type: ignore[arg-type]

    async def ollama_plain() -> None:
        await plain_ollama.chat(model=MODEL, messages=said, options={"num_predict": max_tokens})

    async def ollama_streamed() -> None:
        async for _ in await plain_ollama.chat(
            model=MODEL, messages=said, options={"num_predict": max_tokens}, stream=True
        ):
            pass

    async def litellm_call(model: str, api_base: str) -> None:
        await litellm.acompletion(
            model=model,
            messages=said,
            api_base=api_base,
            api_key="unused",
            max_tokens=max_tokens,
            timeout=CALL_TIMEOUT_S,
        )

    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "openai": lambda: openai_plain(plain_openai),
        "LangChain ChatOpenAI": lambda: lc_openai.ainvoke(said[0]["content"]),
        "LiteLLM openai/": lambda: litellm_call(f"openai/{MODEL}", f"{base_url}/v1"),
        "openai, direct": lambda: openai_plain(direct_openai),
        "LangChain ChatOpenAI, direct": lambda: lc_openai_direct.ainvoke(said[0]["content"]),
        "LiteLLM openai/, direct": lambda: litellm_call(f"openai/{MODEL}", f"{direct_url}/v1"),
        "ollama": ollama_plain,
        "ollama, streamed": ollama_streamed,
        "LangChain ChatOllama": lambda: lc_ollama.ainvoke(said[0]["content"]),
        "LiteLLM ollama_chat/": lambda: litellm_call(f"ollama_chat/{MODEL}", base_url),
    }

    async def timed(name: str) -> float:
        started = time.perf_counter()
        try:
            await asyncio.wait_for(calls[name](), CALL_TIMEOUT_S)
        except TimeoutError:
            raise SystemExit(f"{name}: no answer in {CALL_TIMEOUT_S:.0f} s") from None
        return time.perf_counter() - started

    for name in calls:  # warm every path (imports, connection pools)
        for _ in range(3):
            await timed(name)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name in calls:  # interleaved, so a shared machine's drift hits each alike
            times[name].append(await timed(name))
    await plain_openai.close()
    await direct_openai.close()
    return times


if __name__ == "__main__":
    url, direct, rounds_arg, tokens_arg = sys.argv[1:5]
    print(json.dumps(asyncio.run(main(url, direct, int(rounds_arg), int(tokens_arg)))), flush=True)
