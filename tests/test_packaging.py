"""The packaging files, each checked by the validator its ecosystem uses: the systemd
units by `systemd-analyze verify`, the Dockerfile by `hadolint`, the Prometheus files by
`promtool` (the Kubernetes overlays: tests/test_kubernetes.py; the alerts firing:
tests/test_alerts.py). Each validator is first shown to refuse a file broken on purpose,
so a pass means something. What could not run here (building and running the image, a
cluster) is said in docs/deployment.md."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent


def _run(*cmd: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=120)


def _clean(out: subprocess.CompletedProcess) -> bool:
    """Exit 0 and not a word on stderr (systemd-analyze warns, and exits 0, on a key it ignores)."""
    return out.returncode == 0 and not out.stderr.strip()


# ---- systemd -----------------------------------------------------------------------------------

def _verify_units(units: dict[str, str], tmp: Path) -> subprocess.CompletedProcess:
    """`systemd-analyze verify` of `units` (file name -> text) as installed in a root of their
    own: this host's unit library, pdd at /opt/pdd/bin/pdd (an executable stand-in)."""
    root = tmp / "root"
    shutil.copytree("/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for name, text in units.items():
        (root / "etc/systemd/system" / name).write_text(text)
    pdd = root / "opt/pdd/bin/pdd"
    pdd.parent.mkdir(parents=True)
    pdd.write_text("#!/bin/sh\n")
    pdd.chmod(0o755)
    return _run("systemd-analyze", "verify", "--man=no", f"--root={root}", "pdd-serve@p0.service", "pdd-router.service")


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="Debian's systemd (scripts/test.sh installs it)")
def test_the_systemd_units_verify(tmp_path):
    units = {p.name: p.read_text() for p in (DEPLOY / "systemd").glob("*.service")}
    assert set(units) == {"pdd-serve@.service", "pdd-router.service"}
    out = _verify_units(units, tmp_path / "good")
    assert _clean(out), out.stderr
    breaks = {"pdd-serve@.service": ("Type=exec", "Type=exek"),
              "pdd-router.service": ("ExecStart=/opt/pdd/bin/pdd", "ExecStart=/opt/pdd/bin/pdx")}
    for unit, (was, broken) in breaks.items():
        assert was in units[unit]
        out = _verify_units({**units, unit: units[unit].replace(was, broken)}, tmp_path / unit)
        assert not _clean(out), f"systemd-analyze took {unit} with {broken}"
    assert "--config /etc/pdd/deployment.toml --instance %i" in units["pdd-serve@.service"]


# ---- the image ---------------------------------------------------------------------------------

def test_the_dockerfile_lints_clean(tmp_path):
    out = _run(BIN / "hadolint", ROOT / "Dockerfile")
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr
    text = (ROOT / "Dockerfile").read_text()
    broken = tmp_path / "Dockerfile"
    broken.write_text(text.replace("pip install --no-cache-dir", "pip install", 1))
    assert _run(BIN / "hadolint", broken).returncode != 0
    assert 'VARIANT" = cuda' in text and 'VARIANT" = cpu' in text  # both variants from one file
    assert '"torch==2.13.0"' in text and ".[vllm]" in text and ".[vllm-cuda]" in text


# ---- Prometheus --------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("promtool") is None, reason="Debian's prometheus (scripts/test.sh installs it)")
def test_promtool_checks_the_rules_and_the_scrape_config(tmp_path):
    rules = DEPLOY / "prometheus" / "alerts.yml"
    out = _run("promtool", "check", "rules", rules)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    conf = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text()) | {"rule_files": [str(rules)]}
    (tmp_path / "p.yml").write_text(yaml.safe_dump(conf))
    out = _run("promtool", "check", "config", tmp_path / "p.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    unbalanced = rules.read_text().replace("histogram_quantile(0.99,", "histogram_quantile(0.99", 1)
    (tmp_path / "bad.yml").write_text(unbalanced)
    assert _run("promtool", "check", "rules", tmp_path / "bad.yml").returncode != 0
