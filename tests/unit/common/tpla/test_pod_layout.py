"""One pod per node: a group that fits a node is one pod of its GPUs, a larger one whole
nodes' pods; the LeaderWorkerSet's size counts pods, /dev/shm grows with a pod's GPUs."""

from __future__ import annotations

import pytest

from common.tpla.pod_layout import PodLayout, PodLayoutError, manifest_values, pod_layout


def test_a_group_sits_in_whole_nodes() -> None:
    assert pod_layout(8, 8) == PodLayout(1, 8)
    assert pod_layout(16, 8) == PodLayout(2, 8)
    assert pod_layout(2, 8) == PodLayout(1, 2)
    assert (pod_layout(16, 8).shm_gib, pod_layout(16, 8).size) == (32, 16)
    with pytest.raises(PodLayoutError, match="does not fill whole nodes of 8"):
        pod_layout(12, 8)


def test_manifest_values_of_a_v3_plan() -> None:
    values = manifest_values(8, 2, 38435874041, 16, 8)
    assert values == {
        "TPLA_TP": "8",
        "TPLA_LATENT_GROUPS": "2",
        "TPLA_KV_BUDGET_MB": "36655",
        "TPLA_PREFILL_TP": "16",
        "decode": {"size": 1, "nvidia.com/gpu": 8, "shm_size_limit": "32Gi"},
        "prefill": {"size": 2, "nvidia.com/gpu": 8, "shm_size_limit": "32Gi"},
    }
