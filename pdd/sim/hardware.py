"""The hardware the simulator prices: accelerators, and the line between datacenters.

Figures are public datasheet numbers, rounded; prices are relative, in "GPU A hours"
(GPU A costs 1.0 an hour), because the spec states its cost result that way: GPU B
priced 20-30 % above GPU A. Every figure is printed with each simulated result.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    tflops: float  # dense BF16/FP8 tensor peak per device
    mem_bw_gbs: float  # HBM bandwidth per device, GB/s
    mem_gb: float  # HBM capacity per device, GB
    price_per_hour: float  # in GPU A hours
    note: str = ""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


# GPU A is prefill-friendly (compute per price), GPU B decode-friendly (memory bandwidth
# and capacity): the spec's two clusters.
CATALOG: dict[str, Hardware] = {
    "A": Hardware("A", tflops=989.0, mem_bw_gbs=3350.0, mem_gb=80.0, price_per_hour=1.0,
                  note="H800-class: 989 TFLOPS dense BF16, 3.35 TB/s, 80 GB"),
    "B": Hardware("B", tflops=989.0, mem_bw_gbs=4800.0, mem_gb=141.0, price_per_hour=1.25,
                  note="H200-class: 989 TFLOPS dense BF16, 4.8 TB/s, 141 GB; priced 25 % above A "
                       "(the spec's 20-30 %)"),
}


@dataclass(frozen=True)
class Line:
    """A dedicated line between two datacenters: fair-shared bandwidth, one-way delay."""

    gbps: float
    one_way_ms: float
    price_per_hour: float  # in GPU A hours

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


# A dedicated metro/regional line: the spec's 10-100 Gbit/s, tens to hundreds of times
# RDMA's latency. Priced per Gbit/s: 100 Gbit/s costs as much as 4 GPU A.
LINE_PRICE_PER_GBPS_HOUR = 0.04
LINE_ONE_WAY_MS = 2.0
# Inside a datacenter (P -> RLD, P -> D in one site): RDMA, 8 x 400 Gbit/s per group.
RDMA_GBPS = 3200.0
RDMA_ONE_WAY_MS = 0.01


def line(gbps: float, one_way_ms: float = LINE_ONE_WAY_MS) -> Line:
    return Line(gbps, one_way_ms, gbps * LINE_PRICE_PER_GBPS_HOUR)


def rdma() -> Line:
    return Line(RDMA_GBPS, RDMA_ONE_WAY_MS, 0.0)
