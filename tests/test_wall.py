"""The wall between the serving half and the lab: a server runs without the lab's packages
(pyproject's `lab` extra: simpy, matplotlib), and a lab command without them says what to
install. (import-linter's contracts in pyproject.toml hold the imports; the test command
runs it.)"""

from __future__ import annotations

import subprocess
import sys

from procs import HTTP, free_port, pdd_process

from pdd.cli import LAB_ONLY


def _without_the_lab(tmp_path) -> dict[str, str]:
    """An environment where importing a lab-only package fails as if it were not installed."""
    for name in LAB_ONLY:
        (tmp_path / f"{name}.py").write_text(f'raise ModuleNotFoundError("No module named {name!r}", name={name!r})\n')
    return {"PYTHONPATH": str(tmp_path)}


def test_a_server_runs_without_the_lab_extra(tmp_path, tiny_model_dir):
    env = _without_the_lab(tmp_path)
    check = subprocess.run([sys.executable, "-c", "import pdd.api.app, pdd.router.cli, pdd.instance.cli, "
                            "pdd.engines.embedded.runtime, pdd.engines.embedded.pacing, pdd.engines.vllm.engine; "
                            "print('imported'); "
                            "import simpy"], env=env, capture_output=True, text=True, timeout=120)
    # the serving modules imported; the lab's package alone did not (as where it is not installed)
    assert check.stdout == "imported\n" and "No module named 'simpy'" in check.stderr, check.stderr
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--model", str(tiny_model_dir), "--port", str(port), "--served-model-name", "tiny",
            "--hardware", "A"]  # (paced as an emulated chip: the performance models are serving's too)
    with pdd_process(args, f"{url}/health", env=env):
        r = HTTP.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    for command in (["plan"], ["sim", "--paper"], ["--help"]):
        out = subprocess.run([sys.executable, "-m", "pdd.cli", *command], env=env, capture_output=True, text=True,
                             timeout=120)
        assert "Traceback" not in out.stderr, out.stderr
        if command != ["--help"]:
            assert out.returncode == 2 and "pdd-serving[lab]" in out.stderr, out.stderr
