"""The decision functions of pdd/policy, on plain data."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdd.names import Fallback, Pipeline
from pdd.policy.capacity import Room, fits, pages_needed, relay_accepts
from pdd.policy.handoff import MAX_CATCH_UP_ROUNDS, choose_handoff, cut_over, occupancy
from pdd.policy.pipeline import Decision, answer_wait_s, choose_pipeline, main_refused, relay_refused
from pdd.policy.plan import anomaly_rule, is_anomalous, plan_request
from pdd.policy.playout import Playout, next_release_s, observe_pace, release
from pdd.policy.prefix import common_prefix, prefix_holder
from pdd.policy.recovery import Failed, Recovery, State, failure_status, recover
from pdd.policy.retry import reserve_retry_delay, retry_on_new_prefill
from pdd.policy.routing import Candidate
from pdd.policy.transfer import (
    LineEstimate,
    LineMeter,
    Priority,
    finish_s,
    kv_chunks,
    kv_range,
    observe_rate,
    observe_rtt,
)

LINE = LineEstimate(bytes_per_s=2_500_000, one_way_s=0.02)  # 20 Mbit/s, 20 ms


def test_transfer_time_shares_the_line_fairly():
    assert finish_s(250_000, [], LINE) == pytest.approx(0.02 + 0.1)
    # a big transfer ahead delays a small one by the small one's size, not its own
    assert finish_s(250_000, [10_000_000], LINE) == pytest.approx(0.02 + 0.2)
    assert finish_s(250_000, [50_000, 10_000_000], LINE) == pytest.approx(0.02 + 0.22)


def test_line_estimates_trust_the_fastest_round_trip_and_average_rates():
    est = observe_rtt(LINE, 0.030)  # a quicker round trip is believed at once
    assert est.one_way_s == pytest.approx(0.015)
    slower = observe_rtt(est, 0.5)  # a slow one (the far side was busy) only nudges it
    assert 0.015 < slower.one_way_s < 0.05
    assert observe_rate(LINE, 1_000_000, 1.0).bytes_per_s == pytest.approx(0.7 * 2_500_000 + 0.3 * 1_000_000)
    assert observe_rate(LINE, 0, 1.0) == LINE


def test_kv_range_and_chunks():
    assert kv_range(300, 288) == (288, 300)
    with pytest.raises(ValueError):
        kv_range(300, 300)  # a reservation always leaves the last token to send
    assert kv_chunks(288, 600, 128) == [(288, 416), (416, 544), (544, 600)]
    assert kv_chunks(0, 0, 64) == []


def test_pipeline_follows_the_reserved_delta_and_the_budget():
    small, large = 100 * 4096, 2000 * 4096
    assert choose_pipeline(small, LINE, [], 0.2, has_relay=True).pipeline == "P-MD"
    assert choose_pipeline(large, LINE, [], 0.2, has_relay=True).pipeline == "P-RLD-MD"
    # a small delta behind a congested line is late too
    assert choose_pipeline(small, LINE, [5_000_000] * 3, 0.2, has_relay=True).pipeline == "P-RLD-MD"
    # no reservation answer in time: the relay covers
    d = choose_pipeline(None, LINE, [], 0.2, has_relay=True)
    assert (d.pipeline, d.predicted_s) == ("P-RLD-MD", None)
    # without a relay there is no choice; a forced pipeline is obeyed
    assert choose_pipeline(large, LINE, [], 0.2, has_relay=False).pipeline == "P-MD"
    assert choose_pipeline(small, LINE, [], 0.2, has_relay=True, forced="P-RLD-MD").pipeline == "P-RLD-MD"
    assert choose_pipeline(large, LINE, [], 0.2, has_relay=True, forced="P-MD").pipeline == "P-MD"


def test_p_waits_for_the_reservation_only_while_the_kv_could_still_be_in_time():
    assert answer_wait_s(0.06, LINE) == pytest.approx(0.04)  # 60 ms budget, 20 ms line
    assert answer_wait_s(0.01, LINE) == 0.0


def test_anomaly_rule_scales_the_spec_to_the_model():
    rule = anomaly_rule(True, max_context=4096)
    assert rule.max_output_tokens == 31  # 500 of 65,536, at 4,096
    assert rule.min_prompt_tokens == 2048
    assert is_anomalous(3000, 4, 0, rule)
    assert not is_anomalous(3000, 64, 0, rule)  # output not short
    assert not is_anomalous(1000, 4, 0, rule)  # input not long
    assert not is_anomalous(3000, 4, 2900, rule)  # hit not low
    assert not is_anomalous(3000, 4, 0, anomaly_rule(False, 4096))
    assert anomaly_rule(True, 4096, max_output_tokens=100).max_output_tokens == 100


def _cands(*names: str, healthy: bool = True, hit: int = 0) -> list[Candidate]:
    return [Candidate(n, hit, 0, healthy) for n in names]


def test_plan_picks_roles_and_never_plans_relay_alone_unless_filtered():
    rule = anomaly_rule(True, 4096)
    plan = plan_request(500, 200, _cands("p0"), _cands("md0", hit=480), _cands("rld0"), rule)
    assert (plan.entry, plan.relay, plan.main, plan.predicted_hit, plan.anomalous) == ("p0", "rld0", "md0", 480, False)
    filtered = plan_request(3000, 4, _cands("p0"), _cands("md0"), _cands("rld0"), rule)
    assert (filtered.entry, filtered.main, filtered.relay, filtered.anomalous) == ("p0", None, "rld0", True)
    # the same request without a relay tier (plain P/D) is not filtered
    assert plan_request(3000, 4, _cands("p0"), _cands("md0"), [], rule).main == "md0"
    assert plan_request(300, 4, _cands("p0"), [], [], rule).main is None  # colocated
    no_relay = plan_request(500, 200, _cands("p0"), _cands("md0"), _cands("rld0", healthy=False), rule)
    assert (no_relay.relay, no_relay.fallback) == (None, "no_relay")
    no_main = plan_request(500, 200, _cands("p0"), _cands("md0", healthy=False), _cands("rld0"), rule)
    assert (no_main.main, no_main.relay, no_main.fallback) == (None, "rld0", "no_main")
    with pytest.raises(LookupError):
        plan_request(500, 200, _cands("p0", healthy=False), _cands("md0"), _cands("rld0"), rule)
    with pytest.raises(LookupError):
        plan_request(500, 200, _cands("p0"), _cands("md0", healthy=False), [], rule)


def test_handoff_mode_follows_the_gap_and_the_relay_load():
    assert choose_handoff(40, 0.1, 0, threshold=64, chunk=64).mode == "one_shot"
    assert choose_handoff(200, 0.1, 0, threshold=64, chunk=64).mode == "catch_up"
    assert choose_handoff(200, 0.5, 0, threshold=64, chunk=64).chunk == 128  # busier: bigger chunks
    assert choose_handoff(200, 0.9, 0, threshold=64, chunk=64).mode == "one_shot"  # free a loaded relay
    assert choose_handoff(200, 0.1, 3, threshold=64, chunk=64).mode == "one_shot"  # requests wait for it
    assert choose_handoff(5, 0.9, 3, threshold=64, chunk=7, forced="catch_up").chunk == 7
    assert choose_handoff(500, 0.0, 0, threshold=64, chunk=7, forced="one_shot").mode == "one_shot"


def test_catch_up_cuts_over_when_close_or_after_enough_rounds():
    assert not cut_over(300, 100, threshold=64, rounds=1)
    assert cut_over(300, 240, threshold=64, rounds=1)
    assert cut_over(300, 0, threshold=64, rounds=MAX_CATCH_UP_ROUNDS)
    assert not cut_over(300, 100, threshold=64, rounds=2, previous_gap=450)  # halving: go on
    assert cut_over(300, 100, threshold=64, rounds=2, previous_gap=300)  # hardly shrinking: stop now


def test_reserve_waits_with_growing_pauses_then_gives_up():
    delays = [reserve_retry_delay(i, 0.0, 45.0) for i in range(6)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    assert reserve_retry_delay(0, 44.99, 45.0) == pytest.approx(0.01)
    assert reserve_retry_delay(3, 45.0, 45.0) is None
    # A long wait neither overflows (2 ** attempt) nor chases the limit in ever smaller
    # steps (which froze a simulated pool that never freed up).
    assert reserve_retry_delay(5000, 1.0, 45.0) == 0.5
    assert reserve_retry_delay(7, 45.0 - 1e-9, 45.0) is None


def test_prefill_retry_only_before_the_first_token():
    assert retry_on_new_prefill(0, 0, 1, others_healthy=True)
    assert not retry_on_new_prefill(3, 0, 1, others_healthy=True)
    assert not retry_on_new_prefill(0, 1, 1, others_healthy=True)
    assert not retry_on_new_prefill(0, 0, 1, others_healthy=False)


def test_playout_keeps_a_reserve_while_a_relay_produces_and_spends_it_at_the_handoff():
    from pdd.policy.playout import FILL_STRETCH, playout

    p = Playout(reserve=4, spacing_s=0.02, fill_spacing_s=0.03)
    assert release(1, 0, 0.0, True, False, p) == 1  # the first token is never held
    assert release(3, 1, 0.001, True, False, p) == 0  # a fast relay fills the reserve
    assert release(5, 4, 0.001, True, False, p) == 1  # full: each arrival pushes one out
    assert release(2, 4, 0.03, True, False, p) == 1  # not full: one per fill spacing
    assert release(2, 4, 0.025, True, False, p) == 0  # ... slower than the relay: a reserve builds
    assert next_release_s(2, 0.01, True, False, p) == pytest.approx(0.02)  # due on its own, not at an arrival
    # handed over, the main instance's first token not here yet: one per spacing
    assert release(4, 9, 0.005, False, True, p) == 0
    assert release(4, 9, 0.02, False, True, p) == 1
    assert next_release_s(4, 0.005, False, True, p) == pytest.approx(0.015)
    assert next_release_s(4, 0.005, False, False, p) is None
    assert release(3, 9, 0.0, False, False, p) == 3  # the main instance produces: all at once
    assert release(3, 1, 0.0, True, False, Playout(0, 0.02, 0.03)) == 3  # no reserve configured
    # the reserve fills a little slower than the slower tier: behind a relay no faster than MD too
    assert playout(4, 0.02, 0.028).fill_spacing_s == pytest.approx(FILL_STRETCH * 0.028)
    assert playout(4, 0.02, 0.005).fill_spacing_s == pytest.approx(FILL_STRETCH * 0.02)


def test_the_reserve_lasts_the_handoff_gap_measured_at_the_main_instances_pace():
    from pdd.policy.playout import MAX_RESERVE, observe_stall, reserve_tokens

    assert reserve_tokens(None, 0.02, 4) == 4  # nothing measured yet: the configured reserve
    assert reserve_tokens(0.15, 0.02, 4) == 8  # 150 ms at 20 ms a token
    assert reserve_tokens(0.03, 0.02, 4) == 4  # never under the configured one
    assert reserve_tokens(0.15, 0.02, 0) == 0  # 0: no reserve at all
    assert reserve_tokens(10.0, 0.02, 4) == MAX_RESERVE
    assert observe_stall(None, 0.1) == 0.1
    assert observe_stall(0.1, 0.3) == 0.3  # a slow handoff raises it at once
    assert observe_stall(0.3, 0.1) == pytest.approx(0.28)  # a quick one lowers it slowly


def test_missing_roles_are_what_a_plan_would_refuse():
    from pdd.policy.plan import missing_roles

    assert missing_roles({"prefill": 1, "main": 1}, "prefill", True) == []
    assert missing_roles({"prefill": 1, "relay": 1}, "prefill", True) == []  # the relay finishes requests alone
    assert missing_roles({"prefill": 1}, "prefill", True) == ["main"]
    assert missing_roles({"main": 2}, "prefill", True) == ["prefill"]
    assert missing_roles({"standalone": 1}, "standalone", False) == []
    assert missing_roles({}, "standalone", False) == ["standalone"]


# ---- capacity: the router dispatches by room, a loaded relay turns work away ------------

def test_pages_needed_counts_prompt_and_output_beyond_the_cached_hit():
    assert pages_needed(150, 16, 0, 16) == 11  # ceil(166 / 16)
    assert pages_needed(150, 16, 128, 16) == 3  # 8 cached pages are resident already
    assert pages_needed(150, 16, 10_000, 16) == 2  # a hit beyond the prompt counts as the prompt
    assert pages_needed(16, 0, 16, 16) == 1  # never nothing: the last token is always computed


def test_fits_by_pages_and_requests_and_an_idle_instance_takes_anything():
    room = Room(pages=48, requests=4)
    assert fits(11, 33, 3, room) and not fits(11, 38, 3, room)
    assert not fits(1, 0, 4, room)  # max_requests
    assert fits(500, 0, 0, room)  # idle: the engine refuses a request too big for it, clearly


def test_a_relay_accepts_only_what_it_decodes_at_once():
    assert relay_accepts(held=1, waiting=0, max_running=2)
    assert not relay_accepts(held=2, waiting=0, max_running=2)
    assert not relay_accepts(held=0, waiting=1, max_running=2)


def test_a_refusing_relay_sends_the_request_to_md_and_a_refusing_md_to_the_relay():
    chosen = Decision(Pipeline.P_RLD_MD, 0.2)
    assert relay_refused(chosen) == Decision(Pipeline.P_MD, 0.2, Fallback.RELAY_BUSY)
    assert main_refused(True) == Decision(Pipeline.P_RLD, None, Fallback.MAIN_REFUSED)
    assert main_refused(False) is None


# ---- recovery: the router's tree of what goes on after a failure ----------------------

_STATE = dict(p_done=False, delivered=0, attempt=0, max_attempts=1, other_entry_up=True, chosen=True,
              relay_producing=True, has_main=True, main_done=False, relay_done=False, handed_off=False)


def _failed(where: str, lost: bool = True, busy: bool = False) -> Failed:
    return Failed(entry=where == "entry", relay=where == "relay", main=where == "main", lost=lost, busy=busy)


def test_a_lost_prefill_is_retried_before_the_first_token_and_the_relay_goes_on_after():
    assert recover(_failed("entry"), State(**_STATE)) == Recovery.RETRY_PREFILL
    later = State(**{**_STATE, "delivered": 3})
    assert recover(_failed("entry"), later) == Recovery.RELAY_GOES_ON
    assert recover(_failed("entry"), State(**{**_STATE, "delivered": 3, "relay_producing": False})) == Recovery.FAIL
    assert recover(_failed("entry"), State(**{**_STATE, "p_done": True})) == Recovery.IGNORE
    assert recover(_failed("entry", lost=False), State(**_STATE)) == Recovery.RELAY_GOES_ON  # an error: no retry
    # P lost before its result came, with MD already producing from the KV the handoff waited for
    handed_off = State(**{**_STATE, "delivered": 5, "relay_producing": False, "relay_done": True, "handed_off": True})
    assert recover(_failed("entry"), handed_off) == Recovery.IGNORE
    # P (pd-cross-dc) lost before its result came, with MD already producing: MD has the KV
    producing = State(**{**_STATE, "delivered": 5, "relay_producing": False, "main_produced": True})
    assert recover(_failed("entry"), producing) == Recovery.IGNORE
    # the relay producing alone (P chose P -> RLD, or MD was lost before): P's loss does not stop it
    relay_alone = State(**{**_STATE, "delivered": 5, "main_done": True})
    assert recover(_failed("entry"), relay_alone) == Recovery.RELAY_GOES_ON
    assert recover(_failed("entry"), replace(relay_alone, has_main=False)) == Recovery.RELAY_GOES_ON


def test_md_takes_over_from_a_lost_relay_and_the_relay_from_a_lost_md():
    assert recover(_failed("relay"), State(**_STATE)) == Recovery.MAIN_TAKES_OVER
    assert recover(_failed("relay"), State(**{**_STATE, "relay_done": True})) == Recovery.IGNORE
    assert recover(_failed("relay"), State(**{**_STATE, "main_done": True})) == Recovery.FAIL
    assert recover(_failed("main"), State(**_STATE)) == Recovery.RELAY_GOES_ON
    after_handoff = State(**{**_STATE, "relay_producing": False, "handed_off": True})
    assert recover(_failed("main"), after_handoff) == Recovery.FAIL
    assert recover(_failed("main"), State(**{**_STATE, "main_done": True})) == Recovery.IGNORE
    assert (failure_status(True, False), failure_status(False, True), failure_status(False, False)) == (429, 503, 500)


# ---- MD waits for a request in flight that holds most of a prompt ---------------------

def test_md_waits_for_the_request_in_flight_that_holds_most_of_the_prompt():
    prompt = list(range(100))
    turn_one = list(range(80)) + [999]  # holds 80 of the 100
    assert prefix_holder(prompt, 0, 16, [list(range(30)), turn_one]) == 1
    assert prefix_holder(prompt, 70, 16, [turn_one]) is None  # not a page more than the cache holds
    assert prefix_holder(prompt, 0, 16, [list(range(40))]) is None  # under half the prompt
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def test_the_playout_pace_is_a_slow_average_and_occupancy_a_share():
    assert observe_pace(0.02, 1.02) == pytest.approx(0.02 + 0.05 * 1.0)
    assert occupancy(3, 4) == 0.75 and occupancy(1, 0) == 1.0


def test_the_line_meter_measures_acknowledged_kv_over_windows():
    meter = LineMeter(LineEstimate(bytes_per_s=1e6, one_way_s=0.01))
    meter.begin(("r", "md0"), 0, 1000, 100, Priority.BACKGROUND)
    meter.begin(("s", "md0"), 0, 500, 100, Priority.URGENT)
    assert meter.in_flight(Priority.URGENT) == [50_000]  # background yields to it
    assert sorted(meter.in_flight(Priority.BACKGROUND)) == [50_000, 100_000]
    meter.acked(("r", "md0"), 0, False, now_s=10.0)  # opens a window
    meter.acked(("r", "md0"), 500, False, now_s=10.5)  # 50 KB in half a second
    assert meter.estimate.bytes_per_s == pytest.approx(0.7e6 + 0.3 * 100_000)
    meter.acked(("r", "md0"), 1000, True, now_s=10.6)
    assert meter.in_flight(Priority.BACKGROUND) == [50_000]


def test_lossy_kv_lives_in_a_namespace_of_each_salt_and_form():
    from pdd.config import LineSpec
    from pdd.policy.transfer import kv_namespace

    assert kv_namespace("", "") == "" and kv_namespace("t1", "") == "t1"  # exact KV: the request's own
    spaces = {kv_namespace(salt, form) for salt in ("", "t1") for form in ("", "int8")}
    assert len(spaces) == 4
    with pytest.raises(ValueError, match="lossy_kv"):
        LineSpec(lossy_kv="int4")
