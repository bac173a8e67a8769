"""The "vllm" engine backend: vLLM behind pdd's engine port (`engine.VllmEngine`).

This module imports nothing of vLLM, so a machine without the `pdd-serving[vllm]` extra is told
which extra to install rather than shown an import traceback.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pdd.engines.port import EngineConfig, EngineStartError

if TYPE_CHECKING:
    from pdd.engines.vllm.engine import VllmEngine


def open_vllm(model_dir: Path, config: EngineConfig, threads: int, eos_ids: frozenset[int]) -> VllmEngine:
    """vLLM over `model_dir`, with pdd's connector, events and draw; EngineStartError, in
    one line, when vLLM is not installed or refuses the model or its arguments."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        why = f"[engine] backend = \"vllm\" needs vLLM: pip install 'pdd-serving[vllm]' ({e})"
        raise EngineStartError(why) from None
    from pdd.engines.vllm.engine import VllmEngine

    try:
        return VllmEngine(model_dir, config, threads, eos_ids)
    except Exception as e:  # vLLM's reason, whatever its type (a config error, a missing kernel package)
        raise EngineStartError(f"vLLM cannot serve {model_dir}: {one_line(e)}") from e


def one_line(error: BaseException) -> str:
    """An error's reason on one line: vLLM's config errors are pydantic reports (a title
    line, then the reason) that may list hundreds of supported names after it."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    reason = next((line for line in lines if line.startswith("Value error,")), lines[-1])
    reason = reason.removeprefix("Value error,").strip()
    cut = reason.find(" Supported architectures:")
    reason = reason[:cut] if cut > 0 else reason
    return reason if len(reason) <= 400 else reason[:400] + "..."
