"""How a group's GPUs sit in Kubernetes pods: one pod per node, holding the GPUs of that node
the group uses, its ranks spawned inside it (NCCL joins them over NVLink and shared memory)
and the pods joined over the network. So a LeaderWorkerSet's `size` counts pods (nodes),
not GPUs: a 16-GPU group on 8-GPU nodes is two pods of 8, a 2-GPU group one pod of 2.

Pure arithmetic: what `tpla plan` suggests for the manifests and what the deploy test holds
the GPU overlays to (k8s/overlays/gpu, k8s/overlays/deepseek-v3).
"""

from __future__ import annotations

from dataclasses import dataclass

# A pod's memory-backed /dev/shm per GPU it holds: NCCL's shared-memory transport (its
# buffers per peer and channel, where peer access is not used) and torch's shared tensors.
SHM_GIB_PER_GPU = 4


class PodLayoutError(ValueError):
    """A group that cannot sit in whole nodes' pods."""


@dataclass(frozen=True)
class PodLayout:
    pods: int  # the LeaderWorkerSet's `size`; each pod is one host of the group (`--node`)
    gpus_per_pod: int  # nvidia.com/gpu of each pod, its ranks (TPLA_TP / pods)

    @property
    def shm_gib(self) -> int:
        """The pod's /dev/shm `sizeLimit` in GiB."""
        return SHM_GIB_PER_GPU * self.gpus_per_pod

    @property
    def size(self) -> int:
        """The group's GPUs: its tp."""
        return self.pods * self.gpus_per_pod


def pod_layout(group_gpus: int, gpus_per_node: int) -> PodLayout:
    """The pods of a group of `group_gpus` ranks on nodes of `gpus_per_node` GPUs: one pod
    when it fits a node, else whole nodes; PodLayoutError when it fills none evenly."""
    if group_gpus < 1 or gpus_per_node < 1:
        raise PodLayoutError("a group and a node each have at least one GPU")
    if group_gpus <= gpus_per_node:
        return PodLayout(1, group_gpus)
    if group_gpus % gpus_per_node:
        raise PodLayoutError(
            f"a group of {group_gpus} GPUs does not fill whole nodes of {gpus_per_node}: "
            "one pod per node needs every pod to hold a node's GPUs"
        )
    return PodLayout(group_gpus // gpus_per_node, gpus_per_node)


def manifest_values(
    tp: int, latent_groups: int, kv_budget_bytes: int, prefill_tp: int, gpus_per_node: int
) -> dict[str, object]:
    """What a plan's group sizes and budget set in the GPU overlay: the ConfigMap's values
    and each LeaderWorkerSet's size and pods (`tpla plan`, docs/deploy.md)."""
    decode, prefill = pod_layout(tp, gpus_per_node), pod_layout(prefill_tp, gpus_per_node)
    return {
        "TPLA_TP": str(tp),
        "TPLA_LATENT_GROUPS": str(latent_groups),
        "TPLA_KV_BUDGET_MB": str(kv_budget_bytes // 2**20),
        "TPLA_PREFILL_TP": str(prefill_tp),
        "decode": _pods(decode),
        "prefill": _pods(prefill),
    }


def _pods(layout: PodLayout) -> dict[str, object]:
    return {
        "size": layout.pods,
        "nvidia.com/gpu": layout.gpus_per_pod,
        "shm_size_limit": f"{layout.shm_gib}Gi",
    }
