"""`pdd drain --config FILE INSTANCE`: take an instance out of a running deployment
without failing a request. The router stops planning work onto it at once, and so does
every other router of the deployment, which the instance tells; the instance finishes
what it holds and exits; the command returns when it has left."""

from __future__ import annotations

import argparse
import sys
import time

import httpx

POLL_S = 0.2


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drain", help="finish an instance's requests, then take it out of the deployment")
    p.add_argument("instance", help="instance name, or a data-parallel group's (all its ranks)")
    p.add_argument("--config", required=True, help="the deployment's TOML (its router and secret)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the instance to leave")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdd import config as cfg
    from pdd.api.auth import ADMIN_PREFIX, admin_token
    from pdd.errors import Mistake

    dep = cfg.load(args.config)
    base = dep.router.url
    if not dep.secret:
        raise Mistake(f"{args.config} has no secret: the router's admin routes take a token made from it")
    headers = {"Authorization": f"Bearer {admin_token(dep.secret)}"}
    try:
        r = httpx.post(f"{base}{ADMIN_PREFIX}instances/{args.instance}/drain", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        print(f"pdd drain: cannot reach the router at {base}: {e}", file=sys.stderr)
        return 1
    if r.status_code == 404:  # no such instance in the deployment
        raise Mistake(f"the router at {base} refused: {r.text}")
    if r.status_code != 200:
        print(f"pdd drain: the router refused: {r.status_code} {r.text}", file=sys.stderr)
        return 1
    console, start = Console(stderr=True), time.monotonic()
    with console.status(f"draining {args.instance}: finishing its requests") as status:
        while time.monotonic() - start < args.timeout:
            try:
                stats = httpx.get(f"{base}/pdd/stats", timeout=10).json()
                instances, ranks = stats["instances"], stats["groups"].get(args.instance, [args.instance])
            except (httpx.HTTPError, ValueError, KeyError) as e:
                print(f"pdd drain: cannot read the router's state: {e}", file=sys.stderr)
                return 1
            # left, as the router that drained it says; or gone, as another router of the
            # deployment says (the Service may send this poll to either): it exited (a
            # group: each of its ranks)
            left = [r for r in ranks if r in instances and instances[r]["healthy"]]
            if not left:
                print(f"{args.instance} drained and left after {time.monotonic() - start:.1f} s")
                return 0
            queued = sum(instances[r]["queued_tokens"] for r in left)
            status.update(f"draining {args.instance}: {queued} tokens of work left")
            time.sleep(POLL_S)
    print(f"pdd drain: {args.instance} has not left after {args.timeout:g} s", file=sys.stderr)
    return 1
