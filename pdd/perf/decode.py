"""What one instance decodes for its price: the quantity a cross-site split rests on.

PDD puts MD on datacenter B's chips and keeps prefill (and a relay) on A's. It can beat
same-site PD on cost only where B decodes cheaper than A: call ρ the ratio of B's decode
tokens per second per unit of price to A's, each instance at the largest batch whose
step keeps the TPOT target (and that its KV memory and slots hold). With ρ at or below 1,
B's decode costs no less than A's, and PDD, which adds a relay and a line to the same
prefill, cannot win on cost; its edge grows with ρ. `pdd plan` prints it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdd.perf.physics import Physics

BOUNDS = ("tpot", "kv", "slots")  # what stops the batch growing


@dataclass(frozen=True)
class DecodeRate:
    batch: int  # sequences decoding together
    step_s: float  # one decode step of that batch
    tokens_per_s: float
    bound: str  # one of BOUNDS: the TPOT target, the KV memory, or the engine's slots

    def per_price(self, gpus: int, price_per_hour: float) -> float:
        """Tokens per second for each unit of hourly price (GPU A hours per hour)."""
        return self.tokens_per_s / (gpus * price_per_hour)

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def decode_rate(physics: Physics, kv_tokens: int, context: int, tpot_s: float, max_running: int) -> DecodeRate | None:
    """The most tokens per second one instance decodes with every sequence at `context`
    tokens and each step within `tpot_s`: the largest batch that fits, found by bisection
    (a step's time grows with its batch). None where not even one sequence fits."""

    def step_s(batch: int) -> float:
        return float(physics.decode_s(batch * context, batch, 1)[0])

    memory = kv_tokens // context
    most = min(memory, max_running)
    if most < 1 or step_s(1) > tpot_s:
        return None
    low, high = 1, most  # step_s(low) fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if step_s(mid) <= tpot_s else (low, mid - 1)
    bound = "tpot" if low < most else ("kv" if memory <= max_running else "slots")
    s = step_s(low)
    return DecodeRate(low, s, low / s, bound)
