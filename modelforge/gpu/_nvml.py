"""The real backend on nvidia-ml-py. NVML errors become DRIVER_ERROR.

Beyond memory and processes it reads what decides whether a card can be trusted and where a
gang may go: NVLink peers (cards joined by NVLink form one `nvlink_group`, computed once at
start: topology does not change while the driver runs), uncorrected ECC errors since the driver
loaded, and critical XID events. A card with either is reported unhealthy with the reason, and
stays so: each of those needs a reset of the card (and a restart of the node worker) to clear."""

from __future__ import annotations

import threading
from typing import Any

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu._protocol import DeviceSample, GpuProcess

# XIDs that mean the card itself is failing (NVIDIA's XID catalogue), not an application fault
# such as 13 or 31 (a kernel's own bad access), which leave the card fine for others.
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvlink_groups(nvml: Any, handles: list[Any], uuids: list[str]) -> list[str]:
    """One group id per device: cards NVLink connects (directly or through others, or through an
    NVSwitch, which NVML reports as peer-to-peer over NVLink) share the id, named after the first
    card's UUID; a card with no NVLink peer has no group ("")."""
    parent = list(range(len(handles)))

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    linked = [False] * len(handles)
    for first in range(len(handles)):
        for second in range(first + 1, len(handles)):
            try:
                status = nvml.nvmlDeviceGetP2PStatus(handles[first], handles[second], nvml.NVML_P2P_CAPS_INDEX_NVLINK)
            except nvml.NVMLError:
                continue  # no NVLink support on this pair: not linked
            if status == nvml.NVML_P2P_STATUS_OK:
                linked[first] = linked[second] = True
                parent[root(second)] = root(first)
    names: dict[int, str] = {}
    for index in range(len(handles)):
        names.setdefault(root(index), f"nvlink:{uuids[index]}")
    return [names[root(index)] if linked[index] else "" for index in range(len(handles))]


class NvmlGpuBackend:
    label = "nvml"

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        self._lock = threading.Lock()
        self._faults: dict[int, str] = {}  # device index -> why it is not to be trusted
        try:
            pynvml.nvmlInit()
            count = int(pynvml.nvmlDeviceGetCount())
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
            self._groups = nvlink_groups(pynvml, handles, uuids)
        except pynvml.NVMLError as error:
            raise ModelForgeError(FailureClass.DRIVER_ERROR, f"NVML at start: {error}") from error
        self._events = self._watch_xids(handles)

    def _watch_xids(self, handles: list[Any]) -> Any:
        """An event set for critical XIDs on every card that supports it (not every one does)."""
        nvml = self._nvml
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError:
            return None
        for handle in handles:
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
            except nvml.NVMLError:
                continue  # NOT_SUPPORTED on this card: its ECC counters still speak for it
        return events

    @property
    def nvlink_groups(self) -> list[str]:
        return list(self._groups)

    @staticmethod
    def available() -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
            count = int(pynvml.nvmlDeviceGetCount())
            pynvml.nvmlShutdown()
            return count > 0
        except Exception:
            return False

    def _drain_xids(self, handles: list[Any]) -> None:
        nvml = self._nvml
        if self._events is None:
            return
        while True:
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError:
                return  # NVML_ERROR_TIMEOUT: nothing pending
            xid = int(event.eventData)
            if xid not in CRITICAL_XIDS:
                continue
            index = next((i for i, h in enumerate(handles) if h == event.device), None)
            if index is not None:
                self._faults.setdefault(index, f"XID {xid}: {CRITICAL_XIDS[xid]}; reset the card")

    def _ecc_fault(self, handle: Any) -> str:
        nvml = self._nvml
        try:
            errors = int(
                nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            )
        except nvml.NVMLError:
            return ""  # no ECC on this card (NOT_SUPPORTED), or ECC disabled
        return f"{errors} uncorrected ECC errors since the driver loaded; reset the card" if errors else ""

    def sample(self) -> list[DeviceSample]:
        nvml = self._nvml
        with self._lock:
            try:
                count = nvml.nvmlDeviceGetCount()
                handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]
                self._drain_xids(handles)
                samples = []
                for index, handle in enumerate(handles):
                    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                    processes: dict[int, GpuProcess] = {}
                    for getter in (
                        nvml.nvmlDeviceGetComputeRunningProcesses,
                        nvml.nvmlDeviceGetGraphicsRunningProcesses,
                    ):
                        for proc in getter(handle):
                            used = int(proc.usedGpuMemory or 0)
                            previous = processes.get(int(proc.pid))
                            processes[int(proc.pid)] = GpuProcess(
                                int(proc.pid), max(used, previous.used_bytes if previous else 0)
                            )
                    # Not every card reports these (NOT_SUPPORTED): each reads as 0 on its own,
                    # never failing the sample.
                    try:
                        utilization = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                    except nvml.NVMLError:
                        utilization = 0.0
                    try:
                        temperature = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
                    except nvml.NVMLError:
                        temperature = 0.0
                    ecc = self._ecc_fault(handle)
                    if ecc:
                        self._faults.setdefault(index, ecc)
                    fault = self._faults.get(index, "")
                    samples.append(
                        DeviceSample(
                            index=index,
                            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                            name=_text(nvml.nvmlDeviceGetName(handle)),
                            total_bytes=int(memory.total),
                            used_bytes=int(memory.used),
                            processes=list(processes.values()),
                            utilization_pct=utilization,
                            temperature_c=temperature,
                            healthy=not fault,
                            health_reason=fault,
                            nvlink_group=self._groups[index] if index < len(self._groups) else "",
                        )
                    )
                return samples
            except nvml.NVMLError as error:
                raise ModelForgeError(FailureClass.DRIVER_ERROR, f"NVML: {error}") from error
