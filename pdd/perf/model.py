"""The served model, as the simulator needs it: which weights a step reads, how much
arithmetic a token costs, how many bytes its KV takes.

A mixture-of-experts model is not "its active parameters, read once a step": every
token picks `top_k` of `experts` routed experts per MoE layer, so a step reads the
weights of the experts its batch touches, which grows with the batch. The dense part
(attention projections, shared experts, dense FFN layers, the output head) is read
whole every step. Embedding rows are looked up, not read whole.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

INT4_GROUP32 = 0.5 + 2 / 32  # 4-bit weights with one BF16 scale per 32: what INT4 checkpoints ship
FP8 = 1.0
BF16 = 2.0


@dataclass(frozen=True)
class ModelShape:
    """A model's size and shape, as the step model prices it (not `pdd.config.ModelSpec`,
    which names the checkpoint a deployment serves)."""

    name: str
    layers: int
    moe_layers: int  # layers whose FFN is routed experts (0: a dense model)
    experts: int  # routed experts per MoE layer
    top_k: int  # routed experts per token per MoE layer
    expert_params: float  # one routed expert of one layer
    dense_params: float  # read whole every step
    embedding_params: float  # stored, looked up
    hidden: int  # what an expert-parallel all-to-all moves per token and expert
    expert_bytes_per_param: float
    dense_bytes_per_param: float
    expert_fp8: bool  # expert matmuls at FP8 peak (FP8 weights) or BF16 (4-bit weights dequantized)
    prefill_flops_per_pair: float  # one query token against one context token, all layers (chunks)
    decode_flops_per_pair: float  # the same in decode's form (MLA absorbed into the latent)
    kv_bytes_per_token: float
    max_context: int
    kv_heads: int = 1  # KV heads tensor parallelism splits (MLA's latent: 1, so TP ranks each keep all of it)
    note: str = ""

    @property
    def routed_params(self) -> float:
        return self.moe_layers * self.experts * self.expert_params

    @property
    def total_params(self) -> float:
        return self.dense_params + self.embedding_params + self.routed_params

    @property
    def active_params(self) -> float:
        """Per token: the dense part and `top_k` experts of every MoE layer."""
        return self.dense_params + self.moe_layers * self.top_k * self.expert_params

    @property
    def expert_bytes(self) -> float:
        """All routed experts of one layer."""
        return self.experts * self.expert_params * self.expert_bytes_per_param

    @property
    def dense_bytes(self) -> float:
        """Everything but the routed experts: what data-parallel attention puts on every GPU."""
        return (self.dense_params + self.embedding_params) * self.dense_bytes_per_param

    @property
    def weight_bytes(self) -> float:
        return self.dense_bytes + self.routed_params * self.expert_bytes_per_param

    def with_expert_precision(self, bytes_per_param: float, fp8: bool) -> ModelShape:
        return replace(self, expert_bytes_per_param=bytes_per_param, expert_fp8=fp8)

    def to_dict(self) -> dict[str, object]:
        return asdict(self) | {
            "total_params": self.total_params,
            "active_params": self.active_params,
            "weight_bytes": self.weight_bytes,
        }


def _kimi_k2() -> ModelShape:
    """Kimi K2's published config.json: 61 layers (1 dense, 60 MoE), hidden 7,168, 384
    routed experts of FFN width 2,048 (top 8) plus one shared, MLA with 64 heads
    (q rank 1,536, kv rank 512, rope 64, nope 128, v 128), vocabulary 163,840; 1.03T
    parameters, 32B active. Experts INT4 (as K2-Thinking ships), the rest BF16. KV: the
    spec's 50 KB per token (K2's MLA latent, 576 x 61 values, is 70 KB in BF16, 35 KB
    in FP8)."""
    hidden, layers, heads, vocab = 7168, 61, 64, 163840
    expert = 3 * hidden * 2048
    attention = hidden * 1536 + 1536 * heads * 192 + hidden * (512 + 64) + 512 * heads * 256 + heads * 128 * hidden
    dense = layers * attention + 60 * expert + 3 * hidden * 18432 + vocab * hidden  # + shared experts, FFN 0, head
    return ModelShape(
        "paper-1t",
        layers=layers,
        moe_layers=60,
        experts=384,
        top_k=8,
        expert_params=expert,
        dense_params=dense,
        embedding_params=vocab * hidden,
        hidden=hidden,
        expert_bytes_per_param=INT4_GROUP32,
        dense_bytes_per_param=BF16,
        expert_fp8=False,
        prefill_flops_per_pair=2.0 * layers * heads * (192 + 128),
        decode_flops_per_pair=2.0 * layers * heads * (576 + 512),
        kv_bytes_per_token=50e3,
        max_context=131072,
        note="Kimi-K2-like 1T MoE (384 experts, top 8), INT4 experts, BF16 rest, 50 KB KV/token",
    )


def dense_twin(model: ModelShape) -> ModelShape:
    """A dense model of the same active size: every parameter read by every step."""
    return replace(
        model,
        name=f"{model.name}-dense",
        moe_layers=0,
        experts=0,
        top_k=0,
        dense_params=model.active_params,
        expert_bytes_per_param=model.dense_bytes_per_param,
        note=f"dense, {model.active_params / 1e9:.0f}B (the active size of {model.name})",
    )


MODELS: dict[str, ModelShape] = {"paper-1t": _kimi_k2()}
SPEC_MODEL = "paper-1t"  # the spec's model
SPEC_CONTEXT = 65536  # the spec's evaluation context, which its thresholds are stated for
