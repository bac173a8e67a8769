"""The packaging files, each checked by the validator its ecosystem uses: the systemd
units by `systemd-analyze verify`, the Kubernetes manifests by `kubernetes-validate`
(strict: an unknown field fails), the Dockerfile by `hadolint`, the Prometheus files by
`promtool`. Each validator is first shown to refuse a file broken on purpose, so a pass
means something. The deployment file inside the manifests' Secret loads as pdd loads
it, and the manifests run every instance it names, on its ports, reachable where it
advertises itself. What could not run here (building and running the image, a cluster)
is said in docs/deployment.md."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdd import config as cfg

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


# ---- Kubernetes --------------------------------------------------------------------------------

def _documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()) if d]


def test_the_kubernetes_manifests_validate(tmp_path):
    files = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
    assert [f.name for f in files] == ["secrets.yaml", "site-a.yaml", "site-b.yaml"]
    out = _run(BIN / "kubernetes-validate", "--strict", "--quiet", *files)
    assert out.returncode == 0, out.stdout + out.stderr
    broken = tmp_path / "site-b.yaml"
    broken.write_text(files[2].read_text().replace("replicas: 1", "replicas: one"))
    assert _run(BIN / "kubernetes-validate", "--strict", "--quiet", broken).returncode != 0
    broken.write_text(files[2].read_text().replace("containerPort: 9100", "containerPort: 9100, hostPorts: 1"))
    assert _run(BIN / "kubernetes-validate", "--strict", "--quiet", broken).returncode != 0


def test_the_manifests_run_what_their_deployment_file_says(tmp_path):
    """Each instance of the Secret's deployment file: a Deployment in its site's file running
    `pdd serve --instance NAME` on its two ports, a Service of its name in its site (where it
    advertises itself there) and a LoadBalancer for the other site; the router likewise."""
    secrets = {d["metadata"]["name"]: d for d in _documents("secrets.yaml") if d["kind"] == "Secret"}
    (tmp_path / "d.toml").write_text(secrets["pdd-deployment"]["stringData"]["deployment.toml"])
    dep = cfg.load(str(tmp_path / "d.toml"))
    assert "[keys]" in secrets["pdd-keys"]["stringData"]["keys.toml"]
    assert set(secrets["pdd-tls"]["stringData"]) == {Path(p).name for p in (dep.tls.cert, dep.tls.key, dep.tls.ca)}
    sites = {"A": _documents("site-a.yaml"), "B": _documents("site-b.yaml")}
    for inst in dep.instances:
        docs = {(d["kind"], d["metadata"]["name"]): d for d in sites[inst.dc]}
        pod = docs["Deployment", f"pdd-{inst.name}"]["spec"]["template"]["spec"]["containers"][0]
        assert pod["args"] == ["serve", "--config", "/etc/pdd/deployment.toml", "--instance", inst.name]
        assert {p["containerPort"] for p in pod["ports"]} == {inst.port, inst.kv_port}
        assert inst.advertise[inst.dc] == f"pdd-{inst.name}.pdd.svc:{inst.kv_port}"
        assert {p["port"] for p in docs["Service", f"pdd-{inst.name}"]["spec"]["ports"]} == {inst.port, inst.kv_port}
        line = docs["Service", f"pdd-{inst.name}-line"]["spec"]
        assert line["type"] == "LoadBalancer" and [p["port"] for p in line["ports"]] == [inst.kv_port]
        assert all(addr.endswith(f":{inst.kv_port}") for addr in inst.advertise.values())
    docs = {(d["kind"], d["metadata"]["name"]): d for d in sites[dep.router.dc]}
    router = docs["Deployment", "pdd-router"]["spec"]["template"]["spec"]["containers"][0]
    assert router["args"] == ["router", "--config", "/etc/pdd/deployment.toml"]
    assert [p["containerPort"] for p in router["ports"]] == [dep.router.port]
    assert dep.router.advertise == f"pdd-router.pdd.svc:{dep.router.port}"


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
