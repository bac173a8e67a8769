"""One word per concept: the names every part of pdd shares, as enums.

A leaf module (it imports nothing of pdd): the policies, the wire messages, the
config, the router, the instances, the simulator and the benchmarks all name
pipelines, handoffs, roles, modes and fallbacks from here. The values are what the
config files, the wire, the JSON reports and the metrics' labels carry; a `StrEnum`
member is equal to its value, so a value read from any of them compares as is.
"""

from __future__ import annotations

from enum import StrEnum


class Pipeline(StrEnum):
    """The path a request's KV and tokens take (PDD_SPEC item 4)."""

    P_MD = "P-MD"  # P prefills, MD decodes
    P_RLD_MD = "P-RLD-MD"  # the relay decodes while MD's KV crosses, then hands over
    P_RLD = "P-RLD"  # the relay alone: the anomaly filter's requests, or a counted fallback
    COLOCATED = "colocated"  # one standalone instance does everything (not a PDD pipeline)


PDD_PIPELINES = (Pipeline.P_MD, Pipeline.P_RLD_MD, Pipeline.P_RLD)


class HandoffMode(StrEnum):
    """How a relay hands a request to MD (PDD_SPEC item 3)."""

    ONE_SHOT = "one_shot"
    CATCH_UP = "catch_up"


class RoleName(StrEnum):
    """What an instance does. `main` is the spec's MD (MainDecode), `relay` its RLD."""

    STANDALONE = "standalone"  # prefill and decode, no disaggregation
    PREFILL = "prefill"
    RELAY = "relay"
    MAIN = "main"


# What instances run on: the one meaning of `--hardware` (serve, up, demo) and of
# `hardware =` in the config. native: this machine's speed; emulated: each instance on the
# spec's chip for its role (P, RLD and a standalone on A, MD on B; pd-same-dc all on A);
# A or B: every instance on that chip. An emulated chip paces each step to the time the
# simulator's catalog gives it (`pdd.engines.embedded.pacing`; its chips are `pdd.perf.hardware.CATALOG`).
NATIVE = "native"
EMULATED = "emulated"
CHIPS = ("A", "B")
HARDWARE = (NATIVE, EMULATED, *CHIPS)
HARDWARE_HELP = (
    "what the instances run on: native (this machine's speed); emulated (each on the spec's chip "
    "for its role: P, RLD and a standalone on A, MD on B); A or B (every instance on that chip). "
    "An emulated chip paces each step to its time: real tokens in emulated time"
)


def role_chip(hardware: str, role: str) -> str:
    """The chip an instance of `role` runs on under `hardware` (`native`: none)."""
    if hardware == EMULATED:
        return "B" if role == RoleName.MAIN else "A"
    return hardware


class Mode(StrEnum):
    """How a deployment places its roles."""

    COLOCATED = "colocated"  # one standalone instance
    PD_SAME_DC = "pd-same-dc"  # P and MD in datacenter A
    PD_CROSS_DC = "pd-cross-dc"  # P in A, MD in B, no relay
    PDD = "pdd"  # P and the relay in A, MD in B


def mode_options(mode: str) -> tuple[str, list[tuple[str, str]]]:
    """A demo's mode `MODE[:KEY=VALUE...]` (`pdd demo --modes pd-cross-dc:main=2`): the
    deployment mode, and the `pdd up` options it adds (`--main 2`), in order."""
    base, *options = mode.split(":")
    return base, [(key, value) for key, _, value in (option.partition("=") for option in options)]


class Fallback(StrEnum):
    """Why a request ran other than planned; every one is counted (`pdd_router_fallbacks`)."""

    NO_MAIN = "no_main"  # no MD was up: the relay produced it alone
    NO_RELAY = "no_relay"  # no relay was up: P -> MD
    MAIN_REFUSED = "main_refused"  # MD refused the reservation: the relay produced it alone
    RELAY_BUSY = "relay_busy"  # the relay was loaded: P -> MD, a later first token
    RELAY_LOST = "relay_lost"  # the relay was lost: MD took over from what the client had
    MAIN_LOST = "main_lost"  # MD was lost before the handoff: the relay finished it
    PREFILL_LOST = "prefill_lost"  # P was lost after the relay had its KV: the relay finished it
    PREFILL_RETRY = "prefill_retry"  # P was lost before the first token: retried on another
    RELAY_FINISHED = "relay_finished"  # the relay finished before MD had its KV


# Lossy forms KV may cross the line in (`[line] lossy_kv`; `pdd.kv.codec` writes and reads them)
LOSSY_KV_FORMS = ("int8",)
# Reasoning parsers, as vLLM names them (`[model] reasoning_parser`; `pdd.api.reasoning`)
REASONING_PARSERS = ("qwen3", "deepseek_r1")
# Tool-call parsers, as vLLM names them (`[model] tool_parser`; `pdd.api.tools`)
TOOL_PARSERS = ("hermes",)
# Lossless compressions KV may cross the line in (`[line] compress_kv`; `pdd.kv.codec`)
KV_COMPRESSIONS = ("zstd",)


class AttentionLayout(StrEnum):
    """How a role's attention and its KV cache spread over an instance's GPUs: the names
    serving's config (`attention =`) and the planner (`pdd plan`) share.

    For MLA the difference is memory: under `tp` every tensor-parallel rank keeps the whole
    latent cache (TP 8 holds 8 copies); `tp-dcp` splits it across the ranks by token
    (vLLM's decode context parallelism); `dp-ep` gives each data-parallel rank whole latents
    of its own requests, the experts spread across the group (expert parallelism)."""

    TP = "tp"  # tensor-parallel attention; MLA's latent replicated on every rank
    TP_DCP = "tp-dcp"  # tensor-parallel with decode context parallelism: the latent split by token
    DP_EP = "dp-ep"  # data-parallel attention, expert-parallel MoE: one member per rank
