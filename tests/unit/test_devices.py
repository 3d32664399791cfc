"""CUDA_VISIBLE_DEVICES narrows this machine's GPUs to the ones this process may use, as CUDA and Ray read it."""

from flagscale.devices import Gpu, visible

GPUS = [Gpu(i, "NVIDIA H200", 143771, f"GPU-{i}aa{i}-uuid") for i in range(4)]


def test_unset_leaves_every_gpu():
    assert visible(GPUS, None) == GPUS


def test_indices_pick_those_gpus_in_the_variables_order():
    assert [g.index for g in visible(GPUS, "1")] == [1]
    assert [g.index for g in visible(GPUS, "3,0")] == [3, 0]


def test_uuids_and_their_prefixes_name_gpus_too():
    assert [g.index for g in visible(GPUS, "GPU-2aa2-uuid,GPU-0aa")] == [2, 0]


def test_an_entry_naming_no_gpu_here_ends_the_list_as_in_cuda():
    assert [g.index for g in visible(GPUS, "2,7,1")] == [2]
    assert [g.index for g in visible(GPUS, "1,1,2")] == [1]
    assert visible(GPUS, "") == []
    assert visible(GPUS, "-1") == []
