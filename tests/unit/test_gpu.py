"""The GPU backends: the real NVML adapter's code run against a fake `pynvml` at that API's level,
fed by real `nvidia-smi -q -x` recordings, and simulated devices built from those recordings."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu import NvmlGpuBackend, RecordedGpu, backend_from_recording, load_nvidia_smi

RECORDINGS = Path(__file__).resolve().parents[2] / "data" / "nvidia-smi"
MiB = 1024**2


def test_a_recorded_t4_becomes_a_simulated_card_with_its_memory_and_processes() -> None:
    [t4] = load_nvidia_smi(RECORDINGS / "tesla-t4.xml")
    assert (t4.device.name, t4.device.total_bytes) == ("Tesla T4", 15360 * MiB)
    assert t4.device.uuid == "GPU-d37e67a5-91dd-3774-a5cb-99096249601a"
    # fb used 1,032 MiB = processes 22 + 1,005 MiB + 5 MiB no process accounts for.
    assert [(p.pid, p.used_bytes) for p in t4.processes] == [(675, 22 * MiB), (5762, 1005 * MiB)]
    assert (t4.reserved_bytes, t4.unattributed_bytes) == (388 * MiB, 5 * MiB)
    [sample] = backend_from_recording(RECORDINGS / "tesla-t4.xml").sample()
    # Everything on the card is unmanaged to ModelForge: 388 reserved + 1,032 used = 1,420 MiB.
    assert sample.used_bytes == 1420 * MiB
    assert sample.total_bytes == 15360 * MiB


@pytest.mark.parametrize("name", sorted(p.name for p in RECORDINGS.glob("*.xml")))
def test_every_recording_loads_and_samples_within_its_card(name: str) -> None:
    for gpu in load_nvidia_smi(RECORDINGS / name):
        assert gpu.device.total_bytes > 0 and gpu.device.uuid.startswith("GPU-")
    for sample in backend_from_recording(RECORDINGS / name).sample():
        assert 0 < sample.used_bytes < sample.total_bytes


def test_a_file_that_is_not_a_recording_is_refused_with_a_reason(tmp_path: Path) -> None:
    (tmp_path / "x.xml").write_text("<nvidia_smi_log><gpu><uuid>GPU-1</uuid></gpu></nvidia_smi_log>")
    with pytest.raises(ModelForgeError, match="no fb_memory_usage"):
        load_nvidia_smi(tmp_path / "x.xml")
    (tmp_path / "y.xml").write_text("not xml")
    with pytest.raises(ModelForgeError, match="is not nvidia-smi XML"):
        load_nvidia_smi(tmp_path / "y.xml")


class FakeNvml:
    """pynvml's functions over recorded cards; `fail` names a function that raises NVMLError."""

    def __init__(self, gpus: list[RecordedGpu], fail: str = "", fail_with: int = pynvml.NVML_ERROR_GPU_IS_LOST):
        self.gpus = gpus
        self.fail = fail
        self.fail_with = fail_with

    def _check(self, name: str) -> None:
        if name == self.fail:
            raise pynvml.NVMLError(self.fail_with)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def handle(index: int) -> RecordedGpu:
            self._check("nvmlDeviceGetHandleByIndex")
            return self.gpus[index]

        def memory(gpu: RecordedGpu) -> Any:
            self._check("nvmlDeviceGetMemoryInfo")
            used = gpu.reserved_bytes + gpu.unattributed_bytes + sum(p.used_bytes for p in gpu.processes)
            return SimpleNamespace(total=gpu.device.total_bytes, used=used, free=gpu.device.total_bytes - used)

        def compute(gpu: RecordedGpu) -> list[Any]:
            # The same process seen by both getters (a CUDA app drawing too) reports twice.
            return [SimpleNamespace(pid=p.pid, usedGpuMemory=p.used_bytes) for p in gpu.processes[-1:]]

        def graphics(gpu: RecordedGpu) -> list[Any]:
            return [SimpleNamespace(pid=p.pid, usedGpuMemory=p.used_bytes // 2) for p in gpu.processes]

        def utilization(gpu: RecordedGpu) -> Any:
            self._check("nvmlDeviceGetUtilizationRates")
            return SimpleNamespace(gpu=gpu.utilization_pct, memory=0)

        functions = {
            "nvmlInit": lambda: self._check("nvmlInit"),
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: len(self.gpus),
            "nvmlDeviceGetHandleByIndex": handle,
            "nvmlDeviceGetMemoryInfo": memory,
            "nvmlDeviceGetComputeRunningProcesses": compute,
            "nvmlDeviceGetGraphicsRunningProcesses": graphics,
            "nvmlDeviceGetUtilizationRates": utilization,
            "nvmlDeviceGetTemperature": lambda gpu, sensor: gpu.temperature_c,
            "nvmlDeviceGetUUID": lambda gpu: gpu.device.uuid.encode(),
            "nvmlDeviceGetName": lambda gpu: gpu.device.name,
        }
        for name, function in functions.items():
            monkeypatch.setattr(pynvml, name, function)


def test_the_nvml_adapter_reads_a_recorded_card(monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = load_nvidia_smi(RECORDINGS / "tesla-t4.xml")
    FakeNvml(gpus).install(monkeypatch)
    assert NvmlGpuBackend.available()
    [sample] = NvmlGpuBackend().sample()
    assert (sample.uuid, sample.name) == ("GPU-d37e67a5-91dd-3774-a5cb-99096249601a", "Tesla T4")
    assert (sample.total_bytes, sample.used_bytes) == (15360 * MiB, 1420 * MiB)
    assert sample.temperature_c == 40.0
    # Each process once, with the larger of what the compute and graphics lists report.
    assert sorted((p.pid, p.used_bytes) for p in sample.processes) == [(675, 11 * MiB), (5762, 1005 * MiB)]


@pytest.mark.parametrize("failing", ["nvmlDeviceGetHandleByIndex", "nvmlDeviceGetMemoryInfo"])
def test_nvml_errors_become_driver_error(monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    FakeNvml(load_nvidia_smi(RECORDINGS / "tesla-t4.xml"), fail=failing).install(monkeypatch)
    with pytest.raises(ModelForgeError) as error:
        NvmlGpuBackend().sample()
    assert error.value.failure == FailureClass.DRIVER_ERROR
    assert "GPU is lost" in error.value.message


def test_nvml_init_failure_is_a_driver_error_and_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(load_nvidia_smi(RECORDINGS / "tesla-t4.xml"), fail="nvmlInit").install(monkeypatch)
    assert not NvmlGpuBackend.available()
    with pytest.raises(ModelForgeError) as error:
        NvmlGpuBackend()
    assert error.value.failure == FailureClass.DRIVER_ERROR


def test_utilization_unsupported_reads_as_zero_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(
        load_nvidia_smi(RECORDINGS / "rtx-3080-v12.xml"),
        fail="nvmlDeviceGetUtilizationRates",
        fail_with=pynvml.NVML_ERROR_NOT_SUPPORTED,
    )
    fake.install(monkeypatch)
    [sample] = NvmlGpuBackend().sample()
    assert sample.utilization_pct == 0.0 and sample.temperature_c == 31.0
    assert sample.name == "NVIDIA GeForce RTX 3080"
