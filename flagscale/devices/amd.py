"""AMD Instinct GPUs: Ray's `GPU` (its AMDGPUAcceleratorManager sets HIP_VISIBLE_DEVICES), rocm-smi for the listing
and memory, RCCL (which reads NCCL's variables). vLLM, SGLang and llama.cpp have ROCm builds of their own."""

from flagscale.devices.base import Collective, DeviceFamily, EngineOnFamily
from flagscale.devices.listing import rocm_smi_json

FAMILY = DeviceFamily(
    name="amd",
    title="AMD GPU",
    ray_resource="GPU",
    ray_manager="AMDGPUAcceleratorManager",
    visible_env="HIP_VISIBLE_DEVICES",
    chip_types=frozenset({"rocm", "mi210", "mi250", "mi250x", "mi300", "mi300x", "mi308x", "mi325x", "mi355x"}),
    list_argv=("rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json"),
    parse_listing=rocm_smi_json,
    collective=Collective("RCCL", ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")),
    engines={
        "vllm": EngineOnFamily("vLLM's ROCm build"),
        "sglang": EngineOnFamily("SGLang's ROCm build"),
        "llama_cpp": EngineOnFamily("llama.cpp built with HIP"),
    },
    kv_connectors=frozenset({"NixlConnector"}),
)
