"""Device families (flagscale/devices/): each declaration agrees with Ray's accelerator manager for its chip, hostfile
types name families, and the vendor CLIs' listings parse into devices with their memory."""

from __future__ import annotations

import pytest

from flagscale import devices
from flagscale.devices import listing
from flagscale.engines.base import HostShare
from flagscale.engines.vllm import rank_env

NPU_SMI = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc2                 Version: 23.0.rc2                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.6        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3339 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 90.1        41                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3339 / 65536         |
+===========================+===============+====================================================+
"""
ROCM_SMI = (
    '{"card0": {"Card Series": "AMD Instinct MI300X", "VRAM Total Memory (B)": "205822885888", '
    '"VRAM Total Used Memory (B)": "1"}, "card1": {"Card Series": "AMD Instinct MI300X", '
    '"VRAM Total Memory (B)": "205822885888"}}'
)
MX_SMI = """\
| GPU  NAME         PERSISTENCE-M | BUS-ID        DISP.A | MXC-Util   |
| 0    MXC500       Off           | 0000:0f:00.0  Off    | 0%         |
| 43C  58W / 350W   P0            | 858/65536 MiB        |            |
"""


@pytest.mark.parametrize("name", list(devices.FAMILIES))
def test_each_family_agrees_with_rays_manager_for_its_chip(name):
    family = devices.get(name)
    assert family.name == name and family.title
    if family.ray_manager is None:
        assert family.on_cpu and family.visible_env is None
        return
    manager = family.ray_manager_class()
    assert manager.get_resource_name() == family.ray_resource
    assert manager.get_visible_accelerator_ids_env_var() == family.visible_env
    assert family.list_argv and family.parse_listing is not None  # memory comes from the vendor's CLI
    assert family.collective.library != "gloo"


@pytest.mark.parametrize("name", list(devices.FAMILIES))
def test_each_family_says_which_engines_run_on_it_and_with_what(name):
    family = devices.get(name)
    assert "vllm" in family.engines  # every family serves vLLM, through its build or a plugin
    for support in [*family.engines.values(), *(a for alts in family.alternatives.values() for a in alts)]:
        assert support.how
        if "VLLM_PLUGINS" in support.env:
            assert support.package  # a plugin is a package to install


def test_nvidia_keeps_nvlink_multicast_off_on_hosts_of_more_than_one_gpu():
    nvidia = devices.get("nvidia")
    off = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    assert nvidia.process_env(8) == off and nvidia.process_env(1) == {}
    assert devices.get("ascend").process_env(8) == {}


def test_plugins_env_is_the_familys_unless_the_user_chose():
    ascend = devices.get("ascend")
    assert ascend.engine_env("vllm", {}) == {"VLLM_PLUGINS": "ascend"}
    assert ascend.engine_env("vllm", {"VLLM_PLUGINS": "fl"}) == {}  # vllm-plugin-FL, chosen in experiment.envs
    assert devices.get("nvidia").engine_env("vllm", {}) == {}
    assert ascend.visible(["2", "3"]) == {"ASCEND_RT_VISIBLE_DEVICES": "2,3"}
    assert devices.get("cpu").visible(["0"]) == {}


@pytest.mark.parametrize(
    "chip_type, family, model",
    [
        ("gpu", "nvidia", None),
        ("A100", "nvidia", "A100"),
        ("nvidia", "nvidia", None),
        ("ascend", "ascend", None),
        ("npu", "ascend", None),
        ("910B", "ascend", "910B"),
        ("MI300X", "amd", "MI300X"),
        ("C500", "metax", "C500"),
        ("cpu", "cpu", None),
        ("cpu:chipA", "cpu", "chipA"),
        ("ascend:910C", "ascend", "910C"),
    ],
)
def test_hostfile_types_name_a_family(chip_type, family, model):
    found = devices.chip_family(chip_type)
    assert found is not None and (found[0].name, found[1]) == (family, model)


@pytest.mark.parametrize("chip_type", ["chipA", "tpu", "ascnd", "nope:x", "cpu:"])
def test_a_type_naming_no_family_is_none(chip_type):
    assert devices.chip_family(chip_type) is None


def test_vendor_listings_parse_with_memory():
    assert [(d.index, d.name, d.memory_mib) for d in listing.npu_smi_info(NPU_SMI)] == [
        (0, "910B3", 65536),
        (1, "910B3", 65536),
    ]
    assert [(d.index, d.name, d.memory_mib) for d in listing.rocm_smi_json(ROCM_SMI)] == [
        (0, "AMD Instinct MI300X", 196288),
        (1, "AMD Instinct MI300X", 196288),
    ]
    assert [(d.index, d.name, d.memory_mib) for d in listing.smi_table(MX_SMI)] == [(0, "MXC500", 65536)]
    csv = "0, GPU-1234, NVIDIA H100 80GB HBM3, 81559\n"
    assert [(d.index, d.memory_mib, d.uuid) for d in listing.nvidia_smi_csv(csv)] == [(0, 81559, "GPU-1234")]
    assert listing.npu_smi_info("command not found") == [] and listing.rocm_smi_json("oops") == []


def test_list_devices_runs_the_vendor_cli_through_the_caller():
    asked = []

    def run(argv):
        asked.append(argv)
        return NPU_SMI

    assert len(devices.get("ascend").list_devices(run)) == 2 and asked == [["npu-smi", "info"]]
    assert devices.get("ascend").list_devices(lambda argv: None) is None
    assert devices.get("cpu").list_devices(run) is None


def test_ranks_on_npus_see_them_by_the_familys_variable_and_collective():
    ascend = devices.get("ascend")
    share = HostShare(
        "10.0.0.3",
        node_rank=1,
        nnodes=2,
        ranks=(2, 3),
        gpus=("4", "5"),
        interface="eth1",
        visible_env=ascend.visible_env,
        device_resource=ascend.ray_resource,
        interface_env=ascend.collective.interface_env,
    )
    env = rank_env(share)
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "4,5" and "CUDA_VISIBLE_DEVICES" not in env
    assert env["HCCL_SOCKET_IFNAME"] == "eth1" and "NCCL_SOCKET_IFNAME" not in env
