"""Ollama's requests as the applications send them, translated for ModelForge's runtimes: table
tests of modelforge/gateway/_ollama_translate.py (the rules the /api/* routes apply)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from modelforge.domain import Deployment, Residency
from modelforge.gateway._ollama_translate import (
    TranslationError,
    chat_messages,
    keep_alive_decision,
    ollama_message,
    read_options,
    response_format,
    thinking,
)

CHAT = Deployment(capability="chat.small@1", envelope_bytes=1 << 30, context_length=8192)

# What the applications send in `options`, copied from their source.
# LlamaIndex's Ollama LLM (llama_index/llms/ollama/base.py `_model_kwargs`): temperature may be None.
LLAMA_INDEX = {"temperature": None, "num_ctx": 3900}
# LangChain's OllamaEmbeddings (`_default_params`): 13 keys, null unless set.
LANGCHAIN_EMBEDDINGS = dict.fromkeys(
    [
        "mirostat",
        "mirostat_eta",
        "mirostat_tau",
        "num_ctx",
        "num_gpu",
        "num_thread",
        "repeat_last_n",
        "repeat_penalty",
        "temperature",
        "stop",
        "tfs_z",
        "top_k",
        "top_p",
    ]
)
# Continue (core/llm/llms/Ollama.ts `_getModelFileParams`/options): num_ctx and sampling.
CONTINUE = {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "num_predict": 4096, "num_ctx": 8192, "num_thread": 8}


@pytest.mark.parametrize(
    ("options", "sampling", "accepted"),
    [
        (None, {}, ()),
        (LLAMA_INDEX, {}, ("num_ctx",)),
        (LANGCHAIN_EMBEDDINGS, {}, ()),
        (
            CONTINUE,
            {"temperature": 0.5, "top_p": 0.9, "top_k": 40, "max_tokens": 4096},
            ("num_ctx", "num_thread"),
        ),
        ({"repeat_penalty": 1.1, "seed": 7, "min_p": 0.05}, {"repetition_penalty": 1.1, "seed": 7, "min_p": 0.05}, ()),
        ({"num_predict": -1, "stop": []}, {}, ()),
        (
            {"use_mmap": True, "num_gpu": 99, "main_gpu": 0, "num_batch": 512},
            {},
            ("use_mmap", "num_gpu", "main_gpu", "num_batch"),
        ),
        ({"a_future_option": 1}, {}, ("a_future_option",)),
    ],
)
def test_options_the_apps_send_are_read(
    options: dict[str, object], sampling: dict[str, object], accepted: tuple[str, ...]
) -> None:
    read = read_options(options, CHAT, taken=None)
    assert read.sampling == sampling
    assert read.accepted == accepted


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"num_ctx": 16384}, "context length of 8192"),
        ({"num_ctx": 0}, "positive whole number"),
        ({"mirostat": 2}, "options.mirostat"),
        ({"top_p": 3}, "options.top_p"),
        ({"temperature": "hot"}, "options.temperature"),
        ({"stop": [""]}, "options.stop"),
    ],
)
def test_options_that_cannot_be_served_are_refused_by_name(options: dict[str, object], fragment: str) -> None:
    with pytest.raises(TranslationError, match=fragment):
        read_options(options, CHAT, taken=None)


def test_a_runtime_without_sampling_refuses_sampling_but_takes_runner_options() -> None:
    with pytest.raises(TranslationError, match=r"options \(temperature\).*takes no sampling options"):
        read_options({"temperature": 0.2, "num_thread": 4}, CHAT, taken=frozenset())
    with pytest.raises(TranslationError, match=r"options \(repetition_penalty\).*takes only max_tokens, temperature"):
        read_options({"temperature": 0.2, "repeat_penalty": 1.1}, CHAT, taken=frozenset({"temperature", "max_tokens"}))
    assert read_options({"num_thread": 4, "num_ctx": 2048}, CHAT, taken=frozenset()).sampling == {}
    # A context length the catalog does not state is not checked (the server's own applies).
    assert read_options({"num_ctx": 10**6}, replace(CHAT, context_length=0), taken=frozenset()).num_ctx == 10**6


def test_format_and_think_become_openai_parameters() -> None:
    assert response_format("json") == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format(schema)["json_schema"]["schema"] == schema
    assert response_format(None) is None and response_format("") is None
    with pytest.raises(TranslationError, match="format"):
        response_format("yaml")
    assert thinking(True) == {"chat_template_kwargs": {"enable_thinking": True}}
    assert thinking("high") == {"reasoning_effort": "high"}
    assert thinking(None) == {}


def test_tool_turns_become_openai_messages_and_answers_come_back() -> None:
    ollama_turns = [
        {"role": "user", "content": "weather in Paris?", "images": ["aGVsbG8="]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18C", "tool_name": "weather"},
    ]
    out = chat_messages(ollama_turns, rich=True)
    assert out[0]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
    call = out[1]["tool_calls"][0]
    assert call["function"] == {"name": "weather", "arguments": json.dumps({"city": "Paris"})}
    assert out[2] == {"role": "tool", "content": "18C", "tool_call_id": call["id"]}
    with pytest.raises(TranslationError, match=r"messages\[0\]\.images"):
        chat_messages(ollama_turns, rich=False)
    with pytest.raises(TranslationError, match="not a role"):
        chat_messages([{"role": "wizard", "content": "x"}], rich=True)

    answer = {
        "text": "",
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "the user wants weather",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                }
            }
        ],
    }
    message = ollama_message(answer)
    assert message["thinking"] == "the user wants weather"
    assert message["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


KEEP_WARM = Deployment(capability="rag.embedding@1", envelope_bytes=1 << 30, residency=Residency.KEEP_WARM, ttl_s=300)
ALWAYS = replace(KEEP_WARM, residency=Residency.ALWAYS_WARM)
ON_DEMAND = replace(KEEP_WARM, residency=Residency.LOAD_ON_DEMAND)


@pytest.mark.parametrize(
    ("deployment", "asked", "operator", "applied", "unload", "fragment"),
    [
        # A tenant's keep_alive 0 releases its own hold only: production's model stays warm.
        (KEEP_WARM, 0.0, False, 300.0, False, "not unloaded: unloading a model the catalog keeps warm"),
        (KEEP_WARM, 0.0, True, 0.0, True, "as an operator asked"),
        (ALWAYS, 0.0, True, math.inf, False, "modelforge unload"),
        (ALWAYS, 0.0, False, math.inf, False, "operator's action"),
        (ON_DEMAND, 0.0, False, 0.0, False, "unloaded when its last request ends"),
        # Continue's keep_alive 1800 on a 300 s model: capped and said, never an error.
        (KEEP_WARM, 1800.0, False, 300.0, False, "capped"),
        (ON_DEMAND, 60.0, False, 0.0, False, "capped"),
        (KEEP_WARM, 60.0, False, 300.0, False, "at least what was asked"),
        (KEEP_WARM, math.inf, False, 300.0, False, "modelforge pin"),
        (ALWAYS, math.inf, False, math.inf, False, "until evicted"),
    ],
)
def test_keep_alive_is_a_hint_within_the_catalog(
    deployment: Deployment, asked: float, operator: bool, applied: float, unload: bool, fragment: str
) -> None:
    decision = keep_alive_decision(deployment, asked, operator=operator)
    assert decision is not None
    assert (decision.applied_s, decision.unload) == (applied, unload)
    assert fragment in decision.header(), decision.header()
    assert keep_alive_decision(deployment, None, operator=operator) is None
