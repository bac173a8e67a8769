"""Which launch a pdd server process belongs to, as its `/health` says.

`pdd up` waits for each child's `/health`; a port held by another server (vLLM's API
server on 8000, a deployment left running) would answer it too, and `pdd up` would take
that server for its own router or instance. So `pdd up` gives its children a launch id
in their environment, every pdd server's `/health` says it back with its pid, and a
`/health` that answers without it is someone else's.
"""

from __future__ import annotations

import os

LAUNCH_ENV = "PDD_LAUNCH_ID"  # set by `pdd up` for the processes it starts


def identity() -> dict[str, object]:
    """What a pdd server's `/health` says of its process."""
    return {"pid": os.getpid(), "launch": os.environ.get(LAUNCH_ENV, "")}
