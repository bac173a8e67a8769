"""The engine port: everything an instance asks of the engine that computes for it.

The instance roles (prefill, relay, main decode, standalone), the benchmarks and the
calibration reach an engine only through `EnginePort`, and build one only through
`open_engine`, which picks the implementation named by `[engine] backend` from a
small registry (`register_engine`). So another engine (vLLM on GPUs, through its KV
connector and prefix cache) sits behind the same router, policies and wire protocol.
Every type and error that crosses the port is defined here; KV crosses as
`pdd.kv.codec.KVBlob`, the project's engine-neutral layout (token-major
`[layers, tokens, kv_heads, head_dim]` with chained block hashes), which each engine
converts to and from its own pages.

This module imports no torch: deployment files are parsed (`EngineConfig`) by
processes that never load a model.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from pdd.names import CHIPS, NATIVE
from pdd.sampling.params import Logprob, SamplingParams

if TYPE_CHECKING:
    from pdd.kv.codec import KVBlob
    from pdd.kv.layer_stream import LayerStream

CacheListener = Callable[[int, str, list[int]], None]  # (event number, "stored" / "removed", block hashes)


AUTO = 0  # a size the engine chooses itself ("auto" in a file or on the command line)
AUTO_SIZES = ("num_pages", "max_batch_tokens", "max_running")
SIZES_ITSELF = frozenset({"vllm"})  # backends that size their own pool and budgets (AUTO allowed)
SELF_SIZED = (*AUTO_SIZES, "dtype")  # what such a backend chooses itself unless told


def left_to_engine(value: object) -> bool:
    """Whether an `[engine]` value is the engine's own choice (AUTO, or "auto" for the dtype)."""
    return value in (AUTO, "auto")


def devices(device: str) -> list[str]:
    """The devices of one instance: "cpu", or each CUDA device of "cuda", "cuda:N" or
    "cuda:N,M,..." ("cuda" alone: whatever CUDA_VISIBLE_DEVICES or the machine gives)."""
    if device == "cpu" or device == "cuda":
        return [device]
    kind, sep, ids = device.partition(":")
    parts = ids.split(",")
    if kind != "cuda" or not sep or not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"engine device must be cpu, cuda, cuda:N or cuda:N,M,... (distinct), not {device!r}")
    return [f"cuda:{p}" for p in parts]


def read_auto(table: dict[str, Any]) -> dict[str, Any]:
    """An `[engine]` table (or command-line values) with "auto" sizes as AUTO."""
    return {k: AUTO if k in AUTO_SIZES and v == "auto" else v for k, v in table.items()}


@dataclass(frozen=True)
class EngineConfig:
    """One engine's sizes and numerics: the `[engine]` table."""

    # how pydantic checks the table (`pdd.config`): unknown keys and loose types refused
    __pydantic_config__ = {"extra": "forbid", "strict": True, "allow_inf_nan": False}
    page_size: int = 16  # tokens per KV page
    # KV pool size; AUTO (0, "auto" in a file or on the command line): the engine sizes it
    # from its memory budget and reports what it chose (vLLM; the embedded engine needs a number)
    num_pages: int = 2048
    max_batch_tokens: int = 2048  # token budget of one step (chunked prefill above it); AUTO: the engine's default
    max_running: int = 64  # most sequences computed at once; AUTO: the engine's default
    # cpu, cuda, cuda:N, or cuda:N,M,...: the devices of one instance (tensor and pipeline
    # parallel ranks take them in order)
    device: str = "cpu"
    dtype: str = "float32"  # "auto" (vLLM only): the checkpoint's, as vLLM reads it
    kv_dtype: str = ""  # KV pool dtype; empty: same as dtype
    # most requests an instance holds at once (computing, queued, or moving KV); past
    # this it refuses new ones as busy
    max_requests: int = 256
    backend: str = "embedded"  # the implementation (`register_engine`)
    # vLLM's own engine arguments (`AsyncEngineArgs` fields: tensor_parallel_size, gpu_memory_utilization,
    # ...), passed through when backend = "vllm": the `[engine.vllm]` table, or `pdd serve --vllm-arg`
    vllm: dict[str, Any] = field(default_factory=dict)
    # "native": steps take what this machine takes; "A" / "B": at least what that chip of
    # the simulator's catalog would (`pdd.engines.embedded.pacing`), `dilation` times slower
    # ("emulated" is resolved to a chip by role before it gets here: `pdd.names.role_chip`)
    hardware: str = NATIVE
    dilation: float = 1.0

    def __post_init__(self) -> None:
        for name in ("page_size", "max_requests", *AUTO_SIZES):
            value = getattr(self, name)
            if value == AUTO and name in AUTO_SIZES and self.backend in SIZES_ITSELF:
                continue
            if value < 1:
                auto = f' or "auto" on {", ".join(sorted(SIZES_ITSELF))}' if name in AUTO_SIZES else ""
                raise ValueError(f"engine {name} must be at least 1{auto}, not {value}")
        if self.dtype == "auto" and self.backend not in SIZES_ITSELF:
            raise ValueError(f'engine dtype "auto" is vLLM\'s; the {self.backend} engine needs a dtype')
        devices(self.device)  # (ValueError for a malformed list)
        if self.hardware not in (NATIVE, *CHIPS):
            raise ValueError(f"engine hardware must be {NATIVE} or a chip ({', '.join(CHIPS)}), not {self.hardware!r}")
        if not self.dilation >= 1.0:
            raise ValueError("engine dilation must be at least 1 (emulated time runs slower, never faster)")


class RequestError(ValueError):
    """A request this engine can never serve as asked (too long, a duplicate id, not
    reserved, tokens out of the vocabulary): the caller's mistake, not load."""


class EngineStartError(RuntimeError):
    """The engine cannot start with this model or these settings; the message is one line
    that says why (a missing extra, a checkpoint the engine refuses)."""


@dataclass(frozen=True)
class StepOutput:
    """What one engine step did for one request."""

    rid: str
    token: int | None  # the token sampled this step, if any
    finish_reason: str | None  # "stop", "length", or "abort" (stopped from outside)
    cached_tokens: int = 0  # prompt tokens this request found in the prefix cache
    position: int = -1  # output position of `token` (0: the first generated token)
    caught_up: int | None = None  # a shadow request computed every given token: how many outputs it holds
    # the engine step that made this output, counted by the engine; -1 where a backend cannot
    # say (vLLM merges a request's outputs that its reader has not taken yet)
    step: int = -1
    logprob: Logprob | None = None  # `token`'s, where the request asks (`SamplingParams.logprobs`)
    # with the first token, each prompt token's (the first's None), where the request asks
    # (`SamplingParams.prompt_logprobs`)
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    max_running: int
    pages: int
    free_pages: int
    cached_pages: int  # held by the prefix cache only: evictable


class OutputStream(Protocol):
    """One request's step outputs (tokens, its finish, catch-up progress), in order."""

    def __aiter__(self) -> AsyncIterator[StepOutput]: ...

    def close(self) -> None: ...


class EnginePort(Protocol):
    """What every engine promises. Commands about one request take effect in the order
    they are issued. A request is known by its id from `generate` or `reserve` until
    it finishes (and, with `hold`, until `release`). Aborting a request that is not
    there is not an error."""

    page_size: int
    max_context: int  # prompt + output tokens one request may hold
    kv_bytes_per_token: int  # of this engine's KV, as exported

    def generate(
        self, rid: str, prompt: list[int], params: SamplingParams, hold: bool = False, stream: LayerStream | None = None
    ) -> AsyncIterator[StepOutput]:
        """Run a request from its prompt (reusing the prefix cache) and stream its outputs;
        leaving the stream early aborts it. With `hold`, its KV stays put after it
        finishes, for `export_kv`, until `release`. With `stream`, each layer's KV of the
        prompt tokens this run computes is put on it as soon as that layer is computed,
        before the outputs that follow that step (what the prefix cache served is not:
        `LayerStream.first`); the caller closes it. RequestError if it can never run."""

    def watch(self, rid: str) -> OutputStream:
        """Subscribe to a reserved request's outputs; call before `start`, so none is missed."""

    async def reserve(self, rid: str, prompt: list[int], params: SamplingParams, use_cache: bool = True) -> int:
        """Make room for a request whose prompt KV will be imported: lock the longest
        cached prefix (with `use_cache`; at least the last prompt token is left out)
        and take pages for the rest of the prompt now, so every import that follows
        fits. Returns the cached length in tokens. OutOfPages when the pool cannot hold
        the prompt now (nothing is kept); RequestError if it never could."""

    async def cached_prefix(self, tokens: list[int], salt: str = "") -> int:
        """Tokens of this prompt the prefix cache holds now in `salt`'s namespace
        (`SamplingParams.cache_salt`); nothing is locked."""

    async def import_kv(self, rid: str, blob: KVBlob) -> None:
        """Write KV into a reserved request exactly where its computed part ends (the
        block hashes must match its prompt). Ranges follow each other; the last
        prompt token may be left for `start`."""

    async def export_kv(self, rid: str, start: int, end: int) -> KVBlob:
        """KV of tokens [start, end) of a running or held request (all layers)."""

    async def start(self, rid: str, tokens: list[int], shadow: bool = False, step_cap: int = 0) -> int:
        """Extend a reserved request by output tokens others produced and decode on:
        everything not yet computed (the last prompt token, then `tokens`) is computed,
        at most `step_cap` tokens a step (0: the step budget), and the next token
        sampled. With `shadow` (a catch-up chunk, or a fill) the tokens are computed
        but nothing is sampled: the request reports `caught_up` and waits for more.
        A later `start` without `shadow` ends the catch-up. Returns the request's
        cached prompt tokens."""

    async def cut(self, rid: str) -> list[int]:
        """Stop a request now (a relay handing it over) and return its output; watchers
        see an "abort" finish; its KV goes to the prefix cache. RequestError if it has
        already finished."""

    async def release(self, rid: str) -> None:
        """Let go of a held or reserved request: its computed KV stays in the prefix cache."""

    def abort(self, rid: str) -> None:
        """Stop a request from anywhere without waiting; watchers see an "abort" finish."""

    async def cache_snapshot(self) -> tuple[int, list[int]]:
        """Every cached block hash, with the number of the last cache event included."""

    def set_cache_listener(self, listener: CacheListener) -> None:
        """Called (on the caller's loop) for every cache event, numbered in order."""

    def load(self) -> EngineLoad: ...

    def stats(self) -> dict: ...

    def metric_collectors(self) -> list[Any]:
        """Prometheus collectors of the engine's own series, served beside pdd's on the
        instance's /metrics under their own names (vLLM's `vllm:*`); [] where pdd's are all."""

    def close(self) -> None:
        """Stop the engine; nothing may be called after."""


# ---- the registry ------------------------------------------------------------------------
# backend name -> "module:function"; the function takes (model_dir, config, threads,
# eos_ids) and returns a running EnginePort. Imported only when used: the router and
# the CLI never load an engine they do not run.
EngineFactory = Callable[[Path, EngineConfig, int, frozenset[int]], EnginePort]
_ENGINES: dict[str, str] = {}
_PAGE_SIZES: dict[str, int] = {}  # a backend's own default page size, where pdd's does not suit it


def register_engine(name: str, target: str, page_size: int | None = None) -> None:
    """Make `[engine] backend = name` build engines with `target` ("module:function",
    imported when an engine is opened); `page_size`: the page size it runs when none is
    chosen. A name taken already is an error (as vLLM's connector factory has it)."""
    if name in _ENGINES:
        raise ValueError(f"engine backend {name!r} is registered already ({_ENGINES[name]})")
    _ENGINES[name] = target
    if page_size is not None:
        _PAGE_SIZES[name] = page_size


def for_backend(config: EngineConfig, backend: str, chosen: Collection[str] = ()) -> EngineConfig:
    """`config` run by `backend`, its defaults that backend's where pdd's would not suit
    it; pdd's own defaults are no choice, the fields named in `chosen` and any value
    other than pdd's default are. A backend that sizes itself (vLLM) takes its own pool,
    budgets and dtype (AUTO, "auto"); another keeps the pool's token capacity in its
    own page size. (A table that inherits AUTO from a self-sizing backend's is read
    without it: `pdd.config.instance_from_dict`.)"""
    d, changes = EngineConfig(), dict[str, Any]()
    fields = ("page_size", *SELF_SIZED)
    unchosen = {f for f in fields if f not in chosen and getattr(config, f) == getattr(d, f)}
    page = _PAGE_SIZES.get(backend)
    if page is not None and "page_size" in unchosen:
        changes["page_size"] = page
        if config.num_pages != AUTO:
            changes["num_pages"] = max(1, config.num_pages * config.page_size // page)
    if backend in SIZES_ITSELF:
        changes.update({f: AUTO for f in AUTO_SIZES if f in unchosen})
        if "dtype" in unchosen:
            changes["dtype"] = "auto"
    return replace(config, backend=backend, **changes)


def engine_options(pairs: list[str]) -> dict[str, Any]:
    """`KEY=VALUE` command-line pairs as an engine's own arguments (VALUE read as JSON,
    else taken as a string): `pdd serve --vllm-arg tensor_parallel_size=2`."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def engine_names() -> list[str]:
    return sorted(_ENGINES)


def open_engine(
    model_dir: str | Path, config: EngineConfig, threads: int = 1, eos_ids: frozenset[int] = frozenset()
) -> EnginePort:
    """A running engine of `config.backend` over the model in `model_dir`."""
    target = _ENGINES.get(config.backend)
    if target is None:
        raise ValueError(f"unknown engine backend {config.backend!r}; have {engine_names()}")
    module, _, function = target.partition(":")
    factory: EngineFactory = getattr(importlib.import_module(module), function)
    return factory(Path(model_dir), config, threads, eos_ids)


register_engine("embedded", "pdd.engines.embedded.runtime:open_embedded")
# the `pdd[vllm]` extra; vLLM's CPU attention takes blocks of a multiple of 32 tokens
register_engine("vllm", "pdd.engines.vllm:open_vllm", page_size=32)
