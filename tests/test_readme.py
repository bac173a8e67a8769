"""The README's quickstart ("A request in a minute"), run as written: its shell block
starts `pdd up` and sends a completion with curl, its Python block a chat completion with
the `openai` client; both answer, and the chat says where it ran."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from procs import wait_until

ROOT = Path(__file__).resolve().parents[1]


def _blocks() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## A request in a minute", 1)[1].split("\n## ", 1)[0]
    shell = re.search(r"```sh\n(.*?)```", section, re.S)
    python = re.search(r"```python\n(.*?)```", section, re.S)
    assert shell and python, section
    return shell.group(1), python.group(1)


def test_the_readmes_quickstart_runs_as_written(tmp_path):
    shell, python = _blocks()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = tmp_path / "out"
    # as a user's shell runs it, from the checkout: bash ends after the curl, `pdd up &` stays
    # behind in its process group (and holds its output, so that goes to a file, not a pipe)
    with open(out, "w") as sink:
        run = subprocess.Popen(["bash", "-euo", "pipefail", "-c", shell], cwd=ROOT, env=env, start_new_session=True,
                               stdout=sink, stderr=subprocess.STDOUT, text=True)
    try:
        assert run.wait(timeout=180) == 0, out.read_text()[-3000:]
        text = out.read_text()
        completion, _ = json.JSONDecoder().raw_decode(text[text.index('{"id":'):])  # curl's answer: no newline
        assert completion["object"] == "text_completion" and completion["choices"][0]["finish_reason"] == "length"
        assert len(completion["choices"][0]["token_ids"]) == 16 and completion["pdd"]["pipeline"], completion
        chat = subprocess.run([sys.executable, "-c", python], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        assert chat.returncode == 0, chat.stderr[-3000:]
        lines = chat.stdout.rstrip("\n").split("\n")
        assert len(lines) >= 2 and lines[-1] in ("P-RLD-MD", "P-MD", "P-RLD"), chat.stdout
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGINT)  # as Ctrl-C: pdd up stops everything it started
        try:
            wait_until(lambda: not any(" up --port 8400" in _cmdline(pid) for pid in _pids()), 30, "pdd up stops")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def _pids() -> list[str]:
    return [p.name for p in Path("/proc").iterdir() if p.name.isdigit()]


def _cmdline(pid: str) -> str:
    try:
        return (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
