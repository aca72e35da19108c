"""The cluster's section (``cluster.*``): the machines a run is placed on and plans are made for; it
validates its own fields."""

from __future__ import annotations

from dataclasses import dataclass

from aligner.config.common import _check, _choice


@dataclass(kw_only=True)
class ClusterConfig:
    """The cluster the run is placed on (and that plans are made for)."""

    address: str = ""  # Ray address; "" = RAY_ADDRESS or a new local instance, "auto" = existing cluster
    num_nodes: int = 1  # nodes
    gpus_per_node: int = 0  # GPUs per node (0 = CPU-only)
    gpu_mem_gb: float = 80.0  # memory per GPU in GiB (2**30 B), as GPUs are sold: an "80 GB" H100 = 80 GiB
    cpus_per_node: int = 0  # CPUs per node; 0 = detect
    placement: str = "split"  # split (each role its own node group) | colocated (roles share bundles)
    gpu_peak_tflops: float = 989.0  # dense bf16 peak per GPU, TFLOP/s (H100 SXM), for plans
    intra_node_gbps: float = 450.0  # NVLink bandwidth per GPU, GB/s, for plans
    inter_node_gbps: float = 50.0  # network bandwidth per GPU, GB/s, for plans
    hbm_gbps: float = 3350.0  # HBM bandwidth per GPU, GB/s (H100 SXM), for plans (decode is bandwidth bound)

    def validate(self, prefix: str = "cluster") -> None:
        _check(self.num_nodes >= 1, f"{prefix}.num_nodes", self.num_nodes, "must be >= 1")
        _check(self.gpus_per_node >= 0, f"{prefix}.gpus_per_node", self.gpus_per_node, "must be >= 0")
        _check(self.gpu_mem_gb > 0, f"{prefix}.gpu_mem_gb", self.gpu_mem_gb, "must be positive")
        _choice(f"{prefix}.placement", self.placement, ("split", "colocated"))
