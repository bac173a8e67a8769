"""`pdd serve`: one instance process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path

from pdd.config import ROLES
from pdd.engine_port import EngineConfig, engine_names, engine_options, for_backend
from pdd.names import RoleName


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument(
        "--page-size",
        type=int,
        default=None,
        help=f"tokens per KV page (default {d.page_size}; vllm: {for_backend(d, 'vllm').page_size})",
    )
    p.add_argument("--num-pages", type=int, default=d.num_pages, help="KV pool size in pages")
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens, help="token budget of one engine step")
    p.add_argument("--max-running", type=int, default=d.max_running, help="most sequences computed at once")
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:N")
    p.add_argument("--dtype", default=d.dtype, choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--kv-dtype",
        default="",
        choices=("", "float32", "bfloat16", "float16"),
        help="KV pool dtype (default: --dtype)",
    )
    p.add_argument(
        "--max-requests", type=int, default=d.max_requests, help="most requests held at once; past it, new ones get 429"
    )
    p.add_argument("--engine", default=d.backend, choices=engine_names(), help="engine backend")
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one of vLLM's own engine arguments (with --engine vllm; repeatable): "
        "tensor_parallel_size=2, gpu_memory_utilization=0.85, ... (VALUE is JSON, else a string)",
    )
    p.add_argument(
        "--hardware",
        default=d.hardware,
        help="native, or an emulated accelerator (A, B): every step takes at least its time",
    )
    p.add_argument("--dilation", type=float, default=d.dilation, help="emulated time runs this many times slower")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start one instance")
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
        help="require `Authorization: Bearer KEY` on /v1/* (default: $PDD_API_KEY)",
    )
    p.add_argument(
        "--join",
        action="store_true",
        help="register with the running router of --config (an instance added to a live deployment)",
    )
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdd import config as cfg
    from pdd.model.config import ModelConfig
    from pdd.model.store import resolve_model, served_name

    d_page = EngineConfig.page_size

    logging.basicConfig(
        level=getattr(logging, os.environ.get("PDD_LOG", "INFO")),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.config:
        if not args.instance:
            raise SystemExit("pdd serve: --config needs --instance NAME")
        dep = cfg.load(args.config)
        spec = dep.instance(args.instance)
        model, name = dep.model.path, dep.model.served_name
    else:
        if args.role != RoleName.STANDALONE:
            raise SystemExit(
                f"pdd serve: role {args.role!r} is part of a deployment: use --config FILE --instance NAME"
            )
        if not args.model:
            raise SystemExit("pdd serve: --model DIR is required without --config")
        engine = for_backend(
            EngineConfig(
                args.page_size or d_page,
                args.num_pages,
                args.max_batch_tokens,
                args.max_running,
                args.device,
                args.dtype,
                args.kv_dtype,
                args.max_requests,
                hardware=args.hardware,
                dilation=args.dilation,
                vllm=engine_options(args.vllm_arg),
            ),
            args.engine,
            args.page_size is not None,
        )
        spec = cfg.InstanceSpec("standalone", "standalone", host=args.host, port=args.port, engine=engine)
        dep, model, name = None, args.model, args.served_model_name or served_name(args.model)
    try:
        model_dir = resolve_model(model)
        ModelConfig.from_dir(model_dir)
    except (FileNotFoundError, ValueError) as e:  # no such model, or one pdd cannot run: say which, no traceback
        raise SystemExit(f"pdd serve: {e}") from None
    if args.join and dep is None:
        raise SystemExit("pdd serve: --join needs --config FILE --instance NAME")
    openai_api = spec.role == RoleName.STANDALONE or args.openai_api
    asyncio.run(_serve(spec, dep, model_dir, name, args.threads, args.api_key, openai_api, args.join))
    return 0


async def _serve(
    spec, dep, model_dir: Path, name: str, threads: int, api_key: str = "", openai_api: bool = True, join: bool = False
) -> None:
    import torch
    import uvicorn
    from prometheus_client import CollectorRegistry

    from pdd.api.app import build_app
    from pdd.api.metrics import LineMetrics
    from pdd.engine_port import open_engine
    from pdd.heap import freeze_startup_heap
    from pdd.instance.join import register
    from pdd.instance.local_backend import LocalBackend
    from pdd.instance.node import Node
    from pdd.instance.roles import make_role
    from pdd.model.tokenizer import Tokenizer
    from pdd.policy.admission import Limits
    from pdd.transfer.wire import link_key

    torch.set_num_threads(threads)
    tokenizer = Tokenizer.from_dir(model_dir)
    runtime = open_engine(model_dir, spec.engine, threads, tokenizer.eos_token_ids)
    node = None
    registry = CollectorRegistry()
    if dep is not None:
        node = Node(spec, dep, runtime, link_key(dep.secret, "instances"), make_role)
        await node.start()
        role = node.role  # a prefill role measures its lines (by datacenter); the others have none
        registry.register(LineMetrics(lambda: {dc: line.estimate for dc, line in getattr(role, "lines", {}).items()}))
    # its own API holds at most what the instance may hold; the engine queues past max_running
    app = build_app(
        LocalBackend(runtime, node.stats if node else None),
        tokenizer,
        name,
        registry,
        api_key=api_key,
        openai_api=openai_api,
        admission=Limits(spec.engine.max_requests, 0),
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host=spec.host, port=spec.port, log_level="warning", timeout_graceful_shutdown=2)
    )
    if node is not None:
        node.on_drained = lambda: setattr(server, "should_exit", True)
        if join:
            node.spawn(register(dep, spec))
    freeze_startup_heap()
    try:
        await server.serve()
    finally:
        if node:
            await node.stop()
        runtime.close()
