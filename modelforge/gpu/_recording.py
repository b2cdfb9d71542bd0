"""Simulated devices built from real `nvidia-smi -q -x` recordings, so a simulated card has the
totals, driver-reserved memory and processes of a real one (data/nvidia-smi/)."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu._simulated import ExternalProcess, SimulatedDevice, SimulatedGpuBackend

_UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


@dataclass(frozen=True)
class RecordedGpu:
    device: SimulatedDevice
    # Memory the driver keeps (fb "reserved") and used memory no listed process accounts for:
    # neither is ModelForge's, so both are external to it.
    reserved_bytes: int
    unattributed_bytes: int
    processes: list[ExternalProcess] = field(default_factory=list)
    utilization_pct: float = 0.0
    temperature_c: float = 0.0

    def external(self) -> list[ExternalProcess]:
        index = self.device.index
        extra = [
            ExternalProcess(index, 0, "driver reserved (recorded)", self.reserved_bytes),
            ExternalProcess(index, 1, "unattributed (recorded)", self.unattributed_bytes),
        ]
        return [p for p in extra if p.used_bytes > 0] + self.processes


def _bytes(text: str | None, where: str) -> int:
    value = (text or "").strip()
    if value in ("", "N/A"):
        return 0
    number, _, unit = value.partition(" ")
    try:
        return int(float(number) * _UNITS[unit.strip() or "B"])
    except (KeyError, ValueError):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{where}: cannot read {value!r} as memory") from None


def _number(text: str | None) -> float:
    value = (text or "").strip().split(" ")[0]
    try:
        return float(value)
    except ValueError:
        return 0.0


def load_nvidia_smi(path: Path) -> list[RecordedGpu]:
    """Every GPU of one recording, in file order."""
    try:
        root = ElementTree.parse(path).getroot()
    except FileNotFoundError:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"recording not found: {path}") from None
    except ElementTree.ParseError as error:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{path} is not nvidia-smi XML: {error}") from None
    gpus: list[RecordedGpu] = []
    for index, gpu in enumerate(root.findall("gpu")):
        where = f"{path.name} gpu {index}"
        memory = gpu.find("fb_memory_usage")
        if memory is None:
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{where}: no fb_memory_usage")
        total = _bytes(memory.findtext("total"), where)
        reserved = _bytes(memory.findtext("reserved"), where)
        used = _bytes(memory.findtext("used"), where)
        processes = []
        for info in gpu.findall("processes/process_info"):
            pid = int(_number(info.findtext("pid")))
            name = (info.findtext("process_name") or "").strip()[:200]
            processes.append(
                ExternalProcess(index, pid, f"{name} (recorded)", _bytes(info.findtext("used_memory"), where))
            )
        attributed = sum(p.used_bytes for p in processes)
        minor = gpu.findtext("minor_number")
        device = SimulatedDevice(
            index=int(_number(minor)) if minor and minor.strip() != "N/A" else index,
            uuid=(gpu.findtext("uuid") or f"GPU-recorded-{index}").strip(),
            name=(gpu.findtext("product_name") or "recorded GPU").strip(),
            total_bytes=total,
        )
        gpus.append(
            RecordedGpu(
                device=device,
                reserved_bytes=reserved,
                unattributed_bytes=max(0, used - attributed),
                processes=processes,
                utilization_pct=_number(gpu.findtext("utilization/gpu_util")),
                temperature_c=_number(gpu.findtext("temperature/gpu_temp")),
            )
        )
    if not gpus:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{path}: no <gpu> in the recording")
    return gpus


def backend_from_recording(path: Path) -> SimulatedGpuBackend:
    """A simulated backend whose cards are those of the recording, with its processes (and the
    driver's reserved memory) as unmanaged usage that never goes away."""
    gpus = load_nvidia_smi(path)
    return SimulatedGpuBackend([g.device for g in gpus], [p for g in gpus for p in g.external()])
