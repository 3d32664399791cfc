"""MetaX GPUs (C500 and kin): Ray's `GPU` (its MetaxGPUAcceleratorManager keeps CUDA_VISIBLE_DEVICES, which MACA
reads), mx-smi for the listing and memory, MCCL. vLLM runs through MetaX's platform plugin (vllm-metax,
VLLM_PLUGINS=metax) or vllm-plugin-FL (VLLM_PLUGINS=fl)."""

from flagscale.devices.base import Collective, DeviceFamily, EngineOnFamily
from flagscale.devices.listing import smi_table

FAMILY = DeviceFamily(
    name="metax",
    title="MetaX GPU",
    ray_resource="GPU",
    ray_manager="MetaxGPUAcceleratorManager",
    visible_env="CUDA_VISIBLE_DEVICES",
    chip_types=frozenset({"maca", "c500", "c550", "c280", "mxc500", "mxc550"}),
    list_argv=("mx-smi",),
    parse_listing=smi_table,
    collective=Collective("MCCL", ("MCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")),
    engines={"vllm": EngineOnFamily("vLLM's MetaX platform plugin", "vllm-metax", {"VLLM_PLUGINS": "metax"})},
    alternatives={
        "vllm": (EngineOnFamily("vllm-plugin-FL (FlagGems, FlagCX)", "vllm-plugin-fl", {"VLLM_PLUGINS": "fl"}),)
    },
    kv_connectors=frozenset(),
)
