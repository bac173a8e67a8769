"""`pdd serve`: one instance process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

from pdd.config import ROLES
from pdd.engines.port import AUTO, EngineConfig, engine_names, engine_options, for_backend
from pdd.errors import Mistake
from pdd.names import HARDWARE, HARDWARE_HELP, REASONING_PARSERS, TOOL_PARSERS, RoleName, role_chip
from pdd.shutdown import DEFAULT_GRACE_S, add_grace_flag

PASS_THROUGH: list[str] = []  # (`pdd.cli` hands a command that takes them its unknown flags here)


def _size(value: str) -> int:
    return AUTO if value == "auto" else int(value)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The `[engine]` table as flags; each defaults to None, so what was given is known
    (the backend's defaults apply to the rest: `for_backend`)."""
    d, v = EngineConfig(), for_backend(EngineConfig(), "vllm")
    p.add_argument("--page-size", type=int, help=f"tokens per KV page (default {d.page_size}; vllm: {v.page_size})")
    p.add_argument("--num-pages", type=_size, help=f"KV pool size in pages (default {d.num_pages}; vllm: auto)")
    p.add_argument(
        "--max-batch-tokens", type=_size, help=f"token budget of one engine step ({d.max_batch_tokens}; vllm: auto)"
    )
    p.add_argument("--max-running", type=_size, help=f"most sequences computed at once ({d.max_running}; vllm: auto)")
    p.add_argument("--device", help=f"cpu, cuda, cuda:N or cuda:N,M,... (one per parallel rank) (default {d.device})")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="(default float32; vllm: auto)")
    p.add_argument("--kv-dtype", choices=("float32", "bfloat16", "float16"), help="KV pool dtype (default: --dtype)")
    p.add_argument("--max-requests", type=int, help=f"most requests held at once; past it, 429 ({d.max_requests})")
    p.add_argument("--engine", dest="backend", choices=engine_names(), help=f"engine backend (default {d.backend})")
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one of vLLM's own engine arguments (with --engine vllm; repeatable), as its Python name: "
        "tensor_parallel_size=2 (VALUE is JSON, else a string); vLLM's own flags also pass as vLLM spells them "
        "(--tensor-parallel-size 2, --kv-cache-dtype fp8, --enforce-eager)",
    )
    p.add_argument("--hardware", choices=HARDWARE, help=HARDWARE_HELP)
    p.add_argument("--dilation", type=float, help="emulated time runs this many times slower")


# the `[engine]` table's fields that are flags of their own (its vLLM table is vLLM's flags)
ENGINE_FLAGS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "vllm")


def engine_from_flags(args: argparse.Namespace) -> EngineConfig:
    """The engine the flags describe: pdd's defaults, the chosen backend's where pdd's are
    no choice, vLLM's own flags in its table (ValueError naming a bad one)."""
    given = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if "hardware" in given:  # "emulated": the chip of this instance's role
        given["hardware"] = role_chip(given["hardware"], args.role)
    backend = given.pop("backend", EngineConfig.backend)
    vllm = {**engine_options(args.vllm_arg), **vllm_flags(args.engine_flags, check=backend == "vllm")}
    if vllm and backend != "vllm":
        raise ValueError(f"{sorted(vllm)} are vLLM's engine arguments: add --engine vllm")
    return for_backend(EngineConfig(**given, backend=backend, vllm=vllm), backend, given)


def vllm_flags(flags: list[str], check: bool = True) -> dict[str, Any]:
    """vLLM's engine flags as vLLM spells them (`--tensor-parallel-size 2`, `--x=y`,
    `--enforce-eager`, `--no-enable-chunked-prefill`) as its engine arguments; with `check`,
    a name that is not one of vLLM's is refused by name (where vLLM is installed to say)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        flag = flags[i]
        if flag.startswith("-") and not flag.startswith("--"):
            raise ValueError(f"{flag!r}: give vLLM's flags by their long names (--tensor-parallel-size, not -tp)")
        if not flag.startswith("--") or len(flag) < 3:
            raise ValueError(f"unrecognized argument {flag!r} (put the model first: pdd serve MODEL --flag VALUE)")
        name, sep, value = flag[2:].partition("=")
        if not sep and i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value, sep, i = flags[i + 1], "=", i + 1
        key = name.replace("-", "_")
        if not sep and key.startswith("no_"):
            out[key[3:]] = False
        else:
            out[key] = engine_options([f"{key}={value}"])[key] if sep else True
        i += 1
    known = _vllm_argument_names() if check and out else None
    unknown = sorted(k for k in out if known is not None and k not in known)
    if unknown:
        names = ["--" + k.replace("_", "-") for k in unknown]
        raise ValueError(f"unknown engine flag(s) {names} (neither pdd's nor vLLM's)")
    return out


def _vllm_argument_names() -> set[str] | None:
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError:
        return None
    return {f.name for f in dataclasses.fields(AsyncEngineArgs)}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="start one instance",
        usage="pdd serve [MODEL] [options] [vLLM engine flags]",
        description="Start one instance. MODEL (first, as --model) is a Hugging Face-layout directory or a "
        "hub name. With --engine vllm, vLLM's own engine flags pass through as vLLM spells them: "
        "pdd serve MODEL --engine vllm --tensor-parallel-size 2 --kv-cache-dtype fp8",
    )
    p.add_argument("--role", choices=ROLES, default=RoleName.STANDALONE)
    p.add_argument(
        "--model",
        help="Hugging Face-layout model directory, or a hub name (ORG/NAME) in the local "
        "Hugging Face cache ($HF_HOME; offline)",
    )
    p.add_argument("--config", help="deployment TOML (with --instance): serve that instance")
    p.add_argument("--instance", help="instance name in --config")
    p.add_argument(
        "--served-model-name", default=None, help="model id in the API (default: the hub name, or the directory's name)"
    )
    p.add_argument(
        "--reasoning-parser",
        help="move a chat completion's thinking into `reasoning`: any of vLLM's names where vLLM is installed "
        f"(its own parser runs), else {', '.join(REASONING_PARSERS)} (default: none)",
    )
    p.add_argument(
        "--tool-call-parser",
        help="read a chat completion's tool calls out of its text: any of vLLM's names where vLLM is installed "
        f"(its own parser runs), else {', '.join(TOOL_PARSERS)} (default: the one the chat template teaches, "
        "where pdd knows it)",
    )
    p.add_argument(
        "--tool-parser-plugin",
        help="a file or module registering an out-of-tree tool parser with vLLM's ToolParserManager, as vLLM's flag",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--threads", type=int, default=1, help="torch threads for this instance")
    p.add_argument(
        "--openai-api",
        action="store_true",
        help="serve the OpenAI API on a prefill, relay or main instance too (off by default: requests "
        "reach those through the router)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("PDD_API_KEY", ""),
        help='require `Authorization: Bearer KEY` on /v1/* (default: $PDD_API_KEY); named "default"',
    )
    p.add_argument(
        "--api-keys-file",
        default="",
        help='named API keys: a TOML file with a [keys] table of NAME = "KEY" (also: $PDD_API_KEYS, '
        "NAME=KEY,...); the names label the per-key counters and the access log",
    )
    p.add_argument(
        "--join",
        action="store_true",
        help="register with the running router of --config (an instance added to a live deployment)",
    )
    add_engine_arguments(p)
    add_grace_flag(p)
    p.set_defaults(func=run, engine_flags=PASS_THROUGH)


def run(args: argparse.Namespace) -> int:
    from pdd import config as cfg
    from pdd.api.keys import api_keys
    from pdd.model.config import ModelConfig
    from pdd.model.store import resolve_model, served_name
    from pdd.process import configure, listen

    configure()
    args.engine_flags = list(args.engine_flags)
    if args.engine_flags and not args.engine_flags[0].startswith("-"):  # pdd serve MODEL ..., as vllm serve
        positional = args.engine_flags.pop(0)
        if args.model and positional != args.model:
            raise Mistake(f"two models given ({positional!r} and --model {args.model!r})")
        args.model = positional
    if args.config:
        if not args.instance:
            raise Mistake("--config needs --instance NAME")
        ignored = [f"--{k.replace('_', '-')}" for k in ENGINE_FLAGS if getattr(args, k) is not None]
        ignored += [f"--vllm-arg {a}" for a in args.vllm_arg] + list(args.engine_flags)
        ignored += ["MODEL"] if args.model else []
        if ignored:
            raise Mistake(
                f"{' '.join(ignored)} would be ignored with --config: the instance's [engine] "
                "table and [model] in the file say them"
            )
        dep = cfg.load(args.config)
        try:
            spec = dep.instance(args.instance)
        except cfg.ConfigError as e:
            raise Mistake(f"{args.config}: {e}") from None
        model, name = dep.model.path, dep.model.served_name
    else:
        if args.role != RoleName.STANDALONE:
            raise Mistake(f"role {args.role!r} is part of a deployment: use --config FILE --instance NAME")
        if not args.model:
            raise Mistake("a model is required without --config (pdd serve MODEL, or --model DIR)")
        try:
            engine = engine_from_flags(args)
            cfg.check_devices(engine, "engine")
        except ValueError as e:  # a flag's value (ConfigError is one)
            raise Mistake(str(e)) from None
        spec = cfg.InstanceSpec("standalone", "standalone", host=args.host, port=args.port, engine=engine)
        dep, model, name = None, args.model, args.served_model_name or served_name(args.model)
    try:
        model_dir = resolve_model(model)
        if spec.engine.backend == "embedded":  # (the embedded engine's own gate; vLLM reads the model itself)
            ModelConfig.from_dir(model_dir)
    except (FileNotFoundError, ValueError) as e:  # no such model, or one pdd cannot run: say which, no traceback
        raise Mistake(str(e)) from None
    if args.join and dep is None:
        raise Mistake("--join needs --config FILE --instance NAME")
    keys = api_keys(args.api_key, args.api_keys_file)
    openai_api = spec.role == RoleName.STANDALONE or args.openai_api
    sock = listen(spec.host, spec.port)  # before the model loads: a port in use fails in a second, not minutes
    parsers = (
        (dep.model.reasoning_parser, dep.model.tool_parser, dep.model.tool_parser_plugin)
        if dep is not None
        else (args.reasoning_parser or "", args.tool_call_parser or "", args.tool_parser_plugin or "")
    )
    grace_s = args.shutdown_grace_s
    asyncio.run(_serve(spec, dep, model_dir, name, args.threads, sock, keys, openai_api, args.join, parsers, grace_s))
    return 0


def _exit_gracefully(server, source, node, grace_s: float) -> None:
    """The HTTP server, SIGTERM as `pdd.shutdown` takes it: its own API and the routers get no
    new work (each router hears it and plans around), what it holds finishes, then it exits.
    Held means the node's requests (for a P/D instance) and its own API's streams; quiet for
    `DRAIN_QUIET_S`, as a drain waits, since work planned just before may still be on its way."""
    from pdd.instance.node import DRAIN_QUIET_S
    from pdd.shutdown import GracefulExit

    def begin() -> None:
        source.close_admission()
        if node is not None:
            node.refuse_work("shutting down")

    def idle() -> bool:
        return source.in_flight == 0 and (node is None or node.quiet_for() >= DRAIN_QUIET_S)

    GracefulExit(server, grace_s, begin, idle, source.expire)


async def _serve(
    spec,
    dep,
    model_dir: Path,
    name: str,
    threads: int,
    sock: socket.socket,
    keys: dict[str, str],
    openai_api: bool = True,
    join: bool = False,
    parsers: tuple[str, str, str] = ("", "", ""),
    grace_s: float = DEFAULT_GRACE_S,
) -> None:
    """`parsers`: the names of the reasoning and the tool-call parser ("": none, the
    template's) and a tool-parser plugin's path (`pdd.api.parsers`)."""
    import torch
    import uvicorn
    from prometheus_client import CollectorRegistry

    from pdd.api.app import build_app
    from pdd.api.metrics import LineMetrics
    from pdd.api.parsers import Parsers, choose_parsers
    from pdd.engines.port import EngineStartError, open_engine
    from pdd.heap import freeze_startup_heap
    from pdd.instance.join import register
    from pdd.instance.local_source import LocalSource
    from pdd.instance.node import InstanceNode
    from pdd.instance.roles import make_role
    from pdd.model.tokenizer import Tokenizer
    from pdd.policy.admission import Limits
    from pdd.transfer.wire import connection_key

    torch.set_num_threads(threads)
    tokenizer = Tokenizer.from_dir(model_dir)
    # (a parser name nobody knows fails here, before the model loads)
    chosen = choose_parsers(*parsers, model_dir, tokenizer.chat_template) if openai_api else Parsers()
    try:
        runtime = open_engine(model_dir, spec.engine, threads, tokenizer.eos_token_ids)
    except EngineStartError as e:  # not a mistake in what was given (exit 1): the engine could not start
        raise SystemExit(f"pdd serve: {e}") from None
    node = None
    registry = CollectorRegistry()
    for collector in runtime.metric_collectors():  # the engine's own series (vLLM's vllm:*)
        registry.register(collector)
    if dep is not None:
        node = InstanceNode(spec, dep, runtime, connection_key(dep.secret, "instances"), make_role)
        await node.start()
        role = node.role  # a prefill role measures its lines (by datacenter); the others have none
        registry.register(LineMetrics(lambda: {dc: line.estimate for dc, line in getattr(role, "lines", {}).items()}))
    source = LocalSource(runtime, node.stats if node else None, (lambda: node.refusing) if node else lambda: "")
    # its own API holds at most what the instance may hold; the engine queues past max_running
    app = build_app(
        source,
        tokenizer,
        name,
        registry,
        api_keys=keys,
        openai_api=openai_api,
        admission=Limits(spec.engine.max_requests, 0),
        parsers=chosen,
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host=spec.host, port=spec.port, log_level="warning", timeout_graceful_shutdown=2)
    )
    _exit_gracefully(server, source, node, grace_s)
    if node is not None:
        node.on_drained = lambda: setattr(server, "should_exit", True)
        if join:
            node.spawn(register(dep, spec))
    freeze_startup_heap()
    try:
        await server.serve(sockets=[sock])
    finally:
        if node:
            await node.stop()
        runtime.close()
