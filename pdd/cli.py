"""The `pdd` command line.

Each sub-command lives in the module that owns its job; this file only wires them.
A module takes part by exposing `add_parser(subparsers) -> None` (or the function named
after a colon), which registers its parser and sets `func` (called with the parsed namespace, returning an exit code).
Modules are imported lazily so `pdd --help` stays fast and torch is loaded only by the
commands that need it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command name -> module that registers it
_COMMANDS: dict[str, str] = {
    "model": "pdd.model.cli",
    "serve": "pdd.instance.cli",
    "router": "pdd.router.cli",
    "drain": "pdd.router.drain",
    "up": "pdd.lab.deploy",
    "line": "pdd.lab.line.cli",
    "cert": "pdd.transfer.tls",
    "netns": "pdd.lab.netns.cli",
    "soak": "pdd.lab.soak.cli",
    "bench": "pdd.lab.bench.cli",
    "demo": "pdd.lab.demo",
    "sim": "pdd.lab.sim_cli",
    "plan": "pdd.lab.sim_cli:add_plan_parser",
}


# what only the lab needs (pyproject's `lab` extra): a server installed without it serves
LAB_ONLY = ("simpy", "matplotlib")

# sub-commands whose first word may be left out: `pdd bench --url U` is `pdd bench serve --url U`
_IMPLIED = {"bench": "serve"}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in _COMMANDS else None
    for name, module in _COMMANDS.items():
        if wanted is None or name == wanted:
            path, _, function = module.partition(":")
            try:
                getattr(importlib.import_module(path), function or "add_parser")(sub)
            except ModuleNotFoundError as e:
                if e.name not in LAB_ONLY:
                    raise
                _needs_the_lab(sub, name, e)
    return parser


def _needs_lab(error: ModuleNotFoundError) -> str:
    return f"needs the lab's packages (the extra pdd-serving[lab]: pip install -e '.[lab]' in a checkout): {error}"


def _needs_the_lab(sub: argparse._SubParsersAction, name: str, error: ModuleNotFoundError) -> None:
    """`name` is a lab command and the lab's packages are not installed: it says so."""
    said = _needs_lab(error)

    def refuse(_: argparse.Namespace) -> int:
        from pdd.errors import Mistake

        raise Mistake(said)

    p = sub.add_parser(name, help=f"({said})", add_help=False)
    p.set_defaults(func=refuse, engine_flags=[])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _IMPLIED and argv[1:2] and argv[1].startswith("-") and argv[1] not in ("-h", "--help"):
        argv.insert(1, _IMPLIED[argv[0]])
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not hasattr(args, "engine_flags"):  # only a command that passes flags on takes unknown ones
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if unknown:
        args.engine_flags = unknown
    from pdd.errors import Mistake

    try:
        return int(args.func(args) or 0)
    except Mistake as e:  # what the user got wrong: one line, no traceback (pdd.errors)
        print(f"pdd {args.command}: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # a lab command whose parser loaded, and whose work needs the lab
        if e.name not in LAB_ONLY:
            raise
        print(f"pdd {args.command}: {_needs_lab(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
