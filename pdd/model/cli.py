"""`pdd model init DIR`: write the deterministic tiny model for tests, demos and benches."""

from __future__ import annotations

import argparse

_SIZE_OPTIONS = (
    ("--layers", "layers", 4),
    ("--hidden", "hidden", 256),
    ("--heads", "heads", 4),
    ("--kv-heads", "kv_heads", 2),
    ("--intermediate", "intermediate", 768),
    ("--vocab-size", "vocab_size", 4096),
    ("--max-position", "max_position", 4096),
    ("--seed", "seed", 0),
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `model` and its `init` sub-command on the top-level parser."""
    model = sub.add_parser("model", help="create model directories")
    actions = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = actions.add_parser(
        "init",
        help="write the deterministic tiny Llama model (same arguments, same bytes)",
    )
    init.add_argument("dir", help="output directory (created if missing)")
    for flag, dest, default in _SIZE_OPTIONS:
        init.add_argument(flag, dest=dest, type=int, default=default, help=f"default {default}")
    init.set_defaults(func=_init)


def _init(args: argparse.Namespace) -> int:
    # Imported here so `pdd --help` does not pay for torch.
    from pdd.model.tiny import make_tiny, parameter_count

    out = make_tiny(args.dir, **{dest: getattr(args, dest) for _, dest, _ in _SIZE_OPTIONS})
    print(f"wrote tiny model to {out} ({parameter_count(out):,} parameters)")
    return 0
