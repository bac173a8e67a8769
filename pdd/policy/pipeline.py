"""P-MD or P-RLD-MD: whether the main decode instance will have its KV in time.

PDD_SPEC § The architecture, items 4 and 5. High-hit requests, whose small delta
reaches MD quickly, go P -> MD; the rest go P -> RLD -> MD, the relay hiding the
line's latency. P -> RLD alone is never chosen here: it is the anomaly filter's
(`pdd.policy.plan`), or a counted fallback when MD is unusable.

The decision takes the hit MD *reserved* (not the router's estimate): the spec's
production failure was exactly a drift between the two that sent ever more load to
RLD until it fell over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdd.names import Fallback, Pipeline
from pdd.policy.transfer import LineEstimate, finish_s


@dataclass(frozen=True)
class Decision:
    pipeline: Pipeline
    predicted_s: float | None  # when MD's delta was predicted to arrive (None: unknown)
    fallback: Fallback | None = None  # why this is not what the plan asked for


def answer_wait_s(budget_s: float, line: LineEstimate) -> float:
    """How long P waits, after prefill, for MD's reservation before choosing: an answer
    later than this leaves the KV no time to cross within the budget (it still needs
    one trip over the line), so the relay covers the request."""
    return max(0.0, budget_s - line.one_way_s)


def choose_pipeline(
    delta_bytes: int | None,
    line: LineEstimate,
    in_flight: Sequence[int],
    budget_s: float,
    has_relay: bool,
    forced: str = "auto",
) -> Decision:
    """`delta_bytes`: KV MD lacks after its reservation (None: no reservation answer yet).

    P -> MD when that delta, queued behind what is already on the line, is predicted
    to reach MD within `budget_s`; otherwise through the relay. Without a relay there
    is no choice. `forced` ("P-MD" / "P-RLD-MD") pins the answer for experiments.
    """
    predicted = None if delta_bytes is None else finish_s(delta_bytes, in_flight, line)
    if not has_relay:
        return Decision(Pipeline.P_MD, predicted)
    if forced != "auto":
        return Decision(Pipeline(forced), predicted)  # the config allows only P-MD and P-RLD-MD here
    if predicted is not None and predicted <= budget_s:
        return Decision(Pipeline.P_MD, predicted)
    return Decision(Pipeline.P_RLD_MD, predicted)


def relay_refused(decision: Decision) -> Decision:
    """The relay turned the request away (it is loaded, `pdd.policy.capacity`): MD
    produces it, with a later first token, and the relay is not overrun."""
    return Decision(Pipeline.P_MD, decision.predicted_s, Fallback.RELAY_BUSY)


def main_refused(relay_takes: bool) -> Decision | None:
    """MD refused the reservation (an error, not a full pool: that one waits): the relay
    produces the request alone, counted; None when the relay will not take it either,
    and the request fails."""
    return Decision(Pipeline.P_RLD, None, Fallback.MAIN_REFUSED) if relay_takes else None
