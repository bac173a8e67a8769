"""A step's time on a group of accelerators, from the physics of what it computes.

A step runs the model's layers one after another, and each part is bound by its own
roofline: the time of its arithmetic at a fraction of peak, or of its memory traffic
at a fraction of bandwidth, whichever is longer; the parts add up.

- Attention layout (`pdd.names.AttentionLayout`): under `tp` and `tp-dcp` the dense
  weights (attention projections, shared experts, dense FFN layers, the output head) are
  sharded; under `dp-ep` (data-parallel attention, as SGLang and vLLM serve
  DeepSeek-class models) every GPU holds and reads its own copy and computes its own
  share of the tokens. The KV cache: `tp` splits it by KV head, so a cache with fewer
  heads than ranks is copied (MLA's latent is one head: every rank keeps all of it, TP 8
  holds 8 copies, and each rank reads its copy); `tp-dcp` splits it by token, `dp-ep`
  by request (each rank whole latents of its own requests): one copy. Dense weights are
  read whole every step: 2 FLOPs per parameter per new token.
- Routed experts: a step reads the experts its batch touches. A token picks `top_k`
  of `experts`, so an expert is touched by a batch of T tokens with probability
  1 - (1 - k/E)^T: a batch of 15 touches 27 % of 384 experts at top 8, a batch of 128
  93 %. Under expert parallelism each GPU holds E/G experts and the step waits for the
  GPU that touched the most (the expected maximum of G binomials: the imbalance term);
  its tokens, likewise, are the most any GPU got (Poisson dispersion) times the
  routing skew left after load balancing. A chunk of a few hundred tokens is thus as
  dear as reading every expert once: a tail chunk's cost does not shrink with it.
- Attention: FLOPs of every (query, context) pair, in prefill's form for chunks and
  in decode's (MLA absorbed into its latent) for one-token steps, against reading
  every context token's KV.
- Expert-parallel all-to-all: dispatch (FP8) and combine (BF16) of every token-expert
  assignment that leaves its GPU, over NVLink within a node, over the network when an
  instance spans nodes; its bytes hide under compute up to `ep_overlap`, its latency
  (two all-to-alls per MoE layer) does not.
- Fixed costs: a launch per step (CUDA graphs), and per chunk (its scheduling,
  page-table and KV-transfer setup), which no batching shares.

`breakdown` gives each part, so every result can say what its steps were bound by.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import numpy as np

from pdd.names import AttentionLayout
from pdd.perf.hardware import Chip
from pdd.perf.model import ModelShape
from pdd.perf.steps import StepLoad

GPUS_PER_NODE = 8
MEMORY_UTILIZATION = 0.9  # of device memory for weights + KV, as serving engines default
MIN_KV_CONTEXTS = 4  # an instance must hold at least this many full contexts beside the weights


@dataclass(frozen=True)
class Efficiency:
    """What fraction of the datasheet a real kernel reaches, and the fixed costs."""

    mfu: float = 0.6  # large GEMMs, of dense tensor peak
    attn_mfu: float = 0.4  # FlashAttention/FlashMLA-class kernels, of BF16 peak
    mbu: float = 0.8  # streaming reads (weights, KV), of HBM bandwidth
    step_overhead_s: float = 0.5e-3  # one launch of the step's graph, sampling
    chunk_overhead_s: float = 1.0e-3  # per prefill/extend chunk: scheduling, pages, KV-transfer setup
    a2a_latency_up_s: float = 20e-6  # one all-to-all inside a node (NVLink)
    a2a_latency_out_s: float = 60e-6  # one all-to-all across nodes (RDMA)
    ep_overlap: float = 1.0  # share of the compute time under which all-to-all bytes hide
    routing_skew: float = 1.1  # hottest GPU's expert tokens over the mean, after load balancing
    # the dense, expert and attention parts' times x these: 1, the roofline as is; else fitted to a
    # measurement of the chip and model (`pdd.lab.plan.measured`)
    scale: tuple[float, float, float] = (1.0, 1.0, 1.0)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@lru_cache(maxsize=65536)
def touched_max(experts: int, top_k: int, gpus: int, tokens: int) -> float:
    """Expected number of distinct experts the most-touched of `gpus` GPUs (each
    holding experts / gpus of them) reads, for a batch of `tokens` routed uniformly:
    E[max of gpus iid Binomial(m, q)], q = 1 - (1 - k/E)^tokens."""
    if tokens <= 0 or experts == 0:
        return 0.0
    m = max(1, experts // gpus)
    q = 1.0 - (1.0 - top_k / experts) ** tokens
    if q >= 1.0 - 1e-12:
        return float(m)
    if gpus == 1:
        return m * q
    pmf = [math.comb(m, j) * q**j * (1 - q) ** (m - j) for j in range(m + 1)]
    cdf, expected = 0.0, 0.0
    for j in range(m):
        cdf += pmf[j]
        expected += 1.0 - cdf**gpus
    return expected


@dataclass(frozen=True)
class Physics:
    """`gpus` devices of `chip` serving `model`, attention laid out as `attention`, the
    MoE expert-parallel across all `gpus` (the EP size is the instance's)."""

    chip: Chip
    model: ModelShape
    gpus: int
    eff: Efficiency = Efficiency()
    attention: AttentionLayout = AttentionLayout.TP_DCP  # the paper setting's (`pdd.lab.plan.paper.Setting`)
    # decode_s's per-batch-size costs (not a field: a cache)
    _decode_batch: dict[int, tuple[float, float, float]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def _peak(self, fp8: bool) -> float:
        return (self.chip.fp8_tflops if fp8 else self.chip.bf16_tflops) * 1e12

    def _batch(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """What a step's new tokens cost whatever their context: dense weights, routed
        experts, the all-to-all's bytes (seconds each) and its latency."""
        m, e, g = self.model, self.eff, self.gpus
        bw = self.chip.mem_bw_gbs * 1e9 * e.mbu  # one GPU's
        bf16 = self._peak(False) * e.mfu
        copies = dense_copies(self.attention, g)  # each GPU reads the dense weights it holds
        dense = e.scale[0] * np.maximum(
            2.0 * m.dense_params * tokens / (g * bf16), copies * m.dense_params * m.dense_bytes_per_param / (g * bw)
        )
        experts = np.zeros_like(tokens)
        comm = np.zeros_like(tokens)
        if m.moe_layers:
            flat = tokens.reshape(-1)
            if (flat == flat[0]).all():  # a stretch, or one step: one batch size
                touched = np.full_like(tokens, touched_max(m.experts, m.top_k, g, int(flat[0])))
            else:
                touched = np.array([touched_max(m.experts, m.top_k, g, int(t)) for t in flat]).reshape(tokens.shape)
            weights = touched * m.expert_params * m.expert_bytes_per_param / bw
            per_gpu = tokens * m.top_k / g
            hottest = e.routing_skew * (per_gpu + np.sqrt(2.0 * per_gpu * math.log(g))) if g > 1 else per_gpu
            compute = 2.0 * m.expert_params * hottest / (self._peak(m.expert_fp8) * e.mfu)
            experts = m.moe_layers * np.maximum(compute, weights) * e.scale[1]
            if g > 1:
                fabric_bytes_per_s = (self.chip.scale_up_gbs if g <= GPUS_PER_NODE else self.chip.scale_out_gbs) * 1e9
                comm = m.moe_layers * per_gpu * (g - 1) / g * 3.0 * m.hidden / fabric_bytes_per_s  # FP8 out, BF16 back
        latency = 0.0
        if m.moe_layers and g > 1:
            latency = 2 * m.moe_layers * (e.a2a_latency_up_s if g <= GPUS_PER_NODE else e.a2a_latency_out_s)
        return dense, experts, comm, latency

    def _attention(self, flops: np.ndarray, kv_tokens: np.ndarray) -> np.ndarray:
        """Attention's FLOPs against reading its KV (`kv_tokens`: read and written)."""
        g, e = self.gpus, self.eff
        bw = self.chip.mem_bw_gbs * 1e9 * e.mbu
        kv = self.model.kv_bytes_per_token * kv_tokens * kv_copies(self.attention, self.model, g)
        return e.scale[2] * np.maximum(flops / (g * self._peak(False) * e.attn_mfu), kv / (g * bw))

    def parts(self, load: StepLoad) -> dict[str, np.ndarray | float]:
        """Seconds of each part of a step (fields of `load` may be arrays)."""
        m, e = self.model, self.eff
        tokens = np.asarray(load.new_tokens, dtype=float)
        dense, experts, comm, latency = self._batch(tokens)
        decode_pairs = np.asarray(load.attn_pairs, dtype=float) - np.asarray(load.chunk_pairs, dtype=float)
        flops = (
            m.prefill_flops_per_pair * np.asarray(load.chunk_pairs, dtype=float)
            + m.decode_flops_per_pair * decode_pairs
        )
        attention = self._attention(flops, np.asarray(load.kv_read_tokens, dtype=float) + tokens)
        compute_s = dense + experts + attention
        fixed = e.step_overhead_s + e.chunk_overhead_s * np.asarray(load.chunks, dtype=float)
        return {
            "dense": dense,
            "experts": experts,
            "attention": attention,
            "all_to_all": np.maximum(0.0, comm - e.ep_overlap * compute_s) + latency,
            "fixed": fixed,
        }

    def decode_s(self, contexts_sum: int, seqs: int, steps: int) -> np.ndarray:
        """`steps_s` of a decode stretch, with what does not depend on the context priced
        once per batch size: the same arithmetic, so the same bits (a decode load has no
        chunks, and its pairs are its KV reads)."""
        batch = self._decode_batch.get(seqs)
        if batch is None:
            dense, experts, comm, latency = self._batch(np.full(1, float(seqs)))
            batch = self._decode_batch[seqs] = (float((dense + experts)[0]), float(comm[0]), latency)
        before, comm_s, latency = batch
        e = self.eff
        kv = (contexts_sum + seqs * np.arange(1, steps + 1, dtype=np.int64)).astype(float)
        compute_s = before + self._attention(self.model.decode_flops_per_pair * kv, kv + float(seqs))
        return compute_s + (np.maximum(0.0, comm_s - e.ep_overlap * compute_s) + latency) + e.step_overhead_s

    def steps_s(self, load: StepLoad) -> np.ndarray:
        p = self.parts(load)
        return np.asarray(p["dense"] + p["experts"] + p["attention"] + p["all_to_all"] + p["fixed"], dtype=float)

    def step_s(self, load: StepLoad) -> float:
        if not np.any(np.asarray(load.seqs)):
            return 0.0
        return float(self.steps_s(load))

    def describe(self) -> dict[str, object]:
        return {
            "chip": self.chip.to_dict(),
            "gpus": self.gpus,
            "efficiency": self.eff.to_dict(),
            "model": self.model.name,
            "attention": str(self.attention),
        }


def dense_copies(attention: AttentionLayout, gpus: int) -> int:
    """Copies of the dense weights an instance of `gpus` holds: one a GPU under `dp-ep`."""
    return gpus if attention == AttentionLayout.DP_EP else 1


def kv_copies(attention: AttentionLayout, model: ModelShape, gpus: int) -> float:
    """Copies of each token's KV an instance keeps (and its GPUs read): under `tp`, one per
    rank beyond the model's KV heads (MLA: every rank); under `tp-dcp` and `dp-ep`, one."""
    if attention == AttentionLayout.TP:
        return max(1.0, gpus / model.kv_heads)
    return 1.0


def kv_capacity_tokens(
    chip: Chip, model: ModelShape, gpus: int, memory_utilization: float, attention: AttentionLayout
) -> int:
    """KV tokens one instance of `gpus` chips holds: its memory, less the weights (negative:
    they do not fit), over the copies its layout keeps of each token. Under `dp-ep` the
    dense weights are on every GPU: 23 GB each for the spec's model, where sharded they
    are 1.4 GB on 16; under `tp` MLA's latent is on every rank."""
    copies = dense_copies(attention, gpus)
    room = gpus * chip.mem_gb * 1e9 * memory_utilization - model.weight_bytes - (copies - 1) * model.dense_bytes
    return int(room / (model.kv_bytes_per_token * kv_copies(attention, model, gpus)))


NODES = (1, 2, 4)  # the instance sizes searched, in nodes of GPUS_PER_NODE


def instance_sizes(
    chip: Chip, model: ModelShape, memory_utilization: float, contexts: int, context: int, attention: AttentionLayout
) -> list[int]:
    """Instance sizes in GPUs (whole nodes, up to 4) whose memory holds the weights and
    `contexts` full contexts of `context` tokens, smallest first."""
    sizes = [nodes * GPUS_PER_NODE for nodes in NODES]
    return [g for g in sizes if kv_capacity_tokens(chip, model, g, memory_utilization, attention) >= contexts * context]


def instance_gpus(
    chip: Chip, model: ModelShape, memory_utilization: float, contexts: int, context: int, attention: AttentionLayout
) -> int | None:
    """The smallest of `instance_sizes` (None: not even 4 nodes hold the model)."""
    sizes = instance_sizes(chip, model, memory_utilization, contexts, context, attention)
    return sizes[0] if sizes else None
