"""One TOML file describes a deployment: datacenters, the line, instances, model,
policies and SLOs.

The same file serves two uses. Written by hand with an explicit `[[instances]]` list,
it describes a real multi-host deployment that `pdd serve --config F --instance NAME`
and `pdd router --config F` read on each host. Given to `pdd up` with a `[topology]`
instead, it is expanded for one machine: ports are picked, the mode places P and D in
datacenters, and the resolved explicit file is what every child process reads.

Addresses: every instance listens on its `host` and is reached there, from every
datacenter, unless its `advertise` table names another `HOST:PORT` for callers in a
given datacenter (a NAT or public address, or a `pdd line` emulator on the way). So a
real line needs nothing but each host's own address, and the emulator is one optional
hop per route: `pdd up` puts it on every cross-datacenter route of its one machine.
"""

from __future__ import annotations

import logging
import secrets
import tomllib
from collections.abc import Collection
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import tomli_w

from pdd.addresses import parse_addr
from pdd.config import groups
from pdd.config.check import ConfigError, validate
from pdd.config.tables import (
    INTRA_KV_PATHS,
    MODES,
    ROLES,
    Deployment,
    InstanceSpec,
    LineSpec,
    LivenessSpec,
    ModelSpec,
    PolicySpec,
    RouterSpec,
    SLOSpec,
    TLSSpec,
    TopologySpec,
)
from pdd.engines.port import (
    SELF_SIZED,
    SIZES_ITSELF,
    EngineConfig,
    devices,
    for_backend,
    left_to_engine,
    read_auto,
)
from pdd.names import (
    NATIVE,
    Mode,
    RoleName,
)

log = logging.getLogger(__name__)
OLD_LINE_TABLE = "link"  # the retired name of [line], still read (`_old_line_table`)

__all__ = [  # (the tables, read through this module: `cfg.Deployment`)
    "parse_addr",
    "ConfigError",
    "Deployment",
    "INTRA_KV_PATHS",
    "InstanceSpec",
    "LineSpec",
    "LivenessSpec",
    "MODES",
    "ModelSpec",
    "PolicySpec",
    "ROLES",
    "RouterSpec",
    "SLOSpec",
    "TLSSpec",
    "TopologySpec",
]


def instance_from_dict(raw: Any, engine: EngineConfig, index: int = 0, chosen: Collection[str] = ()) -> InstanceSpec:
    """An instance from a JSON or TOML table (an `[[instances]]` entry, or a join), checked
    as strictly as the config file is. Its `engine` table overrides the deployment's
    (whose file chose the fields in `chosen`)."""
    where = _where(raw, index)
    overrides = raw.get("engine", {}) if isinstance(raw, dict) else None
    if isinstance(overrides, dict):
        overrides = read_auto(overrides)
        inherited = asdict(engine)
        if overrides.get("backend", engine.backend) not in SIZES_ITSELF:
            # sizes a self-sizing backend left to itself are no choice for this one: its defaults
            left = {k for k in SELF_SIZED if left_to_engine(inherited[k]) and k not in overrides}
            inherited = {k: v for k, v in inherited.items() if k not in left}
            chosen = set(chosen) - left
        merged = {**inherited, **overrides}
        if isinstance(overrides.get("vllm"), dict):  # an instance's vLLM arguments add to the deployment's
            merged["vllm"] = {**engine.vllm, **overrides["vllm"]}
        raw = {**raw, "engine": merged}
    inst = validate(InstanceSpec, raw, where)
    if isinstance(overrides, dict) and "backend" in overrides:  # that backend's defaults, unless chosen
        inst = replace(inst, engine=for_backend(inst.engine, inst.engine.backend, {*chosen, *overrides}))
    check_devices(inst.engine, f"{where}.engine")
    return inst


def _where(raw: Any, index: int) -> str:
    """How errors name an `[[instances]]` entry."""
    name = raw.get("name") if isinstance(raw, dict) else None
    return f"instances.{name}" if isinstance(name, str) else f"instances #{index + 1}"


def check_devices(e: EngineConfig, where: str) -> None:
    """An instance's parallel ranks each need a device of their own on CUDA: refused at
    load (ConfigError naming the table and the key), not when vLLM fails to start."""
    given = devices(e.device)
    if e.backend not in SIZES_ITSELF:  # (the embedded engine runs on one device and ignores [engine.vllm])
        if len(given) > 1:
            raise ConfigError(f"{where}.device = {e.device!r}: the {e.backend} engine runs on one device")
        return
    ranks, sizes = 1, []
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):  # a GPU a rank of each stage
        size = e.vllm.get(key, 1)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ConfigError(f"{where}.vllm.{key} must be a whole number of at least 1, not {size!r}")
        ranks *= size
        sizes += [key] if size > 1 or key == "tensor_parallel_size" else []
    group = e.vllm.get(groups.SIZE, 1)
    if groups.RANK not in e.vllm and isinstance(group, int) and group > 1:  # a group written whole
        ranks *= group
        sizes.append(groups.SIZE)
    if ranks > 1 and e.device.startswith("cuda:") and len(given) != ranks:
        raise ConfigError(
            f"{where}.device = {e.device!r} names {len(given)} GPU(s) for {' x '.join(sizes)} = {ranks}: "
            f'list one per rank (device = "cuda:{",".join(str(i) for i in range(ranks))}"), or "cuda" for all '
            "visible"
        )


def instance_to_dict(inst: InstanceSpec) -> dict[str, Any]:
    return asdict(inst)


def parse(raw: dict, backend: str | None = None) -> Deployment:
    """A deployment from a parsed TOML document; `ConfigError` names what is wrong. With
    `backend`, every instance runs on it, as if the document said so (`pdd up --engine`):
    the values the document chose stay chosen, the backend's defaults fill the rest."""
    raw = _old_line_table(raw)
    if backend is not None:
        raw = {**raw, "engine": {**(raw.get("engine") or {}), "backend": backend}}
        items = raw.get("instances")
        if isinstance(items, list):
            on = [
                {**i, "engine": {**i["engine"], "backend": backend}}
                if isinstance(i, dict) and isinstance(i.get("engine"), dict) and "backend" in i["engine"]
                else i
                for i in items
            ]
            raw = {**raw, "instances": on}
    if isinstance(raw.get("engine"), dict):
        raw = {**raw, "engine": read_auto(raw["engine"])}
    dep = validate(Deployment, {k: v for k, v in raw.items() if k != "instances"}, "")
    if isinstance(raw.get("engine"), dict):
        dep = replace(dep, engine=for_backend(dep.engine, dep.engine.backend, raw["engine"]))
    check_devices(dep.engine, "engine")
    items = raw.get("instances", [])
    if not isinstance(items, list):
        raise ConfigError("instances must be an array of tables ([[instances]])")
    chosen = raw["engine"].keys() if isinstance(raw.get("engine"), dict) else ()
    instances = tuple(
        rank
        for i, item in enumerate(items)
        for rank in groups.ranks(instance_from_dict(item, dep.engine, i, chosen), _where(item, i))
    )
    groups.check_groups(instances)
    try:
        return replace(dep, instances=instances)
    except ValueError as e:  # two instances of one name
        raise ConfigError(str(e)) from None


def _old_line_table(raw: dict) -> dict:
    """`raw` with a file's `[link]`, the `[line]` table's retired name, read as `[line]`:
    files written before the rename keep loading, with one warning that names the new
    table. Both tables in one file is an error (which one would win is a guess)."""
    if OLD_LINE_TABLE not in raw:
        return raw
    if "line" in raw:
        raise ConfigError(f"[{OLD_LINE_TABLE}] and [line] are one table: keep [line]")
    log.warning("[%s] is now called [line]: rename the table (read as [line] this time)", OLD_LINE_TABLE)
    return {("line" if k == OLD_LINE_TABLE else k): v for k, v in raw.items()}


def load(path: str | Path | None, backend: str | None = None) -> Deployment:
    """The deployment in `path`, or the built-in default one, every instance on `backend`
    when one is given (`parse`); errors name the file."""
    if path is None:
        return parse({}, backend)
    try:
        with open(path, "rb") as f:
            return _read_secret(parse(tomllib.load(f), backend))
    except (tomllib.TOMLDecodeError, ConfigError) as e:
        raise ConfigError(f"{path}: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def _read_secret(dep: Deployment) -> Deployment:
    """`secret_file`'s content (stripped) as the secret; one of the two, never both."""
    if not dep.secret_file:
        return dep
    if dep.secret:
        raise ConfigError("secret and secret_file are both given: keep the secret in its file alone")
    try:
        secret = Path(dep.secret_file).read_text().strip()
    except OSError as e:
        raise ConfigError(f"secret_file: cannot read {dep.secret_file}: {e.strerror}") from None
    if not secret:
        raise ConfigError(f"secret_file: {dep.secret_file} is empty")
    return replace(dep, secret=secret)


def dump(dep: Deployment) -> str:
    """TOML text of a deployment, readable back by `load` (a secret read from its file stays
    there: the text names the file)."""
    secret = "" if dep.secret_file else dep.secret
    return tomli_w.dumps({**asdict(dep), "secret": secret, "instances": [asdict(inst) for inst in dep.instances]})


def with_secret(dep: Deployment) -> Deployment:
    return dep if dep.secret else replace(dep, secret=secrets.token_hex(16))


def in_emulated_time(dep: Deployment) -> Deployment:
    """`dep` with its line, P's latency budget and its SLOs in emulated time, which runs
    `topology.dilation` times slower than the emulated chips, so every ratio between
    compute, the line and the budgets stays what it is at the chips' speed (`pdd up`
    and `pdd sim check` alike). A native deployment is returned as it is."""
    d = dep.topology.dilation
    if dep.topology.hardware == NATIVE:
        return dep
    line = replace(
        dep.line,
        bandwidth_mbps=dep.line.bandwidth_mbps / d,
        delay_ms=dep.line.delay_ms * d,
        jitter_ms=dep.line.jitter_ms * d,
    )
    return replace(
        dep,
        line=line,
        policy=replace(dep.policy, ttft_budget_ms=dep.policy.ttft_budget_ms * d),
        slo=replace(dep.slo, ttft_ms=dep.slo.ttft_ms * d, tpot_ms=dep.slo.tpot_ms * d),
    )


def instances_for_mode(dep: Deployment, mode: str) -> tuple[InstanceSpec, ...]:
    """Place instances for a local deployment: P (and, in pdd mode, RLD) in A; MD in A
    (pd-same-dc) or B (pd-cross-dc, pdd)."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}")
    top, a = dep.topology, dep.line.a

    def spec(name: str, role: str, dc: str) -> InstanceSpec:
        # pd-same-dc is the spec's homogeneous baseline: every chip of it is A
        chip = top.chip(RoleName.PREFILL if mode == Mode.PD_SAME_DC else role)
        engine = dep.engine if chip == NATIVE else replace(dep.engine, hardware=chip, dilation=top.dilation)
        return InstanceSpec(name, role, dc, engine=engine)

    if mode == Mode.COLOCATED:
        return groups.ranks(spec("standalone0", RoleName.STANDALONE, a), "engine")
    d_dc = a if mode == Mode.PD_SAME_DC else dep.line.b
    ps = [spec(f"p{i}", RoleName.PREFILL, a) for i in range(top.prefill)]
    rs = [spec(f"rld{i}", RoleName.RELAY, a) for i in range(top.relay if mode == Mode.PDD else 0)]
    ds = [spec(f"md{i}", RoleName.MAIN, d_dc) for i in range(top.main)]
    return tuple(rank for inst in ps + rs + ds for rank in groups.ranks(inst, "engine"))
