"""LiteLLM's own calls against the gateway, in a process of their own (as an application runs
it; LiteLLM's background workers are kept off the test's event loop, which serves the gateway).
Prints one JSON object of what each call answered; tests/apps/test_apps.py reads it."""

from __future__ import annotations

import json
import os
import sys

# LiteLLM fetches its model price map from the internet at import unless told not to.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"


def main(base_url: str) -> None:
    import litellm

    seen: dict[str, object] = {}
    for model in ("ollama/small-chat", "ollama_chat/small-chat", "openai/small-chat"):
        api_base = f"{base_url}/v1" if model.startswith("openai/") else base_url
        answer = litellm.completion(
            model=model,
            messages=[{"role": "user", "content": f"hello via {model}"}],
            api_base=api_base,
            api_key="unused",
            temperature=0.2,
            max_tokens=64,
            timeout=60,
        )
        seen[model] = answer.choices[0].message.content
    embedded = litellm.embedding(model="ollama/all-MiniLM-L6-v2", input=["x"], api_base=base_url, timeout=60)
    seen["embedding"] = len(embedded.data[0]["embedding"])
    print(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1])
