"""One record per request, whoever fills it.

The router and a standalone instance fill the part only the server knows (where the
request ran: pipeline, hits, bytes on the line, producers, handoff, fallbacks) and
send it as the `pdd` object of every response; `pdd bench` adds what only a client
sees (its timings) and reads the server's part back from that object; the simulator
fills both. So a live column and a simulated one are the same type, summarised by the
same code (`pdd.lab.bench.summary`).

Times are milliseconds; `start_s` is seconds since the run started (None for a turn
never sent because an earlier turn of its session failed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# The `pdd` object of a response: these fields, by these names (README, "Using it").
SERVED = (
    "pipeline",
    "p_hit_tokens",
    "d_hit_tokens",
    "d_hit_predicted",
    "mirror_drift_tokens",
    "kv_predicted_ms",
    "kv_bytes",
    "line_bytes",
    "relay_output_tokens",
    "main_output_tokens",
    "handoff",
    "handoff_tokens",
    "handoff_chunks",
    "handoff_stall_ms",
    "anomalous",
    "fallbacks",
    "retries",
    "instances",
    "seed",
)


@dataclass
class RequestRecord:
    # ---- who (a benchmark's session and turn) ----
    id: str = ""
    session: int = 0
    turn: int = 0
    planned_anomalous: bool = False  # the workload made it anomalous (long input, short output)
    # ---- what the client saw ----
    start_s: float | None = None
    prompt_tokens: int = 0
    max_tokens: int = 0  # what it asked for at most (0: not recorded)
    output_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    max_itl_ms: float | None = None  # the longest gap between two of its tokens
    cached_tokens: int = 0  # `usage.prompt_tokens_details.cached_tokens`
    error: str | None = None
    # ---- where it ran (the server's `pdd` object) ----
    pipeline: str | None = None
    p_hit_tokens: int = 0  # prompt tokens cached at P
    d_hit_tokens: int = 0  # ... at the decode side, as MD reserved them
    d_hit_predicted: int = 0  # ... as the router's mirror predicted them
    mirror_drift_tokens: int | None = None
    kv_predicted_ms: float | None = None  # when P predicted MD's KV would arrive
    kv_bytes: int = 0  # KV P sent, every path
    line_bytes: int = 0  # ... of which across the line
    relay_output_tokens: int = 0
    main_output_tokens: int = 0
    handoff: str | None = None
    handoff_tokens: int = 0  # tokens the relay handed over by ID
    handoff_chunks: int = 0
    handoff_stall_ms: float | None = None  # MD's extend stall at the handoff
    anomalous: bool = False  # the router's anomaly filter kept it on the relay
    fallbacks: list[str] = field(default_factory=list)  # what it survived, or how it ended off plan (`Fallback`s)
    retries: int = 0
    instances: dict[str, str | None] = field(default_factory=dict)
    seed: int | None = None  # a sampling request's: the client's, or the server's (its answer can be replayed)

    @property
    def completed(self) -> bool:
        return self.error is None

    def served(self) -> dict[str, Any]:
        """The `pdd` object of the response."""
        return {name: getattr(self, name) for name in SERVED}

    def apply_served(self, served: Mapping[str, Any]) -> None:
        """Take the server's part from a response's `pdd` object (keys it lacks keep their
        defaults; unknown ones, from a newer server, are ignored)."""
        for name in SERVED:
            if name in served and served[name] is not None:
                setattr(self, name, served[name])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestRecord:
        """A record from `to_dict` output (a bench JSON file); unknown keys are ignored,
        so files from newer versions still load."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
