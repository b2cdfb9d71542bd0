"""GPU observation: a Protocol with the real NVML backend and a simulated one."""

from modelforge.gpu._nvml import NvmlGpuBackend
from modelforge.gpu._protocol import DeviceSample, GpuBackend, GpuProcess
from modelforge.gpu._recording import RecordedGpu, backend_from_recording, load_nvidia_smi
from modelforge.gpu._simulated import ExternalProcess, SimulatedDevice, SimulatedGpuBackend

__all__ = [
    "DeviceSample",
    "ExternalProcess",
    "GpuBackend",
    "GpuProcess",
    "NvmlGpuBackend",
    "RecordedGpu",
    "SimulatedDevice",
    "SimulatedGpuBackend",
    "backend_from_recording",
    "load_nvidia_smi",
]
