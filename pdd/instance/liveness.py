"""Whether an instance's engine can still serve: what `/health` and `/ready` say of it, and
what makes the instance tell its routers to plan around it.

An engine port has no liveness call of its own yet; vLLM's does: AsyncLLM's `errored` turns
true once its engine-core process is gone (vLLM watches the process). The embedded engine
runs on a thread of this process and fails a step's requests, never itself: while the
process answers, it is alive.
"""

from __future__ import annotations

WATCH_S = 1.0  # how often an instance looks (`pdd.instance.node`): a dead engine is planned around within it


def engine_failure(engine: object) -> str:
    """Why `engine` can serve nothing more; "" while it can."""
    llm = getattr(engine, "llm", None)  # the vLLM backend's AsyncLLM (pdd.engines.vllm.engine)
    if llm is not None and getattr(llm, "errored", False):
        return "its vLLM engine died (its engine-core process is gone)"
    return ""
