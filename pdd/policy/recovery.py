"""What the router does when an instance of a request fails it: go on, or fail.

The request goes on through what is left wherever that loses nothing the client has
seen: another P before the first token; MD takes over from a lost relay (from the
tokens the client already has); the relay finishes alone when MD or P is lost before
the handoff. Where nothing can produce it any more, it fails with a clear status:
429 when an instance was merely full, 503 when one was lost, 500 otherwise. A pure
function of the request's state, so the router (and a simulator) decide alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pdd.policy.retry import retry_on_new_prefill


class Recovery(StrEnum):
    IGNORE = "ignore"  # the failing instance had nothing left to do for it
    RETRY_PREFILL = "retry_prefill"  # start over on another P (nothing delivered yet)
    RELAY_GOES_ON = "relay_goes_on"  # P or MD is gone before the handoff: the relay finishes it
    MAIN_TAKES_OVER = "main_takes_over"  # the relay is gone: MD produces from what the client has
    FAIL = "fail"


@dataclass(frozen=True)
class Failed:
    """Which of the request's instances failed it, and how."""

    entry: bool  # the instance it was submitted to (P; a relay running it whole)
    relay: bool
    main: bool
    lost: bool  # the instance (or the line to it) is gone: not the request's fault
    busy: bool  # the instance was full


@dataclass(frozen=True)
class State:
    """What the router knows of the request when the failure arrives."""

    p_done: bool  # P reported its transfers over
    delivered: int  # tokens the client has
    attempt: int
    max_attempts: int
    other_entry_up: bool  # another instance of the entry's role could take it
    chosen: bool  # P chose the pipeline
    relay_producing: bool  # the relay produces it (or will), before any handoff
    has_main: bool
    main_done: bool  # MD was already written off for it
    relay_done: bool
    handed_off: bool
    main_produced: bool = False  # MD has delivered tokens: it holds the whole KV


def failure_status(busy: bool, lost: bool) -> int:
    return 429 if busy else 503 if lost else 500


def recover(f: Failed, s: State) -> Recovery:
    if f.entry:
        # P had finished its part, or MD took the request over with the KV it holds (a
        # handoff waits for it), or MD already produces from that KV, before P's result
        # came: a loaded machine delays that result
        if f.lost and (s.p_done or s.handed_off or s.main_produced):
            return Recovery.IGNORE
        if f.lost and retry_on_new_prefill(s.delivered, s.attempt, s.max_attempts, s.other_entry_up):
            return Recovery.RETRY_PREFILL
        # the relay goes on if P had chosen it, MD or not (an MD still waiting for P's KV
        # never gets it); the relay reports a loss itself if P died before its KV was complete
        if s.chosen and s.relay_producing:
            return Recovery.RELAY_GOES_ON
        return Recovery.FAIL
    if f.relay:
        if s.relay_done:
            return Recovery.IGNORE
        return Recovery.MAIN_TAKES_OVER if s.has_main and not s.main_done else Recovery.FAIL
    if f.main:
        if s.main_done:
            return Recovery.IGNORE  # already written off for this request
        return Recovery.RELAY_GOES_ON if s.relay_producing else Recovery.FAIL
    return Recovery.FAIL
