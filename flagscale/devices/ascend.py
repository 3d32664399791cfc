"""Huawei Ascend NPUs: Ray's `NPU` (its NPUAcceleratorManager sets ASCEND_RT_VISIBLE_DEVICES from what it
assigned), npu-smi for the listing and memory, HCCL. vLLM runs through its Ascend platform plugin (vllm-ascend,
VLLM_PLUGINS=ascend) or through FlagScale's vllm-plugin-FL (VLLM_PLUGINS=fl); SGLang and llama.cpp are not
declared here."""

from flagscale.devices.base import Collective, DeviceFamily, EngineOnFamily
from flagscale.devices.listing import npu_smi_info

FAMILY = DeviceFamily(
    name="ascend",
    title="Ascend NPU",
    ray_resource="NPU",
    ray_manager="NPUAcceleratorManager",
    visible_env="ASCEND_RT_VISIBLE_DEVICES",
    chip_types=frozenset({"npu", "huawei", "910a", "910b", "910b1", "910b2", "910b3", "910b4", "910c", "310p"})
    | frozenset({"ascend910a", "ascend910b", "ascend910c", "ascend310p", "atlas800", "atlas900"}),
    list_argv=("npu-smi", "info"),
    parse_listing=npu_smi_info,
    collective=Collective("HCCL", ("HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")),
    engines={"vllm": EngineOnFamily("vLLM's Ascend platform plugin", "vllm-ascend", {"VLLM_PLUGINS": "ascend"})},
    alternatives={
        "vllm": (EngineOnFamily("vllm-plugin-FL (FlagGems, FlagCX)", "vllm-plugin-fl", {"VLLM_PLUGINS": "fl"}),)
    },
    kv_connectors=frozenset({"MooncakeConnectorV1", "LLMDataDistCMgrConnector"}),
)
