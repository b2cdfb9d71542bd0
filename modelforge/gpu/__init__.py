"""GPU observation: a Protocol with the real NVML backend and a simulated one."""

from modelforge.gpu._host import CPU_DEVICE_INDEX, HostMemoryDevice, mem_available_bytes
from modelforge.gpu._node import NodeDevices
from modelforge.gpu._nvml import NvmlGpuBackend
from modelforge.gpu._protocol import DeviceSample, GpuBackend, GpuProcess
from modelforge.gpu._recording import RecordedGpu, backend_from_recording, load_nvidia_smi
from modelforge.gpu._simulated import ExternalProcess, SimulatedDevice, SimulatedGpuBackend

__all__ = [
    "CPU_DEVICE_INDEX",
    "DeviceSample",
    "ExternalProcess",
    "GpuBackend",
    "GpuProcess",
    "HostMemoryDevice",
    "NodeDevices",
    "NvmlGpuBackend",
    "RecordedGpu",
    "SimulatedDevice",
    "SimulatedGpuBackend",
    "backend_from_recording",
    "load_nvidia_smi",
    "mem_available_bytes",
]
