"""Data-parallel groups on the config side (`pdd.config.groups`): an `[[instances]]` entry with
`[engine.vllm] data_parallel_size = N` is N members, each rank with its own ports, its
GPUs, the group's address and RPC port; bad values are refused in one line naming the
key; the router counts a group's ranks as a unit (stats, drain, join); and the vLLM
arguments a rank gets are the ones vLLM's external load-balancing mode expects."""

from __future__ import annotations

import asyncio
import re
import tomllib
from dataclasses import replace

import pytest

from pdd import config as cfg
from pdd.config import groups
from pdd.lab.deploy import resolve

MD0 = {"name": "md0", "role": "main", "dc": "B", "host": "10.0.0.5", "port": 9000, "kv_port": 9100,
       "advertise": {"A": "203.0.113.7:7000"}, "engine": {"vllm": {"data_parallel_size": 2}}}


def _parse(*instances: dict, engine: dict | None = None) -> cfg.Deployment:
    return cfg.parse({"engine": {"backend": "vllm", **(engine or {})}, "instances": list(instances)})


def test_a_group_written_whole_is_a_member_per_rank_on_consecutive_ports():
    dep = _parse({"name": "p0", "role": "prefill"}, MD0)
    p0, r0, r1 = dep.instances
    assert (p0.name, p0.group, r0.name, r1.name) == ("p0", "", "md0-dp0", "md0-dp1")
    assert (r0.group, r1.group) == ("md0", "md0")
    assert [(r.port, r.kv_port, r.advertise) for r in (r0, r1)] == [
        (9000, 9100, {"A": "203.0.113.7:7000"}), (9001, 9101, {"A": "203.0.113.7:7001"})]
    for rank, r in enumerate((r0, r1)):
        assert r.engine.vllm == {"data_parallel_size": 2, "data_parallel_rank": rank,
                                 "data_parallel_address": "10.0.0.5"}
    assert cfg.parse(tomllib.loads(cfg.dump(dep))).instances == dep.instances  # the file read back is the same
    assert groups.of(dep.instances, "md0") == [r0, r1]
    with pytest.raises(cfg.ConfigError, match=r"'md0' is a data-parallel group: serve each of its ranks "
                                              r"\(md0-dp0, md0-dp1\) by its name"):
        dep.instance("md0")


def test_each_rank_takes_its_share_of_the_groups_gpus():
    tp2 = {**MD0, "engine": {"device": "cuda:0,1,2,3", "vllm": {"data_parallel_size": 2, "tensor_parallel_size": 2}}}
    assert [r.engine.device for r in _parse(tp2).instances] == ["cuda:0,1", "cuda:2,3"]
    every = {**MD0, "engine": {"device": "cuda", "vllm": {"data_parallel_size": 2}}}
    assert [r.engine.device for r in _parse(every).instances] == ["cuda", "cuda"]


def test_a_group_across_hosts_is_written_rank_by_rank():
    """Rank 1 on another host: each rank its own entry, the group's address and port on each."""
    vllm = {"data_parallel_size": 2, "data_parallel_address": "10.0.0.5", "data_parallel_rpc_port": 13345}
    ranks = [{"name": f"md0-dp{r}", "role": "main", "group": "md0", "host": f"10.0.0.{5 + r}",
              "engine": {"vllm": {**vllm, "data_parallel_rank": r}}} for r in range(2)]
    dep = _parse(*ranks)
    assert [(i.name, i.host, i.group, i.engine.vllm["data_parallel_rank"]) for i in dep.instances] == [
        ("md0-dp0", "10.0.0.5", "md0", 0), ("md0-dp1", "10.0.0.6", "md0", 1)]


def test_pdd_up_gives_a_group_one_rpc_port_and_each_rank_its_own_ports(tiny_model_dir):
    dep = resolve(_parse({"name": "p0", "role": "prefill"}, {**MD0, "host": "127.0.0.1", "port": 0, "kv_port": 0,
                                                               "advertise": {}}), "pdd", 0)
    r0, r1 = groups.of(dep.instances, "md0")
    assert r0.engine.vllm["data_parallel_rpc_port"] == r1.engine.vllm["data_parallel_rpc_port"] > 0
    ports = [p for i in dep.instances for p in (i.port, i.kv_port)] + [r0.engine.vllm["data_parallel_rpc_port"]]
    assert len(set(ports)) == len(ports) and 0 not in ports
    assert set(r0.advertise) == set(r1.advertise) == {"A"} and r0.advertise != r1.advertise  # a hop each
    # a deployment-wide group size: every instance `pdd up` places is a group
    whole = resolve(cfg.parse({"engine": {"backend": "vllm", "vllm": {"data_parallel_size": 2}}}), "pdd", 0)
    assert [i.name for i in whole.instances] == ["p0-dp0", "p0-dp1", "rld0-dp0", "rld0-dp1", "md0-dp0", "md0-dp1"]


@pytest.mark.parametrize("instances, match", [
    ([{**MD0, "engine": {"vllm": {"data_parallel_size": 0}}}],
     r"instances\.md0\.engine\.vllm\.data_parallel_size must be a whole number of at least 1, not 0"),
    ([{**MD0, "engine": {"vllm": {"data_parallel_size": "2"}}}],
     r"instances\.md0\.engine\.vllm\.data_parallel_size must be a whole number of at least 1, not '2'"),
    ([{**MD0, "engine": {"backend": "embedded", "vllm": {"data_parallel_size": 2}}}],
     r"instances\.md0\.engine\.vllm\.data_parallel_size = 2: data-parallel groups run on the vllm backend"),
    ([{**MD0, "group": "g"}], r"instances\.md0\.group = 'g': a group written whole is named by its own name"),
    ([{**MD0, "engine": {"vllm": {"data_parallel_size": 2, "data_parallel_rank": 2}}, "group": "g"}],
     r"instances\.md0\.engine\.vllm\.data_parallel_rank must be a whole number in 0\.\.1, not 2"),
    ([{**MD0, "engine": {"vllm": {"data_parallel_size": 2, "data_parallel_rank": 1}}}],
     r"instances\.md0\.engine\.vllm\.data_parallel_rank = 1: give the rank's group = NAME too"),
    ([{**MD0, "engine": {"device": "cuda:0,1,2", "vllm": {"data_parallel_size": 2}}}],
     r"instances\.md0\.engine\.device = 'cuda:0,1,2' names 3 GPU\(s\) for tensor_parallel_size x "
     r"data_parallel_size = 2: list one per "
     r"rank \(device = .cuda:0,1.\)"),
    ([MD0, {"name": "md0-dp0", "role": "main"}], r"instance names must be unique"),
    ([{**MD0, "name": "x"}, {"name": "x-dp9", "role": "main", "group": "x",
                             "engine": {"vllm": {"data_parallel_size": 3, "data_parallel_rank": 2}}}],
     r"group 'x': its ranks' engine\.vllm\.data_parallel_size differ \(2, 3\)"),
    ([{**MD0, "name": "p0"}, {"name": "q", "role": "prefill", "group": "p0-dp1",
                              "engine": {"vllm": {"data_parallel_size": 2, "data_parallel_rank": 0}}}],
     r"group 'p0-dp1' is also an instance's name"),
])
def test_a_bad_group_is_refused_in_one_line_naming_the_key(instances, match):
    with pytest.raises(cfg.ConfigError, match=match) as got:
        _parse(*instances)
    assert "\n" not in str(got.value)


def test_the_router_counts_a_group_whole_in_its_stats_drain_and_join():
    """A group's ranks take work only once all have joined; a drain by the group's name takes
    every rank out of planning at once; the stats list the ranks under their group."""
    from pdd.router.members import Membership, MembershipError

    dep = _parse({"name": "p0", "role": "prefill", "host": "127.0.0.1", "kv_port": 1},
                 {**MD0, "host": "127.0.0.1", "advertise": {}})
    r0, r1 = groups.of(dep.instances, "md0")

    async def run() -> None:
        members = Membership(replace(dep, instances=(dep.instances[0], r0)), b"k" * 32, "router")
        assert members.groups() == {"md0": ["md0-dp0"]} and members.clients["md0-dp0"].group_short
        members.join(r1)  # the group's last rank: now all of them take work
        assert members.groups() == {"md0": ["md0-dp0", "md0-dp1"]}
        assert not any(c.group_short for c in members.clients.values())
        assert [c.name for c in members.group_of("md0")] == ["md0-dp0", "md0-dp1"]
        with pytest.raises(MembershipError, match="no instance or group named 'md9'"):
            members.group_of("md9")
        await members.drain("md0")  # (not connected here: each rank is gone at once, as one that left)
        assert list(members.clients) == ["p0"] and members.left == 2 and members.groups() == {}
        for c in list(members.clients.values()):
            await c.stop()

    asyncio.run(run())


def test_a_ranks_vllm_arguments_are_what_vllms_external_load_balancing_expects(tiny_model_dir, tmp_path):
    """A mixture-of-experts rank keeps the group's size, its rank, address and RPC port, and
    vLLM's own engine configuration reads them as a rank of an external load-balancing
    group (its KV events on the ports vLLM's publisher moves them to in that rank); a dense
    rank is an engine of its own (`independent_rank`), as vLLM runs one; a size without a
    rank is refused (a group is one instance per rank)."""
    from checkpoints import save_moe_of
    from vllm.distributed.kv_events import ZmqEventPublisher
    from vllm.engine.arg_utils import AsyncEngineArgs

    from pdd.engines.vllm import args as vargs

    rank1 = groups.of(resolve(_parse({**MD0, "host": "127.0.0.1", "port": 0, "kv_port": 0, "advertise": {}},
                                     engine={"dtype": "float32"}), "pdd", 0).instances, "md0")[1]
    moe = save_moe_of(tiny_model_dir, tmp_path / "moe")
    kwargs = vargs.engine_kwargs(moe, rank1.engine, "/tmp/b", "t", "ipc:///tmp/e", "ipc:///tmp/r")
    kwargs, events, replay = vargs.lockstep_rank_events(kwargs, 1)
    # where vLLM's publisher in rank 1 puts its endpoints is where pdd's subscriber reads them
    published = kwargs["kv_events_config"]
    assert [ZmqEventPublisher.offset_endpoint_port(published[k], 1) for k in ("endpoint", "replay_endpoint")] == [
        events, replay]
    pc = AsyncEngineArgs(**kwargs).create_engine_config().parallel_config
    assert (pc.data_parallel_size, pc.data_parallel_rank, pc.data_parallel_external_lb) == (2, 1, True)
    assert (pc.data_parallel_master_ip, pc.data_parallel_rpc_port) == (
        "127.0.0.1", rank1.engine.vllm["data_parallel_rpc_port"])
    dense = vargs.engine_kwargs(tiny_model_dir, rank1.engine, "/tmp/b", "t", "ipc:///tmp/e", "ipc:///tmp/r")
    with pytest.raises(ValueError, match="Non-MoE models do not support external data parallel mode"):
        AsyncEngineArgs(**dense).create_engine_config()  # (vLLM's own refusal: why a dense rank runs alone)
    alone = AsyncEngineArgs(**vargs.independent_rank(dense)).create_engine_config().parallel_config
    assert alone.data_parallel_size == 1
    whole = replace(rank1.engine, vllm={"data_parallel_size": 2})
    with pytest.raises(ValueError, match=re.escape("data_parallel_size without data_parallel_rank")):
        vargs.engine_kwargs(tiny_model_dir, whole, "/tmp/b", "t", "ipc:///tmp/e", "ipc:///tmp/r")
