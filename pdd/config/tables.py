"""The tables of a deployment file, one frozen dataclass each (`pdd.config` reads and
writes the file).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from pdd.addresses import UNSPECIFIED_HOSTS, callable_at, parse_addr
from pdd.config import groups
from pdd.config.check import STRICT_TABLE, ConfigError
from pdd.engines.port import (
    EngineConfig,
)
from pdd.names import (
    HARDWARE,
    KV_COMPRESSIONS,
    LOSSY_KV_FORMS,
    NATIVE,
    REASONING_PARSERS,
    TOOL_PARSERS,
    HandoffMode,
    Mode,
    Pipeline,
    RoleName,
    role_chip,
)

ROLES = tuple(RoleName)
MODES = tuple(Mode)


@dataclass(frozen=True)
class ModelSpec:
    __pydantic_config__ = STRICT_TABLE
    path: str = ""  # a model directory or a hub name (ORG/NAME) in the local HF cache; empty: the tiny model
    name: str = ""  # the model id in the API; empty: the hub name or directory name of path, "tiny" for the tiny one
    # a chat completion's thinking moved into `reasoning`, as vLLM's --reasoning-parser ("": none)
    reasoning_parser: str = ""
    # a chat completion's tool calls read out of its text, as vLLM's --tool-call-parser ("": the
    # one its chat template teaches, where pdd knows it: `pdd.api.tools.default_tool_parser`)
    tool_parser: str = ""
    # an out-of-tree tool parser's file or module, as vLLM's --tool-parser-plugin ("": none)
    tool_parser_plugin: str = ""

    def __post_init__(self) -> None:
        # where vLLM is installed, any name in its registries (checked as a server starts:
        # `pdd.api.parsers`); without it, pdd's own
        if importlib.util.find_spec("vllm") is not None:
            return
        for key, names in (("reasoning_parser", REASONING_PARSERS), ("tool_parser", TOOL_PARSERS)):
            if getattr(self, key) not in ("", *names):
                raise ValueError(
                    f'{key} must be "" or one of {", ".join(names)} (or vLLM\'s: the extra pdd-serving[vllm]), '
                    f"not {getattr(self, key)!r}"
                )

    @property
    def served_name(self) -> str:
        from pdd.model.store import served_name

        return self.name or served_name(self.path)


INTRA_KV_PATHS = ("tcp", "mooncake", "auto")


@dataclass(frozen=True)
class LineSpec:
    """The line between two datacenters. Its bandwidth and delay are what P assumes of
    it until it has measured the line (and what `pdd up`'s emulator enforces); `host`
    and `admin_port` name a `pdd line` emulator's admin API, when one is on the line, for
    `pdd up`, the soak and the tests to drive it (0: none)."""

    __pydantic_config__ = STRICT_TABLE
    name: str = "line"
    a: str = "A"
    b: str = "B"
    bandwidth_mbps: float = 20.0
    delay_ms: float = 20.0
    jitter_ms: float = 5.0
    host: str = "127.0.0.1"  # where `pdd up`'s emulator listens (its routes and admin API)
    admin_port: int = 0
    # TCP connections per peer for each priority of KV across the line: frames go to
    # whichever has drained, so one stream's window, slow start or loss recovery does
    # not hold the transfer back (BENCHMARKS.md, "KV over a long line")
    kv_streams: int = 4
    # LOSSY, off by default: KV crossing the line quantized to "int8" (a scale a token and
    # head), 1.9x fewer bytes than bf16 and 3.8x than fp32 at head_dim 128, tokens no longer
    # always equal to colocated's (BENCHMARKS.md). Such KV lives in a cache namespace of
    # its own on the far side (`pdd.policy.transfer.kv_namespace`), never taken for exact KV.
    # A peer of a release before protocol 6 is sent exact KV.
    lossy_kv: str = ""
    # Lossless, off by default: KV crossing the line compressed ("zstd", level 1): pays on a
    # line of about 1 Gbit/s, not on a 10 Gbit/s one, where the core each end spends on it
    # moves less than the line (BENCHMARKS.md, "Lossless compression for the line"). A peer
    # before protocol 6 is sent it as it is.
    compress_kv: str = ""
    # KV between instances of one datacenter (P -> RLD, P -> MD in the same site): "tcp"
    # (pdd's frames, the default), "mooncake" (the Mooncake Transfer Engine writes each
    # frame into the receiver's registered memory, RDMA where there is a device: refused at
    # start if it cannot run), "auto" (mooncake where it runs, else tcp, saying why once)
    intra_kv: str = "tcp"

    def __post_init__(self) -> None:
        if self.intra_kv not in INTRA_KV_PATHS:
            raise ValueError(f"intra_kv must be one of {', '.join(INTRA_KV_PATHS)}, not {self.intra_kv!r}")
        if not 1 <= self.kv_streams <= 64:
            raise ValueError(f"kv_streams must be 1-64, not {self.kv_streams}")
        if self.lossy_kv not in ("", *LOSSY_KV_FORMS):
            forms = ", ".join(LOSSY_KV_FORMS)
            raise ValueError(f'lossy_kv must be "" (exact KV) or one of {forms}, not {self.lossy_kv!r}')
        if self.compress_kv not in ("", *KV_COMPRESSIONS):
            raise ValueError(f'compress_kv must be "" or one of {", ".join(KV_COMPRESSIONS)}, not {self.compress_kv!r}')


@dataclass(frozen=True)
class InstanceSpec:
    __pydantic_config__ = STRICT_TABLE
    name: str
    role: str
    dc: str = "A"
    host: str = "127.0.0.1"  # listens here (both ports); reached here unless `advertise` says otherwise
    port: int = 0  # HTTP: /health, /metrics (and the OpenAI API for standalone)
    kv_port: int = 0  # framed protocol: requests, KV, tokens, cache events
    # datacenter -> "HOST:PORT" where callers there reach kv_port, when not at host:kv_port
    # (a NAT or public address, or a `pdd line` emulator on the route)
    advertise: dict[str, str] = field(default_factory=dict)
    engine: EngineConfig = EngineConfig()
    # the data-parallel group this instance is a rank of ("": none; `pdd.config.groups`)
    group: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {self.role!r}")
        for dc, addr in self.advertise.items():
            if not callable_at(addr):
                raise ValueError(f'advertise.{dc} must be "HOST:PORT", got {addr!r}')


@dataclass(frozen=True)
class PolicySpec:
    """Knobs of the decisions in `pdd.policy` (see each function for the rule)."""

    __pydantic_config__ = STRICT_TABLE
    decode_radix_cache: bool = True  # decode side keeps prefixes; only the delta crosses
    kv_chunk_tokens: int = 64  # tokens per KV chunk (its layers in frames of up to 1 MiB; imported as it lands)
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
    __pydantic_config__ = STRICT_TABLE
    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0


@dataclass(frozen=True)
class RouterSpec:
    __pydantic_config__ = STRICT_TABLE
    dc: str = "A"
    host: str = "127.0.0.1"  # listens here
    port: int = 8000
    advertise: str = ""  # "HOST:PORT" where instances (`--join`) and `pdd drain` reach it; default host:port
    token_timeout_s: float = 60.0  # no first token for this long: the request fails
    stall_timeout_s: float = 10.0  # after the first token, no next one for this long: it fails
    prefill_retries: int = 1  # a prefill instance lost before the first token: retry on another
    # relay tokens held back to cover a handoff, at least (more once the router has measured
    # handoffs: as many as last a handoff's gap at the main instance's pace); 0: none
    handoff_reserve_tokens: int = 4
    max_body_bytes: int = 4 << 20  # a larger request body gets 413 before anything parses it
    api_key: str = ""  # when set, /v1/* needs `Authorization: Bearer KEY` (default: $PDD_API_KEY), named "default"
    api_keys_file: str = ""  # named keys: a TOML [keys] table of NAME = "KEY" (pdd.api.keys); also $PDD_API_KEYS
    max_running: int = 128  # requests the router drives through instances at once...
    max_waiting: int = 256  # ...and holds in the queue for a slot; past both: 429 with Retry-After

    def __post_init__(self) -> None:
        if (
            min(self.token_timeout_s, self.stall_timeout_s) <= 0
            or min(self.prefill_retries, self.handoff_reserve_tokens) < 0
        ):
            raise ValueError("timeouts must be positive; prefill_retries and handoff_reserve_tokens >= 0")
        if self.max_body_bytes < 1 or self.max_running < 1 or self.max_waiting < 0:
            raise ValueError("max_body_bytes and max_running must be at least 1, max_waiting at least 0")
        if self.advertise and not callable_at(self.advertise):
            raise ValueError(f'advertise must be "HOST:PORT", got {self.advertise!r}')

    @property
    def url(self) -> str:
        """Its HTTP base URL as others reach it."""
        host, port = parse_addr(self.advertise) if self.advertise else (self.host, self.port)
        if host in UNSPECIFIED_HOSTS:
            raise ConfigError(f'the router listens on {host!r}: give [router] advertise = "HOST:PORT"')
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True)
class LivenessSpec:
    """Heartbeats on every control connection (router <-> instance, P or RLD -> the
    decode side). A peer silent for `dead_after_s` is dropped and counted as lost: its
    requests go on through what is left or fail at once, and no new work goes to it.
    A blackholed line keeps TCP open and silent, so only heartbeats can tell."""

    __pydantic_config__ = STRICT_TABLE
    heartbeat_s: float = 1.0
    dead_after_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise ValueError("need 0 < heartbeat_s < dead_after_s")


@dataclass(frozen=True)
class TLSSpec:
    """TLS on every framed connection (`pdd.transfer.tls`); empty paths: off. Each end
    presents `cert` and verifies the other's against `ca` (`pdd cert` makes a pair)."""

    __pydantic_config__ = STRICT_TABLE
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

    __pydantic_config__ = STRICT_TABLE
    prefill: int = 1
    relay: int = 1  # pdd mode only
    main: int = 1  # main decode instances (MD)
    # One machine stands in for two datacenters: prefill instances run at this lower CPU
    # priority, as on their own hardware their long prefills would not take the CPU
    # from decoding (whose token gaps the benchmarks compare). 0: no change.
    prefill_nice: int = 10
    # what the instances run on (`pdd.names.HARDWARE`): "native", at this machine's speed;
    # "emulated", each on the spec's chip for its role (`pdd.engines.embedded.pacing`: P and RLD on
    # A, MD on B, a standalone instance on A); "A" or "B", every instance on that chip.
    # Emulated time runs `dilation` times slower than the chips, and `pdd up` stretches
    # the line and the policy's latency budget alike
    hardware: str = NATIVE
    dilation: float = 1.0

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.main < 1:
            raise ValueError("a deployment needs at least one prefill and one main instance")
        if self.relay < 0:
            raise ValueError("relay must be 0 or more")
        if not 0 <= self.prefill_nice <= 19:
            raise ValueError("prefill_nice must lie in 0..19")
        if self.hardware not in HARDWARE or not self.dilation >= 1.0:
            raise ValueError(f"hardware must be one of {', '.join(HARDWARE)}, and dilation at least 1")

    def chip(self, role: str) -> str:
        """The emulated chip a role runs on (`native` when nothing is emulated)."""
        return role_chip(self.hardware, role)


@dataclass(frozen=True)
class Deployment:
    __pydantic_config__ = STRICT_TABLE
    mode: str = Mode.PDD  # what pdd is for; the file says another to compare (`pdd demo` runs them all)
    secret: str = ""
    # the secret's file instead (a Kubernetes Secret mounted, a file only its owner reads): the
    # deployment file itself then holds nothing that must be kept secret (`load` reads it)
    secret_file: str = ""
    model: ModelSpec = ModelSpec()
    engine: EngineConfig = EngineConfig()
    line: LineSpec = LineSpec()
    policy: PolicySpec = PolicySpec()
    slo: SLOSpec = SLOSpec()
    router: RouterSpec = RouterSpec()
    liveness: LivenessSpec = LivenessSpec()
    tls: TLSSpec = TLSSpec()
    topology: TopologySpec = TopologySpec()
    instances: tuple[InstanceSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        names = [i.name for i in self.instances]
        if len(set(names)) != len(names):
            raise ValueError("instance names must be unique")

    def instance(self, name: str) -> InstanceSpec:
        for inst in self.instances:
            if inst.name == name:
                return inst
        if ranks := groups.of(self.instances, name):  # (one process per rank)
            names = ", ".join(r.name for r in ranks)
            raise ConfigError(f"{name!r} is a data-parallel group: serve each of its ranks ({names}) by its name")
        have = ", ".join(i.name for i in self.instances) or "none"
        raise ConfigError(f"[[instances]] has no name = {name!r} (it has {have})")

    def by_role(self, role: str) -> list[InstanceSpec]:
        return [i for i in self.instances if i.role == role]

    def address(self, inst: InstanceSpec, from_dc: str) -> tuple[str, int]:
        """Where a caller in `from_dc` reaches `inst`'s framed port: the address it
        advertises to that datacenter, else where it listens."""
        if from_dc in inst.advertise:
            return parse_addr(inst.advertise[from_dc])
        if inst.host in UNSPECIFIED_HOSTS:
            raise ConfigError(
                f"instance {inst.name} listens on {inst.host!r}: give it advertise.{from_dc} = "
                f'"HOST:PORT" for callers in datacenter {from_dc}'
            )
        return inst.host, inst.kv_port
