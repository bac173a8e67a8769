"""The hardware the simulator prices: accelerators, and the lines between them.

Every figure is a public datasheet number (the `source` of each chip says which), and
every one is printed with each simulated result. Prices are relative, in "GPU A hours"
(GPU A costs 1.0 an hour), because the spec states its cost result that way: GPU B
priced 20-30 % above GPU A.

The spec's pair is a prefill-friendly A (compute per price) and a decode-friendly B
(memory bandwidth and capacity per price). Of real pairs, NVIDIA's H800 and H200 meet
that premise at the spec's price: at B = 1.25 A, A buys 25 % more FLOPS per price, B
15 % more bandwidth and 41 % more memory per price. The H20 is the classic decode chip,
but at 1.25 A it buys *less* bandwidth per price than an H800 (4.0 / 1.25 < 3.35), so it
is in the catalog for the sensitivity sweep over B's compute, not as the default B.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Chip:
    name: str
    bf16_tflops: float  # dense tensor peak, per device
    fp8_tflops: float  # dense tensor peak, per device
    mem_bw_gbs: float  # HBM bandwidth per device, GB/s
    mem_gb: float  # HBM capacity per device, GB
    scale_up_gbs: float  # NVLink per device, one direction, GB/s
    scale_out_gbs: float  # the node's network per device (8 x 400 Gbit/s per 8 GPUs), GB/s
    price_per_hour: float  # in GPU A hours
    source: str = ""

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


_SCALE_OUT_GBS = 50.0  # one 400 Gbit/s NIC per GPU, the HGX reference design

H800 = Chip(
    "H800",
    bf16_tflops=989.0,
    fp8_tflops=1979.0,
    mem_bw_gbs=3350.0,
    mem_gb=80.0,
    scale_up_gbs=200.0,
    scale_out_gbs=_SCALE_OUT_GBS,
    price_per_hour=1.0,
    source="NVIDIA H800 SXM5 datasheet: 1,979 TFLOPS BF16 / 3,958 FP8 with sparsity (half dense), "
    "80 GB HBM3, 3.35 TB/s, NVLink 400 GB/s",
)
H200 = Chip(
    "H200",
    bf16_tflops=989.0,
    fp8_tflops=1979.0,
    mem_bw_gbs=4800.0,
    mem_gb=141.0,
    scale_up_gbs=450.0,
    scale_out_gbs=_SCALE_OUT_GBS,
    price_per_hour=1.25,
    source="NVIDIA H200 SXM datasheet: 1,979 TFLOPS BF16 / 3,958 FP8 with sparsity (half dense), "
    "141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s; priced 25 % above A (the spec's 20-30 %)",
)
H100 = Chip(
    "H100",
    bf16_tflops=989.0,
    fp8_tflops=1979.0,
    mem_bw_gbs=3350.0,
    mem_gb=80.0,
    scale_up_gbs=450.0,
    scale_out_gbs=_SCALE_OUT_GBS,
    price_per_hour=1.0,
    source="NVIDIA H100 SXM5 datasheet: 1,979 TFLOPS BF16 / 3,958 FP8 with sparsity (half dense), "
    "80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s (the H800's figures but NVLink)",
)
H20 = Chip(
    "H20",
    bf16_tflops=148.0,
    fp8_tflops=296.0,
    mem_bw_gbs=4000.0,
    mem_gb=96.0,
    scale_up_gbs=450.0,
    scale_out_gbs=_SCALE_OUT_GBS,
    price_per_hour=1.25,
    source="NVIDIA H20 product brief: 148 TFLOPS BF16 / 296 FP8 dense, 96 GB HBM3, 4.0 TB/s, NVLink 900 GB/s",
)

# The spec's two clusters: "A" runs P and RLD, "B" runs MD across the line.
CATALOG: dict[str, Chip] = {"A": H800, "B": H200}
CHIPS: dict[str, Chip] = {c.name: c for c in (H800, H100, H200, H20)}


@dataclass(frozen=True)
class Line:
    """A line between two sites: bandwidth, one-way propagation delay and its price.
    What a transfer over it costs beyond that (TCP's ramp, jitter, loss, other traffic)
    is `pdd.lab.sim.line`'s."""

    gbps: float
    one_way_ms: float
    price_per_hour: float  # in GPU A hours

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


# A dedicated inter-city line: the spec's 10-100 Gbit/s. The one-way delay is the one
# the spec's handoff microbenchmark implies for a slow-starting TCP flow (see
# `pdd.lab.sim.tcp.calibrate_one_way_ms`): about 1,000 km of fibre. Priced per Gbit/s:
# 100 Gbit/s costs as much as 4 GPU A.
LINE_PRICE_PER_GBPS_HOUR = 0.04
LINE_ONE_WAY_MS = 10.15
# Inside a datacenter (P -> RLD, P -> D in one site): RDMA, 8 x 400 Gbit/s per group.
RDMA_GBPS = 3200.0
RDMA_ONE_WAY_MS = 0.01


def line(gbps: float, one_way_ms: float = LINE_ONE_WAY_MS) -> Line:
    return Line(gbps, one_way_ms, gbps * LINE_PRICE_PER_GBPS_HOUR)


def rdma() -> Line:
    return Line(RDMA_GBPS, RDMA_ONE_WAY_MS, 0.0)
