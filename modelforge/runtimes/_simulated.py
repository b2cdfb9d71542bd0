"""The simulated runtime: takes its deployment's load time, allocates the envelope's bytes on the
simulated device so NVML samples see them, and answers invokes with clearly simulated output:
a chat or completion deployment answers with text (`prompt` or `messages`), any other with an
8-dimension stand-in for an embedding (`text`, or `texts` for several).

Request inputs can steer it: `simulate_invoke_s` holds the lease that long, `simulate_fault`
raises the named failure class, so tests and demos break things on purpose.

It stands in for a real chat server, so it takes what one takes for sampling (the input's
`parameters`: SIMULATED_PARAMETERS) and says in its answer what it was given
(`parameters_applied`, as given). `max_tokens`/`max_completion_tokens` (its tokens are words),
`stop` and `n` shape its answer; `temperature`, `top_p`, `seed`, the penalties and `user` are
taken and reported, and its answer stays deterministic (as a real server's at temperature 0).
Any other parameter is REQUEST_INVALID, named."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from modelforge.domain import Deployment
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu import NodeDevices, SimulatedGpuBackend
from modelforge.runtimes._protocol import Heartbeat, LoadedModel

MAX_SIMULATED_INVOKE_S = 3600.0
_pids = itertools.count(40_000)


def _fault(payload: dict[str, Any]) -> FailureClass | None:
    name = payload.get("simulate_fault")
    if name is None:
        return None
    try:
        return FailureClass(str(name))
    except ValueError as error:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"simulate_fault: unknown class {name!r}") from error


def _checkpointed_seconds(location: str) -> float:
    try:
        saved = json.loads(Path(location.removeprefix("file://")).read_text(encoding="utf-8"))
        return max(0.0, float(saved["done_s"]))
    except (OSError, ValueError, KeyError, TypeError):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"cannot resume from {location!r}") from None


def _hold_seconds(payload: dict[str, Any]) -> float:
    hold = payload.get("simulate_invoke_s", 0)
    if not isinstance(hold, int | float) or isinstance(hold, bool) or not 0 <= hold <= MAX_SIMULATED_INVOKE_S:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID,
            f"simulate_invoke_s must be a number from 0 to {MAX_SIMULATED_INVOKE_S:.0f}",
        )
    return hold  # as given: a progress line says "1/3 s" for 3


def _seconds(deployment: Deployment | None, name: str) -> float:
    try:
        return min(60.0, max(0.0, float((deployment.runtime_config if deployment else {}).get(name, "0"))))
    except ValueError:
        return 0.0


# A deployment whose capability, name or OpenAI model name has one of these parts (`chat.small@1`,
# `inference.chat@1`, `text.completion@2`, `small-chat`) generates text; `runtime_config.simulate_output`
# ("text" or "embedding") says so explicitly where the name does not.
TEXT_GENERATING_PARTS = frozenset({"chat", "completion", "completions", "generate", "generation", "instruct", "llm"})


def generates_text(deployment: Deployment) -> bool:
    """Whether the simulated runtime answers this deployment's invokes with text."""
    declared = deployment.runtime_config.get("simulate_output", "").strip().lower()
    if declared in ("text", "embedding"):
        return declared == "text"
    names = (deployment.capability, deployment.name, *deployment.openai_models)
    return any(
        part.lower() in TEXT_GENERATING_PARTS
        for name in names
        for part in name.split("@", 1)[0].replace("_", ".").replace("-", ".").split(".")
    )


# The request parameters it takes (a chat server's sampling ones), with the range each may hold.
_NUMBERS = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    # vLLM's and llama.cpp's extra sampling parameters (Ollama's top_k, min_p, repeat_penalty...).
    "top_k": (-1.0, 1e6),
    "min_p": (0.0, 1.0),
    "typical_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 10.0),
}
_COUNTS = {"max_tokens": 1, "max_completion_tokens": 1, "n": 1}
MAX_CHOICES = 128
SIMULATED_PARAMETERS = frozenset({*_NUMBERS, *_COUNTS, "stop", "seed", "user"})


def _bad(name: str, why: str) -> ModelForgeError:
    return ModelForgeError(FailureClass.REQUEST_INVALID, f"parameters.{name}: {why}")


def _parameters(payload: dict[str, Any]) -> dict[str, Any]:
    """The input's `parameters` ({} without), checked: REQUEST_INVALID naming one it does not
    take or a value out of range (what a real server would refuse)."""
    given = payload.get("parameters")
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "'parameters' must be an object of name: value")
    unknown = sorted(str(name) for name in given if name not in SIMULATED_PARAMETERS)
    if unknown:
        raise _bad(
            unknown[0][:60],
            f"the simulated runtime does not take it (it takes {', '.join(sorted(SIMULATED_PARAMETERS))})",
        )
    for name, value in given.items():
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if name in _NUMBERS:
            low, high = _NUMBERS[name]
            if not number or not low <= value <= high:
                raise _bad(name, f"must be a number from {low:g} to {high:g}")
        elif name in _COUNTS:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _bad(name, "must be a whole number of at least 1")
            if name == "n" and value > MAX_CHOICES:
                raise _bad(name, f"must be at most {MAX_CHOICES}")
        elif name == "seed" and (not isinstance(value, int) or isinstance(value, bool)):
            raise _bad(name, "must be a whole number")
        elif name == "user" and not isinstance(value, str):
            raise _bad(name, "must be a string")
        elif name == "stop" and not (
            isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value))
        ):
            raise _bad(name, "must be a string or a list of strings")
    return {name: value for name, value in given.items() if value is not None}


def _shaped(text: str, parameters: dict[str, Any]) -> tuple[str, str]:
    """(text, finish_reason) of an answer under `stop` (cut before the first stop string) and
    `max_completion_tokens`/`max_tokens` (at most that many words: "length")."""
    stops = parameters.get("stop")
    found = [text.index(s) for s in ([stops] if isinstance(stops, str) else stops or []) if s and s in text]
    if found:
        text = text[: min(found)]
    limit = parameters.get("max_completion_tokens", parameters.get("max_tokens"))
    words = re.findall(r"\S+\s*", text)
    if isinstance(limit, int) and len(words) > limit:
        return "".join(words[:limit]).rstrip(), "length"
    return text, "stop"


def _said(payload: dict[str, Any]) -> str | None:
    """What a chat or completion request said: its last message's content, or its prompt."""
    messages = payload.get("messages")
    if isinstance(messages, list) and messages:
        last = messages[-1]
        return str(last.get("content", "")) if isinstance(last, dict) else str(last)
    prompt = payload.get("prompt")
    if isinstance(prompt, list):  # OpenAI's completions API takes a list of prompts
        prompt = prompt[-1] if prompt else None
    return None if prompt is None else str(prompt)


def _answer(deployment: str, said: str | None, payload: dict[str, Any]) -> str:
    """A text model's answer: what it was told, and the suffix of a fill-in-the-middle request
    (the text after the cursor, which a real model's answer leads up to)."""
    text = f"[simulated {deployment}] you said: {(said or '')[:200]}"
    suffix = payload.get("suffix")
    if isinstance(suffix, str) and suffix:
        text += f" (to fill in before: {suffix[:80]})"
    return text


def _vector(deployment: str, text: str) -> list[float]:
    """A deterministic 8-dimensional stand-in for an embedding: the same text, the same vector."""
    digest = hashlib.sha256(f"{deployment}:{text}".encode()).digest()
    return [round(b / 255.0 - 0.5, 4) for b in digest[:8]]


class SimulatedRuntime:
    name = "simulated"

    def __init__(self, backend: SimulatedGpuBackend | NodeDevices) -> None:
        self._devices = backend if isinstance(backend, NodeDevices) else NodeDevices(backend)
        self._deployments: dict[str, Deployment] = {}
        self._progress: dict[str, float] = {}  # lease id -> seconds of its invoke done
        self._job_progress: dict[tuple[str, int], float] = {}  # (lease id, rank) -> seconds done
        self._job_pids: set[int] = set()  # the running gang jobs' processes on the simulated cards
        self._invoke_log = os.environ.get("MODELFORGE_SIMULATED_INVOKE_LOG", "")

    def version(self) -> str:
        return "simulated"

    def running_pids(self) -> set[int]:
        """The processes of the running gang jobs: ModelForge's (the node's samples mark them
        managed), so their bytes are never taken for external use."""
        return set(self._job_pids)

    def _log_invoke(self, model: LoadedModel, lease_id: str, began: float) -> None:
        """With MODELFORGE_SIMULATED_INVOKE_LOG set (bench/chaos.py sets it), each invoke appends
        when it really ran on the simulated card, and under which lease: the chaos checker's
        ground truth for "never two holders on one slot", whatever the ledger says."""
        path = self._invoke_log
        if not path:
            return
        line = json.dumps({"key": model.resident_key, "lease_id": lease_id, "start": began, "end": time.time()})
        with open(path, "a", encoding="utf-8") as log:
            log.write(line + "\n")

    async def load(
        self, key: str, deployment: Deployment, device_index: int, device_uuid: str, heartbeat: Heartbeat
    ) -> LoadedModel:
        started = time.monotonic()
        fault = deployment.runtime_config.get("simulate_load_fault")
        remaining = deployment.load_s
        while remaining > 0:
            step = min(1.0, remaining)
            await asyncio.sleep(step)
            remaining -= step
            heartbeat(
                f"loading {deployment.deployment_id}: {deployment.load_s - remaining:.0f}/{deployment.load_s:.0f} s"
            )
        if fault:
            raise ModelForgeError(FailureClass(fault), f"simulated load fault for {deployment.deployment_id}")
        self._deployments[key] = deployment
        pid = next(_pids)
        self._devices.allocate(device_index, pid, deployment.resident_bytes, f"modelforge:{key}")
        return LoadedModel(
            key, deployment.deployment_id, device_index, pid, deployment.resident_bytes, time.monotonic() - started
        )

    async def health_check(self, model: LoadedModel) -> None:
        output = await self.invoke(model, {"text": "health check"}, lambda _: None)
        vector = output.get("embedding") or output.get("text")
        if not vector:
            raise ModelForgeError(FailureClass.HEALTHCHECK_FAILED, "simulated runtime returned nothing")

    async def invoke_stream(
        self, model: LoadedModel, payload: dict[str, Any], heartbeat: Heartbeat
    ) -> AsyncIterator[dict[str, Any]]:
        """The text answer `invoke` gives, a word at a time, spread over `simulate_invoke_s`."""
        deployment = self._deployments.get(model.resident_key)
        if deployment is None or not generates_text(deployment):
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{model.deployment} answers with vectors, not text")
        parameters = _parameters(payload)
        said = _said(payload)
        text, finish = _shaped(_answer(model.deployment, said, payload), parameters)
        choices = int(parameters.get("n", 1))
        pieces = re.findall(r"\S+\s*", text)
        gap = float(_hold_seconds(payload)) / max(1, len(pieces))
        lease_id = str(payload.get("modelforge_lease_id", ""))
        began = time.time()
        try:
            for n, piece in enumerate(pieces):
                await asyncio.sleep(gap)
                heartbeat(f"streaming: {n + 1}/{len(pieces)} pieces")
                if choices == 1:
                    yield {"delta": piece}
                else:  # every choice's piece, by index (and choice 0's text for who reads only it)
                    each = [{"index": i, "delta": {"content": piece}} for i in range(choices)]
                    yield {"choices": each, "delta": piece}
        finally:
            self._log_invoke(model, lease_id, began)
        fault = _fault(payload)
        if fault is not None:
            raise ModelForgeError(fault, f"simulated {fault.value} (requested by simulate_fault)")
        end: dict[str, Any] = {"finish_reason": finish}
        if parameters:
            end["parameters_applied"] = parameters
        yield end

    async def invoke(self, model: LoadedModel, payload: dict[str, Any], heartbeat: Heartbeat) -> dict[str, Any]:
        hold = _hold_seconds(payload)
        parameters = _parameters(payload)
        if "token_ids" in payload:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"token_ids: {model.deployment} (runtime simulated) embeds text only; send 'texts'",
            )
        # A resumed run starts where its checkpoint left off (the node has checked the location).
        resumed_from = payload.get("modelforge_resume_from")
        done = _checkpointed_seconds(resumed_from) if isinstance(resumed_from, str) else 0.0
        done = min(done, float(hold))
        lease_id = str(payload.get("modelforge_lease_id", ""))
        self._progress[lease_id] = done
        began = time.time()
        try:
            while done < hold:
                step = min(1.0, hold - done)
                await asyncio.sleep(step)
                done += step
                self._progress[lease_id] = done
                heartbeat(f"invoking: {done:.0f}/{hold} s")
        finally:
            self._progress.pop(lease_id, None)
            self._log_invoke(model, lease_id, began)
        fault = _fault(payload)
        if fault is not None:
            raise ModelForgeError(fault, f"simulated {fault.value} (requested by simulate_fault)")
        deployment = self._deployments.get(model.resident_key)
        if parameters and deployment is not None and not generates_text(deployment):
            raise _bad(sorted(parameters)[0][:60], f"{model.deployment} answers with vectors and takes no parameters")
        said = _said(payload)
        output: dict[str, Any] = {"simulated": True, "deployment": model.deployment}
        if deployment is not None and generates_text(deployment):
            # A chat or completion model answers with text, never a vector.
            text, finish = _shaped(_answer(model.deployment, said, payload), parameters)
            output["text"] = text
            output["finish_reason"] = finish
            choices = int(parameters.get("n", 1))
            if choices > 1:
                output["choices"] = [
                    {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                    for i in range(choices)
                ]
        else:
            text = str(payload.get("text", payload.get("prompt", "")))
            output["embedding"] = _vector(model.deployment, text)
            if said is not None and isinstance(payload.get("messages"), list):
                output["text"] = f"[simulated {model.deployment}] you said: {said[:200]}"
                output["finish_reason"] = "stop"
        if parameters:
            output["parameters_applied"] = parameters
        if isinstance(resumed_from, str):
            output["resumed_from"] = resumed_from
        texts = payload.get("texts")
        if isinstance(texts, list):
            output["embeddings"] = [_vector(model.deployment, str(t)) for t in texts]
        return output

    async def sleep(self, model: LoadedModel) -> int:
        """As vLLM's level-1 sleep: weights leave the card, a context stays (a tenth, simulated)."""
        asleep = model.measured_bytes // 10
        await asyncio.sleep(_seconds(self._deployments.get(model.resident_key), "simulate_sleep_s"))
        self._devices.free(model.device_index, model.pid, f"modelforge:{model.resident_key}")
        self._devices.allocate(model.device_index, model.pid, asleep, f"modelforge:{model.resident_key}")
        return asleep

    async def wake(self, model: LoadedModel, heartbeat: Heartbeat) -> int:
        await asyncio.sleep(_seconds(self._deployments.get(model.resident_key), "simulate_wake_s"))
        self._devices.free(model.device_index, model.pid, f"modelforge:{model.resident_key}")
        self._devices.allocate(model.device_index, model.pid, model.measured_bytes, f"modelforge:{model.resident_key}")
        return model.measured_bytes

    def supports(self, deployment: Deployment) -> list[str]:
        return ["sleep", "checkpoint"]

    async def run_job(
        self, deployment: Deployment, device_indices: list[int], payload: dict[str, Any], heartbeat: Heartbeat
    ) -> dict[str, Any]:
        """Holds the job's envelope on each device for `simulate_invoke_s`, one process per
        device (as torchrun starts one per GPU)."""
        hold = _hold_seconds(payload)
        lease_id = str(payload.get("modelforge_lease_id", ""))
        tag = f"modelforge:job:{lease_id}"
        # A resumed rank starts where its checkpoint left off (the node has checked the location).
        resumed_from = payload.get("modelforge_resume_from")
        done = min(float(hold), _checkpointed_seconds(resumed_from)) if isinstance(resumed_from, str) else 0.0
        progress = (lease_id, int(payload.get("modelforge_rank", 0)))
        pids: dict[int, int] = {}
        claimed: list[int] = []
        try:
            self._job_progress[progress] = done
            for index in device_indices:
                pid = next(_pids)
                claimed.append(pid)
                self._job_pids.add(pid)  # managed, never external (before its bytes are seen)
                self._devices.allocate(index, pid, deployment.envelope_bytes, tag)
                pids[index] = pid  # allocated: freed below whatever happens next
            while done < hold:
                step = min(1.0, hold - done)
                await asyncio.sleep(step)
                done += step
                self._job_progress[progress] = done
                heartbeat(f"gang job: {done:.0f}/{hold} s on {len(device_indices)} devices")
        finally:
            self._job_progress.pop(progress, None)
            for index, pid in pids.items():
                self._devices.free(index, pid, tag)
            self._job_pids.difference_update(claimed)
        fault = _fault(payload)
        if fault is not None:
            raise ModelForgeError(fault, f"simulated {fault.value} (requested by simulate_fault)")
        output: dict[str, Any] = {
            "simulated": True,
            "deployment": deployment.deployment_id,
            "devices": device_indices,
            "rank": payload.get("modelforge_rank", 0),
        }
        if isinstance(resumed_from, str):
            output["resumed_from"] = resumed_from
        return output

    async def checkpoint_job(self, lease_id: str, rank: int, destination: str) -> str:
        """The seconds of this rank's `simulate_invoke_s` done so far, as JSON."""
        done = self._job_progress.get((lease_id, rank))
        if done is None:
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"no job of lease {lease_id!r} rank {rank} is running")
        return await self._write_checkpoint(Path(destination), done, lease_id)

    async def checkpoint(self, model: LoadedModel, payload: dict[str, Any]) -> str:
        """The seconds of `simulate_invoke_s` done so far, as JSON in the checkpoint store."""
        lease_id = str(payload.get("lease_id", ""))
        if lease_id not in self._progress:
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"no invoke of lease {lease_id!r} is running")
        return await self._write_checkpoint(Path(str(payload["destination"])), self._progress[lease_id], lease_id)

    async def _write_checkpoint(self, destination: Path, done: float, lease_id: str) -> str:
        def write() -> Path:
            destination.mkdir(parents=True, exist_ok=True)
            target = destination / "checkpoint.json"
            target.write_text(json.dumps({"simulated": True, "done_s": done, "lease_id": lease_id}))
            return target

        return str(await asyncio.to_thread(write))

    async def unload(self, model: LoadedModel) -> None:
        self._devices.free(model.device_index, model.pid, f"modelforge:{model.resident_key}")
