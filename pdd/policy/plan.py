"""Which instances serve a request, and the anomaly filter (PDD_SPEC item 5).

The router plans from its mirrors of the instances' caches and their queued work;
P then picks the pipeline from the reservation (`pdd.policy.pipeline`). The anomaly
filter is decided here, before anything is sent to MD, so a filtered request moves
nothing across the line: ultra-long input, short output and a low hit at MD. Such a
request cannot be batched with others and would eat the line for a few tokens; it
runs whole in the prefill datacenter: P prefills it, as any request, and the relay
decodes all of it (no handoff, nothing sent to MD). P, not the relay, prefills it
because a prefill of most of the context would stall every token the relay streams
meanwhile for the length of each of its chunks (the relay's job is to hide latency),
while on P it delays prefills only, as it would in any P/D deployment.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from pdd.names import Fallback, RoleName
from pdd.perf.model import SPEC_CONTEXT
from pdd.policy.routing import Candidate, pick

SPEC_SHORT_OUTPUT = 500  # "ultra-short output (< 500 tokens)"


@dataclass(frozen=True)
class AnomalyRule:
    enabled: bool
    max_output_tokens: int  # max_tokens below this is "short"
    min_prompt_tokens: int  # a prompt this long or longer is "long"
    max_hit_share: float  # a predicted hit at MD at or under this share of the prompt is "low"


def anomaly_rule(
    enabled: bool,
    max_context: int,
    max_output_tokens: int = 0,
    min_prompt_share: float = 0.5,
    max_hit_share: float = 0.5,
) -> AnomalyRule:
    """The spec's rule at this model's scale: "short" is 500 tokens of a 64K context,
    scaled to `max_context` unless `max_output_tokens` is given."""
    short = max_output_tokens or max(1, round(SPEC_SHORT_OUTPUT * max_context / SPEC_CONTEXT))
    return AnomalyRule(enabled, short, max(1, int(min_prompt_share * max_context)), max_hit_share)


def is_anomalous(prompt_tokens: int, max_tokens: int, predicted_hit_tokens: int, rule: AnomalyRule) -> bool:
    return (
        rule.enabled
        and max_tokens < rule.max_output_tokens
        and prompt_tokens >= rule.min_prompt_tokens
        and predicted_hit_tokens <= rule.max_hit_share * prompt_tokens
    )


@dataclass(frozen=True)
class Plan:
    entry: str  # the instance the request is submitted to: prefill (standalone)
    main: str | None  # the main decode instance
    relay: str | None  # the relay
    predicted_hit: int  # at `main`, by the router's mirror
    anomalous: bool = False
    fallback: str | None = None  # a role had no healthy instance, so the plan lacks it


def plan_request(
    prompt_tokens: int,
    max_tokens: int,
    entry: list[Candidate],
    main: list[Candidate],
    relay: list[Candidate],
    rule: AnomalyRule,
    affinity_weight: float = 1.0,
    load_weight: float = 1.0,
) -> Plan:
    """Pick each role's instance (`routing.pick`). `main` empty: a colocated deployment.
    `relay` empty: no relay tier (plain P/D). Raises LookupError when the entry role, or
    every decode-side instance, is down."""

    def choose(cands: list[Candidate]) -> Candidate | None:
        try:
            return pick(cands, prompt_tokens, affinity_weight, load_weight)
        except LookupError:
            return None

    p = choose(entry)
    if p is None:
        raise LookupError("no healthy prefill instance")
    if not main:
        return Plan(p.name, None, None, 0)
    md, rld = choose(main), choose(relay) if relay else None
    if md is None:
        if rld is None:
            raise LookupError("no healthy decode instance")
        # the relay finishes the request alone: counted, never silent
        return Plan(p.name, None, rld.name, 0, fallback=Fallback.NO_MAIN)
    if relay and rld is None:
        return Plan(p.name, md.name, None, md.predicted_hit_tokens, fallback=Fallback.NO_RELAY)
    if rld is not None and is_anomalous(prompt_tokens, max_tokens, md.predicted_hit_tokens, rule):
        return Plan(p.name, None, rld.name, md.predicted_hit_tokens, anomalous=True)
    return Plan(p.name, md.name, rld.name if rld else None, md.predicted_hit_tokens)


def plan_with_room(
    prompt_tokens: int,
    max_tokens: int,
    entry: list[Candidate],
    main: list[Candidate],
    relay: list[Candidate],
    rule: AnomalyRule,
    has_room: Callable[[Candidate], bool],
    affinity_weight: float = 1.0,
    load_weight: float = 1.0,
) -> Plan | None:
    """`plan_request` as the router dispatches (`pdd.policy.capacity`): only onto a
    decode-side instance that has room for the request now (`has_room`), None while
    there is none (the request waits its turn). While MD is up it is never passed by for
    the relay: the request waits for room at MD, and a relay without room only stops
    the anomaly filter from sending it there (a relay behind MD is optional: it turns
    work away itself). Without MD, the relay produces alone and must have room."""

    def roomy(cands: list[Candidate]) -> list[Candidate]:
        return [replace(c, healthy=c.healthy and has_room(c)) for c in cands]

    if any(c.healthy for c in main):
        main = roomy(main)
        if not any(c.healthy for c in main):
            return None
        if not any(c.healthy for c in roomy(relay)):
            rule = replace(rule, enabled=False)
    elif any(c.healthy for c in relay):
        relay = roomy(relay)
        if not any(c.healthy for c in relay):
            return None
    return plan_request(prompt_tokens, max_tokens, entry, main, relay, rule, affinity_weight, load_weight)


def missing_roles(healthy: Mapping[str, int], entry_role: str, disaggregated: bool) -> list[str]:
    """Roles without a healthy instance that every request needs: what `plan_request`
    would refuse a request for (a prefill/standalone entry; in P/D, a decode-side
    instance, main or relay). Empty: the deployment can serve."""
    missing = [] if healthy.get(entry_role, 0) else [entry_role]
    if disaggregated and not (healthy.get(RoleName.MAIN, 0) or healthy.get(RoleName.RELAY, 0)):
        missing.append(RoleName.MAIN)
    return missing
