"""The GPU backends: the real NVML adapter's code run against a fake `pynvml` at that API's level,
fed by real `nvidia-smi -q -x` recordings, and simulated devices built from those recordings."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from temporalio.testing import ActivityEnvironment

from activities.node import NodeActivities
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

    def __init__(
        self,
        gpus: list[RecordedGpu],
        fail: str = "",
        fail_with: int = pynvml.NVML_ERROR_GPU_IS_LOST,
        nvlinks: list[tuple[int, int]] | None = None,
        ecc: dict[int, int] | None = None,
        xid_events: bool = True,
    ):
        self.gpus = gpus
        self.fail = fail
        self.fail_with = fail_with
        self.nvlinks = {frozenset(pair) for pair in nvlinks or []}
        # None: the card has no ECC (NOT_SUPPORTED), as consumer cards have not.
        self.ecc = ecc or {}
        self.xid_events = xid_events
        self.pending_xids: list[tuple[int, int]] = []  # (device index, xid)

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

        def p2p(first: RecordedGpu, second: RecordedGpu, capability: int) -> int:
            assert capability == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
            pair = frozenset((self.gpus.index(first), self.gpus.index(second)))
            if not self.nvlinks:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return pynvml.NVML_P2P_STATUS_OK if pair in self.nvlinks else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED

        def ecc_errors(gpu: RecordedGpu, error_type: int, counter: int) -> int:
            assert (error_type, counter) == (pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
            index = self.gpus.index(gpu)
            if index not in self.ecc:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return self.ecc[index]

        def register(gpu: RecordedGpu, kinds: int, events: object) -> None:
            if not self.xid_events:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

        def wait(events: object, timeout_ms: int) -> Any:
            if not self.pending_xids:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
            index, xid = self.pending_xids.pop(0)
            return SimpleNamespace(device=self.gpus[index], eventData=xid, eventType=8)

        functions = {
            "nvmlDeviceGetP2PStatus": p2p,
            "nvmlDeviceGetTotalEccErrors": ecc_errors,
            "nvmlEventSetCreate": lambda: object(),
            "nvmlDeviceRegisterEvents": register,
            "nvmlEventSetWait_v2": wait,
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


def eight_a100s() -> list[RecordedGpu]:
    """The recorded A100 eight times over, each with its own index and UUID."""
    [a100] = load_nvidia_smi(RECORDINGS / "a100-sxm4-v12.xml")
    return [replace(a100, device=replace(a100.device, index=n, uuid=f"GPU-a100-{n}")) for n in range(8)]


def test_nvlink_groups_come_from_nvml_peer_to_peer_status(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two NVLink islands of four (0-1-2-3 as a chain, 4-5-6-7 as pairs joined 5-6), no links across.
    links = [(0, 1), (1, 2), (2, 3), (4, 5), (6, 7), (5, 6)]
    FakeNvml(eight_a100s(), nvlinks=links).install(monkeypatch)
    samples = NvmlGpuBackend().sample()
    assert [s.nvlink_group for s in samples] == ["nvlink:GPU-a100-0"] * 4 + ["nvlink:GPU-a100-4"] * 4


def test_cards_without_nvlink_have_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(eight_a100s()[:2]).install(monkeypatch)  # P2P over NVLink: NOT_SUPPORTED
    assert [s.nvlink_group for s in NvmlGpuBackend().sample()] == ["", ""]
    FakeNvml(eight_a100s()[:3], nvlinks=[(0, 1)]).install(monkeypatch)
    assert [s.nvlink_group for s in NvmlGpuBackend().sample()] == ["nvlink:GPU-a100-0"] * 2 + [""]


def test_uncorrected_ecc_errors_make_a_card_unhealthy_and_it_stays_so(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml(eight_a100s()[:2], ecc={0: 0, 1: 0})
    fake.install(monkeypatch)
    backend = NvmlGpuBackend()
    assert [s.healthy for s in backend.sample()] == [True, True]
    fake.ecc[1] = 2
    first, second = backend.sample()
    assert first.healthy and not second.healthy
    assert second.health_reason == "2 uncorrected ECC errors since the driver loaded; reset the card"
    assert not backend.sample()[1].healthy


def test_critical_xids_make_their_card_unhealthy_and_application_xids_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeNvml(eight_a100s()[:3])
    fake.install(monkeypatch)
    backend = NvmlGpuBackend()
    # XID 13 (a kernel's own bad access) on card 0, XID 79 on card 2, then 13 again.
    fake.pending_xids = [(0, 13), (2, 79), (0, 31)]
    samples = backend.sample()
    assert [s.healthy for s in samples] == [True, True, False]
    assert samples[2].health_reason == "XID 79: GPU has fallen off the bus; reset the card"
    assert not backend.sample()[2].healthy  # sticky until the card is reset and the node restarts


def test_cards_that_cannot_report_xids_or_ecc_still_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(load_nvidia_smi(RECORDINGS / "rtx-3080-v12.xml"), xid_events=False).install(monkeypatch)
    [sample] = NvmlGpuBackend().sample()
    assert sample.healthy and sample.nvlink_group == ""


async def test_the_node_advertises_nvml_groups_and_its_configured_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeNvml(eight_a100s()[:4], nvlinks=[(0, 1), (2, 3)]).install(monkeypatch)
    node = NodeActivities("dgx", NvmlGpuBackend(), {}, labels={"rack_id": "r7", "network_bandwidth_gbps": "400"})
    sample = await ActivityEnvironment().run(node.sample_node, "dgx")
    assert [(o.accelerator, o.labels) for o in sample.observations] == [
        (f"dgx/{n}", {"rack_id": "r7", "network_bandwidth_gbps": "400", "nvlink_group_id": group})
        for n, group in enumerate(["nvlink:GPU-a100-0"] * 2 + ["nvlink:GPU-a100-2"] * 2)
    ]
    assert not any(o.simulated for o in sample.observations)
