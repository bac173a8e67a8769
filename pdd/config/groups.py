"""Data-parallel groups: an instance with `[engine.vllm] data_parallel_size = N` is N
members, one per rank, each with its own ports, KV cache, router mirror and reservations.

vLLM runs each rank of such a group as an engine of its own (its external load-balancing
mode: `--data-parallel-rank R` with the group's size, address and RPC port): for a
mixture-of-experts model the ranks step their MoE layers in lockstep, coordinated by rank
0 (an idle rank steps too); for a dense one vLLM runs them as independent engines
(`pdd.engines.vllm.args.independent_rank`). pdd wraps each rank's engine in an instance
process of its own, so the router plans a request onto one rank by its prefix affinity
and load as it does any member, and `pdd drain`, `--join` and `/pdd/stats` take the
group by its name.

A group written once (`name = "md0"`, `data_parallel_size = 2`) expands at load into its
ranks `md0-dp0`, `md0-dp1` on the group's host, each rank's ports (and advertised ports)
the group's plus its rank, as vLLM's ranks on one host take consecutive ports. A group
whose ranks sit on several hosts is written rank by rank: one `[[instances]]` entry each,
with `group = "md0"` and `[engine.vllm] data_parallel_rank = R`, the group's
`data_parallel_address` (rank 0's host) and `data_parallel_rpc_port` on every one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pdd.addresses import parse_addr
from pdd.config.check import ConfigError
from pdd.engines.port import devices

# `pdd.config.InstanceSpec`, named for the reader: config calls this module while it parses,
# so importing the class back, even for the type checker alone, would close an import circle
InstanceSpec = Any

SIZE = "data_parallel_size"
RANK = "data_parallel_rank"
ADDRESS = "data_parallel_address"
RPC_PORT = "data_parallel_rpc_port"


def rank_name(group: str, rank: int) -> str:
    return f"{group}-dp{rank}"


def size_of(inst: InstanceSpec, where: str) -> int:
    """The group's size the instance's `[engine.vllm]` gives (1: no group); ConfigError naming the key."""
    size = inst.engine.vllm.get(SIZE, 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"{where}.engine.vllm.{SIZE} must be a whole number of at least 1, not {size!r}")
    return size


def ranks(inst: InstanceSpec, where: str) -> tuple[InstanceSpec, ...]:
    """The members an `[[instances]]` entry stands for: itself, or a group's ranks."""
    size = size_of(inst, where)
    if inst.engine.backend != "vllm" and size > 1:
        raise ConfigError(f"{where}.engine.vllm.{SIZE} = {size}: data-parallel groups run on the vllm backend")
    if RANK in inst.engine.vllm:  # one rank of a group written rank by rank
        _check_rank(inst, size, where)
        return (inst,)
    if size == 1:
        return (inst,)
    if inst.group:
        raise ConfigError(f"{where}.group = {inst.group!r}: a group written whole is named by its own name")
    return tuple(_rank(inst, r, size, where) for r in range(size))


def _check_rank(inst: InstanceSpec, size: int, where: str) -> None:
    rank = inst.engine.vllm[RANK]
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
        raise ConfigError(f"{where}.engine.vllm.{RANK} must be a whole number in 0..{size - 1}, not {rank!r}")
    if not inst.group:
        raise ConfigError(f"{where}.engine.vllm.{RANK} = {rank}: give the rank's group = NAME too")


def _rank(inst: InstanceSpec, rank: int, size: int, where: str) -> InstanceSpec:
    """Rank `rank` of the group `inst` writes whole, on the group's host."""

    def shifted(port: int) -> int:
        return port + rank if port else 0

    advertise = {dc: f"{host}:{shifted(port)}" for dc, (host, port) in _parsed(inst.advertise).items()}
    vllm = {**inst.engine.vllm, RANK: rank, ADDRESS: inst.engine.vllm.get(ADDRESS, inst.host)}
    engine = replace(inst.engine, vllm=vllm, device=_rank_device(inst, rank, size, where))
    return replace(
        inst,
        name=rank_name(inst.name, rank),
        group=inst.name,
        port=shifted(inst.port),
        kv_port=shifted(inst.kv_port),
        advertise=advertise,
        engine=engine,
    )


def _parsed(advertise: dict[str, str]) -> dict[str, tuple[str, int]]:
    return {dc: parse_addr(addr) for dc, addr in advertise.items()}


def _rank_device(inst: InstanceSpec, rank: int, size: int, where: str) -> str:
    """A rank's devices: its share of the group's GPU list (a tensor-parallel group's
    worth each, in rank order), or the group's device where that names no list."""
    given = devices(inst.engine.device)
    if len(given) == 1 and not inst.engine.device.startswith("cuda:"):  # "cpu", "cuda": every rank alike
        return inst.engine.device
    per_rank = inst.engine.vllm.get("tensor_parallel_size", 1)
    if not isinstance(per_rank, int) or len(given) != size * per_rank:
        raise ConfigError(
            f"{where}.engine.device = {inst.engine.device!r} names {len(given)} GPU(s) for {SIZE} = {size} "
            f'ranks of tensor_parallel_size = {per_rank}: list one per rank and tensor-parallel rank, or "cuda"'
        )
    mine = given[rank * per_rank : (rank + 1) * per_rank]
    return "cuda:" + ",".join(d.split(":")[1] for d in mine)


def check_groups(instances: tuple[InstanceSpec, ...]) -> None:
    """Every group's ranks agree on its size and address, are each there once, and its name
    is no instance's."""
    by_group: dict[str, list[InstanceSpec]] = {}
    for inst in instances:
        if inst.group:
            by_group.setdefault(inst.group, []).append(inst)
    names = {i.name for i in instances}
    for group, members in by_group.items():
        if group in names:
            raise ConfigError(f"group {group!r} is also an instance's name")
        for key in (SIZE, ADDRESS, RPC_PORT):
            seen = {repr(m.engine.vllm.get(key)) for m in members}
            if len(seen) > 1:
                raise ConfigError(f"group {group!r}: its ranks' engine.vllm.{key} differ ({', '.join(sorted(seen))})")
        got = sorted(m.engine.vllm.get(RANK, 0) for m in members)
        if len(set(got)) != len(got):
            raise ConfigError(f"group {group!r}: engine.vllm.{RANK} {got} names a rank twice")


def of(instances: tuple[InstanceSpec, ...] | list[InstanceSpec], name: str) -> list[InstanceSpec]:
    """The ranks of group `name`, in rank order (none: no such group)."""
    return sorted((i for i in instances if i.group == name), key=lambda i: i.engine.vllm.get(RANK, 0))


def with_rpc_ports(instances: tuple[InstanceSpec, ...], draw: Any) -> tuple[InstanceSpec, ...]:
    """Every group that names no RPC port given one, `draw()`n once for all its ranks."""
    ports: dict[str, int] = {}
    out = []
    for inst in instances:
        if inst.group and RPC_PORT not in inst.engine.vllm:
            port = ports.setdefault(inst.group, draw())
            inst = replace(inst, engine=replace(inst.engine, vllm={**inst.engine.vllm, RPC_PORT: port}))
        out.append(inst)
    return tuple(out)
