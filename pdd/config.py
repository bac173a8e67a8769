"""One TOML file describes a deployment: datacenters, the WAN line, instances, model,
policies and SLOs.

The same file serves two uses. Written by hand with an explicit `[[instances]]` list,
it describes a real multi-host deployment that `pdd serve --config F --instance NAME`
and `pdd router --config F` read on each host. Given to `pdd up` with a `[topology]`
instead, it is expanded for one machine: ports are picked, the mode places P and D in
datacenters, and the resolved explicit file is what every child process reads.

Addresses: every instance listens on its `host` and is reached there, from every
datacenter, unless its `advertise` table names another `HOST:PORT` for callers in a
given datacenter (a NAT or public address, or a `pdd wan` emulator on the way). So a
real line needs nothing but each host's own address, and the emulator is one optional
hop per route: `pdd up` puts it on every cross-datacenter route of its one machine.
"""

from __future__ import annotations

import secrets
import tomllib
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pdd.engine_port import EngineConfig, for_backend
from pdd.names import HandoffMode, Mode, Pipeline, RoleName

ROLES = tuple(RoleName)
MODES = tuple(Mode)


class ConfigError(ValueError):
    pass


def parse_addr(text: str) -> tuple[str, int]:
    """Parse `HOST:PORT` (IPv6 hosts in brackets)."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {text!r} is not HOST:PORT")
    return host, int(port)


def callable_at(addr: Any) -> bool:
    """Whether `addr` is an address one can connect to: "HOST:PORT" with a port."""
    try:
        return isinstance(addr, str) and parse_addr(addr)[1] > 0
    except ValueError:
        return False


UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "")  # a socket can listen on these; nobody can be told to call them


@dataclass(frozen=True)
class ModelSpec:
    path: str = ""  # a model directory or a hub name (ORG/NAME) in the local HF cache; empty: the tiny model
    name: str = ""  # the model id in the API; empty: the hub name or directory name of path, "tiny" for the tiny one

    @property
    def served_name(self) -> str:
        from pdd.model.store import served_name

        return self.name or served_name(self.path)


@dataclass(frozen=True)
class LinkSpec:
    """The line between two datacenters. Its bandwidth and delay are what P assumes of
    it until it has measured the line (and what `pdd up`'s emulator enforces); `host`
    and `admin_port` name a `pdd wan` emulator's admin API, when one is on the line, for
    the router to read the bytes it carried (0: none; the instances' counts are used)."""

    name: str = "wan"
    a: str = "A"
    b: str = "B"
    bandwidth_mbps: float = 20.0
    delay_ms: float = 20.0
    jitter_ms: float = 5.0
    host: str = "127.0.0.1"  # where `pdd up`'s emulator listens (its routes and admin API)
    admin_port: int = 0


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    role: str
    dc: str = "A"
    host: str = "127.0.0.1"  # listens here (both ports); reached here unless `advertise` says otherwise
    port: int = 0  # HTTP: /health, /metrics (and the OpenAI API for standalone)
    kv_port: int = 0  # framed protocol: requests, KV, tokens, cache events
    # datacenter -> "HOST:PORT" where callers there reach kv_port, when not at host:kv_port
    # (a NAT or public address, or a `pdd wan` emulator on the route)
    advertise: dict[str, str] = field(default_factory=dict)
    engine: EngineConfig = EngineConfig()


@dataclass(frozen=True)
class PolicySpec:
    """Knobs of the decisions in `pdd.policy` (see each function for the rule)."""

    decode_radix_cache: bool = True  # decode side keeps prefixes; only the delta crosses
    kv_chunk_tokens: int = 64  # tokens per KV chunk (one frame per layer; imported as it lands)
    affinity_weight: float = 1.0  # router: value of one predicted cached token...
    load_weight: float = 1.0  # ...against one queued token of work
    # PDD mode. P -> MD when MD's KV delta is predicted to arrive within this after
    # prefill (about two decode steps at this model's scale: a P -> MD first token is at
    # most that much later than a relay's); otherwise P -> RLD -> MD. "pipeline" pins
    # the choice (auto | P-MD | P-RLD-MD).
    ttft_budget_ms: float = 60.0
    pipeline: str = "auto"
    handoff: str = "auto"  # auto | one_shot | catch_up
    # The spec's threshold is 64 tokens; a 64-token extend costs this model several decode
    # steps' time, so the defaults are scaled down to keep MD's stalls step-sized.
    handoff_threshold: int = 16  # catch-up when more tokens than this are to be handed over
    catch_up_chunk: int = 32  # most handed-over tokens MD extends per step in catch-up
    anomaly_filter: bool = True  # long input, short output, low hit: runs on RLD alone
    anomaly_max_output_tokens: int = 0  # 0: the spec's 500 of a 64K context, scaled to the model's
    anomaly_min_prompt_share: float = 0.5  # of the context: a "long" prompt
    anomaly_max_hit_share: float = 0.5  # of the prompt: a "low" hit

    def __post_init__(self) -> None:
        if min(self.kv_chunk_tokens, self.handoff_threshold, self.catch_up_chunk) < 1:
            raise ValueError("kv_chunk_tokens, handoff_threshold and catch_up_chunk must be at least 1")
        if self.pipeline not in ("auto", Pipeline.P_MD, Pipeline.P_RLD_MD):
            raise ValueError("pipeline must be auto, P-MD or P-RLD-MD")
        if self.handoff not in ("auto", *HandoffMode):
            raise ValueError("handoff must be auto, one_shot or catch_up")
        if self.ttft_budget_ms < 0 or self.anomaly_max_output_tokens < 0:
            raise ValueError("ttft_budget_ms and anomaly_max_output_tokens must be >= 0")
        if not (0 < self.anomaly_min_prompt_share <= 1 and 0 <= self.anomaly_max_hit_share <= 1):
            raise ValueError("anomaly shares must lie in (0, 1] and [0, 1]")


@dataclass(frozen=True)
class SLOSpec:
    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0


@dataclass(frozen=True)
class RouterSpec:
    dc: str = "A"
    host: str = "127.0.0.1"  # listens here
    port: int = 8000
    advertise: str = ""  # "HOST:PORT" where instances (`--join`) and `pdd drain` reach it; default host:port
    token_timeout_s: float = 60.0  # no first token for this long: the request fails
    stall_timeout_s: float = 10.0  # after the first token, no next one for this long: it fails
    prefill_retries: int = 1  # a prefill instance lost before the first token: retry on another
    handoff_reserve_tokens: int = 4  # relay tokens held back to cover a handoff (0: none)
    max_body_bytes: int = 4 << 20  # a larger request body gets 413 before anything parses it
    api_key: str = ""  # when set, /v1/* needs `Authorization: Bearer KEY` (default: $PDD_API_KEY)
    max_running: int = 128  # requests the router drives through instances at once...
    max_waiting: int = 256  # ...and holds in line for a slot; past both: 429 with Retry-After

    def __post_init__(self) -> None:
        if min(self.token_timeout_s, self.stall_timeout_s) <= 0 or min(self.prefill_retries,
                                                                       self.handoff_reserve_tokens) < 0:
            raise ValueError("timeouts must be positive; prefill_retries and handoff_reserve_tokens >= 0")
        if self.max_body_bytes < 1 or self.max_running < 1 or self.max_waiting < 0:
            raise ValueError("max_body_bytes and max_running must be at least 1, max_waiting at least 0")
        if self.advertise and not callable_at(self.advertise):
            raise ValueError(f"advertise must be \"HOST:PORT\", got {self.advertise!r}")

    @property
    def url(self) -> str:
        """Its HTTP base URL as others reach it."""
        host, port = parse_addr(self.advertise) if self.advertise else (self.host, self.port)
        if host in UNSPECIFIED_HOSTS:
            raise ConfigError(f"the router listens on {host!r}: give [router] advertise = \"HOST:PORT\"")
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True)
class LivenessSpec:
    """Heartbeats on every control connection (router <-> instance, P or RLD -> the
    decode side). A peer silent for `dead_after_s` is dropped and counted as lost: its
    requests go on through what is left or fail at once, and no new work goes to it.
    A blackholed line keeps TCP open and silent, so only heartbeats can tell."""

    heartbeat_s: float = 1.0
    dead_after_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise ValueError("need 0 < heartbeat_s < dead_after_s")


@dataclass(frozen=True)
class TLSSpec:
    """TLS on every framed connection (`pdd.transfer.tls`); empty paths: off. Each end
    presents `cert` and verifies the other's against `ca` (`pdd cert` makes a pair)."""

    cert: str = ""
    key: str = ""
    ca: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key) or (self.cert and not self.ca) or (self.ca and not self.cert):
            raise ValueError("give cert, key and ca together (or none)")

    @property
    def enabled(self) -> bool:
        return bool(self.cert)


@dataclass(frozen=True)
class TopologySpec:
    """What `pdd up` expands into instances."""

    prefill: int = 1
    relay: int = 1  # pdd mode only
    main: int = 1  # main decode instances (MD)
    # One machine stands in for two datacenters: prefill instances run at this lower CPU
    # priority, as on their own hardware their long prefills would not take the CPU
    # from decoding (whose token gaps the benchmarks compare). 0: no change.
    prefill_nice: int = 10

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.main < 1 or self.relay < 0:
            raise ValueError("a deployment needs at least one prefill and one main instance")
        if not 0 <= self.prefill_nice <= 19:
            raise ValueError("prefill_nice must lie in 0..19")


@dataclass(frozen=True)
class Deployment:
    mode: str = Mode.PD_CROSS_DC
    secret: str = ""
    model: ModelSpec = ModelSpec()
    engine: EngineConfig = EngineConfig()
    link: LinkSpec = LinkSpec()
    policy: PolicySpec = PolicySpec()
    slo: SLOSpec = SLOSpec()
    router: RouterSpec = RouterSpec()
    liveness: LivenessSpec = LivenessSpec()
    tls: TLSSpec = TLSSpec()
    topology: TopologySpec = TopologySpec()
    instances: tuple[InstanceSpec, ...] = ()

    def instance(self, name: str) -> InstanceSpec:
        for inst in self.instances:
            if inst.name == name:
                return inst
        raise ConfigError(f"no instance named {name!r}; have {[i.name for i in self.instances]}")

    def by_role(self, role: str) -> list[InstanceSpec]:
        return [i for i in self.instances if i.role == role]

    def address(self, inst: InstanceSpec, from_dc: str) -> tuple[str, int]:
        """Where a caller in `from_dc` reaches `inst`'s framed port: the address it
        advertises to that datacenter, else where it listens."""
        if from_dc in inst.advertise:
            return parse_addr(inst.advertise[from_dc])
        if inst.host in UNSPECIFIED_HOSTS:
            raise ConfigError(f"instance {inst.name} listens on {inst.host!r}: give it advertise.{from_dc} = "
                              f"\"HOST:PORT\" for callers in datacenter {from_dc}")
        return inst.host, inst.kv_port


def _build(cls: type, raw: Any, where: str) -> Any:
    """A dataclass from a TOML table, with unknown keys and wrong types refused by name."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] must be a table")
    known = {f.name: f for f in fields(cls)}
    unknown = set(raw) - set(known)
    if unknown:
        raise ConfigError(f"[{where}] has unknown keys: {sorted(unknown)}")
    values = {}
    for key, value in raw.items():
        f = known[key]
        default = f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default
        if isinstance(default, dict):  # a free-form table passed through (an engine's own arguments)
            ok = isinstance(value, dict)
        elif isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, (int, float)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = type(default)(value) if ok else value
        else:
            ok = isinstance(value, str)
        if not ok:
            raise ConfigError(f"[{where}] {key} has the wrong type ({type(value).__name__})")
        values[key] = value
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"[{where}] {e}") from None


def _instance(raw: Any, engine: EngineConfig, index: int) -> InstanceSpec:
    if not isinstance(raw, dict) or "name" not in raw or "role" not in raw:
        raise ConfigError(f"[[instances]] #{index + 1} needs a name and a role")
    raw = dict(raw)
    overrides = raw.pop("engine", {})
    where = f"instances.{raw['name']}"
    advertise = _advertise(raw.pop("advertise", {}), where)
    inst = _build(InstanceSpec, raw, where)
    if inst.role not in ROLES:
        raise ConfigError(f"[{where}] role must be one of {ROLES}")
    checked = _build(EngineConfig, overrides, where + ".engine")
    changed = {k: getattr(checked, k) for k in overrides}
    if "vllm" in changed:  # an instance's vLLM arguments add to (and override) the deployment's
        changed["vllm"] = {**engine.vllm, **changed["vllm"]}
    merged = replace(engine, **changed)
    if "backend" in overrides:
        merged = for_backend(merged, merged.backend, "page_size" in overrides)
    return replace(inst, advertise=advertise, engine=merged)


def _advertise(raw: Any, where: str) -> dict[str, str]:
    """An instance's `advertise` table: datacenter -> "HOST:PORT", each checked."""
    if not isinstance(raw, dict):
        raise ConfigError(f"[{where}] advertise must be a table of datacenter = \"HOST:PORT\"")
    for dc, addr in raw.items():
        if not callable_at(addr):
            raise ConfigError(f"[{where}] advertise.{dc} must be \"HOST:PORT\", got {addr!r}")
    return dict(raw)


def instance_from_dict(raw: Any, engine: EngineConfig) -> InstanceSpec:
    """An instance from a JSON or TOML table (an `[[instances]]` entry, or a join),
    checked as strictly as the config file is."""
    return _instance(raw, engine, 0)


def instance_to_dict(inst: InstanceSpec) -> dict[str, Any]:
    return {**{f.name: getattr(inst, f.name) for f in fields(inst) if f.name not in ("engine", "advertise")},
            "advertise": dict(inst.advertise),
            "engine": {f.name: getattr(inst.engine, f.name) for f in fields(inst.engine)}}


def parse(raw: dict) -> Deployment:
    sections = {"model": ModelSpec, "engine": EngineConfig, "link": LinkSpec, "policy": PolicySpec,
                "slo": SLOSpec, "router": RouterSpec, "liveness": LivenessSpec, "tls": TLSSpec, "topology": TopologySpec}
    unknown = set(raw) - set(sections) - {"mode", "secret", "instances"}
    if unknown:
        raise ConfigError(f"unknown top-level keys: {sorted(unknown)}")
    kwargs: dict[str, Any] = {k: _build(cls, raw[k], k) for k, cls in sections.items() if k in raw}
    engine = kwargs.get("engine", EngineConfig())
    if "engine" in raw:
        engine = kwargs["engine"] = for_backend(engine, engine.backend, "page_size" in raw["engine"])
    insts = tuple(_instance(item, engine, i) for i, item in enumerate(raw.get("instances", [])))
    names = [i.name for i in insts]
    if len(set(names)) != len(names):
        raise ConfigError("instance names must be unique")
    mode = raw.get("mode", Deployment.mode)
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}")
    return Deployment(mode=mode, secret=str(raw.get("secret", "")), instances=insts, **kwargs)


def load(path: str | Path | None) -> Deployment:
    """The deployment in `path`, or the built-in default one."""
    if path is None:
        return Deployment()
    try:
        with open(path, "rb") as f:
            return parse(tomllib.load(f))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table
        return "{ " + ", ".join(f"{_toml_value(k)} = {_toml_value(x)}" for k, x in v.items()) + " }" if v else "{}"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _toml_table(header: str, obj: Any) -> list[str]:
    lines = [header] + [f"{f.name} = {_toml_value(getattr(obj, f.name))}" for f in fields(obj)
                        if not isinstance(getattr(obj, f.name), EngineConfig)]
    if isinstance(obj, InstanceSpec):  # TOML: this subtable belongs to the last [[instances]]
        lines += _toml_table("[instances.engine]", obj.engine)
    return lines


def dump(dep: Deployment) -> str:
    """TOML text of a deployment, readable back by `parse`."""
    out = [f"mode = {_toml_value(dep.mode)}", f"secret = {_toml_value(dep.secret)}", ""]
    for name in ("model", "engine", "link", "policy", "slo", "router", "liveness", "tls", "topology"):
        out += _toml_table(f"[{name}]", getattr(dep, name)) + [""]
    for inst in dep.instances:
        out += _toml_table("[[instances]]", inst) + [""]
    return "\n".join(out)


def with_secret(dep: Deployment) -> Deployment:
    return dep if dep.secret else replace(dep, secret=secrets.token_hex(16))


def instances_for_mode(dep: Deployment, mode: str) -> tuple[InstanceSpec, ...]:
    """Place instances for a local deployment: P (and, in pdd mode, RLD) in A; MD in A
    (pd-same-dc) or B (pd-cross-dc, pdd)."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}")
    eng, a = dep.engine, dep.link.a
    if mode == Mode.COLOCATED:
        return (InstanceSpec("standalone0", RoleName.STANDALONE, a, engine=eng),)
    d_dc = a if mode == Mode.PD_SAME_DC else dep.link.b
    ps = [InstanceSpec(f"p{i}", RoleName.PREFILL, a, engine=eng) for i in range(dep.topology.prefill)]
    rs = [InstanceSpec(f"rld{i}", RoleName.RELAY, a, engine=eng) for i in range(dep.topology.relay if mode == Mode.PDD else 0)]
    ds = [InstanceSpec(f"md{i}", RoleName.MAIN, d_dc, engine=eng) for i in range(dep.topology.main)]
    return tuple(ps + rs + ds)
