"""`pdd router --config FILE`: the OpenAI API in front of a deployment."""

from __future__ import annotations

import argparse
import asyncio
import os

from pdd.shutdown import add_grace_flag


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="start the router of a deployment")
    p.add_argument("--config", required=True, help="deployment TOML with its instances")
    p.add_argument("--port", type=int, default=None, help="override [router] port")
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/* (default: [router] api_key, else $PDD_API_KEY)",
    )
    p.add_argument(
        "--api-keys-file",
        default=None,
        help='named API keys: a TOML file with a [keys] table of NAME = "KEY" (default: [router] '
        "api_keys_file; also $PDD_API_KEYS, NAME=KEY,...)",
    )
    add_grace_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from pdd import config as cfg
    from pdd.api.keys import api_keys
    from pdd.errors import Mistake
    from pdd.process import configure, listen

    configure()
    dep = cfg.load(args.config)
    if args.port is not None:
        dep = replace(dep, router=replace(dep.router, port=args.port))
    key = args.api_key if args.api_key is not None else dep.router.api_key or os.environ.get("PDD_API_KEY", "")
    keys_file = args.api_keys_file if args.api_keys_file is not None else dep.router.api_keys_file
    dep = replace(dep, router=replace(dep.router, api_key=key, api_keys_file=keys_file))
    keys = api_keys(key, keys_file)
    if not dep.instances:
        raise Mistake("the config lists no [[instances]]")
    if not dep.secret:
        raise Mistake("the config has no secret; instances authenticate every frame with it")
    sock = listen(dep.router.host, dep.router.port)  # before the model's tokenizer loads
    asyncio.run(_serve(dep, sock, keys, args.shutdown_grace_s))
    return 0


async def _serve(dep, sock, keys: dict[str, str], grace_s: float) -> None:
    import uvicorn
    from prometheus_client import CollectorRegistry

    from pdd.api.app import build_app
    from pdd.api.parsers import choose_parsers
    from pdd.heap import freeze_startup_heap
    from pdd.model.config import Declared
    from pdd.model.store import resolve_model
    from pdd.model.tokenizer import Tokenizer
    from pdd.policy.admission import Limits
    from pdd.router.admin import add_admin_routes
    from pdd.router.source import RouterSource
    from pdd.shutdown import GracefulExit

    model_dir = resolve_model(dep.model.path)
    tokenizer = Tokenizer.from_dir(model_dir)
    model = dep.model  # (a parser name nobody knows fails here, before the router starts)
    parsers = choose_parsers(
        model.reasoning_parser, model.tool_parser, model.tool_parser_plugin, model_dir, tokenizer.chat_template
    )
    registry = CollectorRegistry()
    source = RouterSource(dep, registry)
    source.max_context = Declared.from_dir(model_dir).max_position  # (each instance's own limit as it reports it)
    await source.start()
    app = build_app(
        source,
        tokenizer,
        dep.model.served_name,
        registry,
        dep.router.max_body_bytes,
        keys,
        admission=Limits(dep.router.max_running, dep.router.max_waiting),
        parsers=parsers,
    )
    add_admin_routes(app, source.members, dep)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=dep.router.host, port=dep.router.port, log_level="warning", timeout_graceful_shutdown=2
        )
    )
    GracefulExit(server, grace_s, source.close_admission, lambda: source.in_flight == 0, source.expire)
    freeze_startup_heap()
    try:
        await server.serve(sockets=[sock])
    finally:
        await source.stop()
