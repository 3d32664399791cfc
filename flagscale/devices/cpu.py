"""CPUs: no accelerator. A replica reserves one core per rank (vLLM's CPU backend, llama.cpp); a hostfile host of
this family declares its slots as a custom resource named by its type, as before families existed."""

from flagscale.devices.base import Collective, DeviceFamily, EngineOnFamily

FAMILY = DeviceFamily(
    name="cpu",
    title="CPU",
    ray_resource=None,
    ray_manager=None,
    visible_env=None,
    chip_types=frozenset({"x86", "x86_64", "arm", "aarch64"}),
    collective=Collective("gloo", ("GLOO_SOCKET_IFNAME",)),
    engines={
        "vllm": EngineOnFamily("vLLM's CPU backend"),
        "llama_cpp": EngineOnFamily("llama.cpp's CPU build"),
    },
    kv_connectors=frozenset({"NixlConnector"}),
)
