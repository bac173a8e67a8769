"""deploy/kubernetes as an operator uses it: `kubectl kustomize` renders each site's overlay
(kubectl carries Kustomize), `kubernetes-validate --strict` checks what it renders against
the Kubernetes schema (an unknown field fails), each shown first to refuse a file broken on
purpose. What is rendered runs the deployment file it mounts: a Deployment per instance in
its own site, on its ports, with as many GPUs as its ranks, probed on /health and /ready,
drained by its preStop, given longer than its grace to stop; a PodDisruptionBudget each; the
secret only from Secrets the operator makes; a KV port reachable from the other site only
where the deployment file says that site calls it, through an internal load balancer, and a
NetworkPolicy over every instance."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from pdd import config as cfg

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
SITES = {"A": "site-a", "B": "site-b"}
OPERATORS_SECRETS = {"pdd-secret", "pdd-tls", "pdd-ca", "pdd-keys"}  # base/kustomization.yaml says how to make them

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (it carries Kustomize)")


def _render(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", "kustomize", str(site)], capture_output=True, text=True, timeout=60)


def _validate(text: str, where: Path) -> subprocess.CompletedProcess:
    where.write_text(text)
    return subprocess.run([str(VALIDATE), "--strict", "--quiet", str(where)], capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict[tuple[str, str], dict]]:
    """Each datacenter's rendered resources by (kind, name)."""
    out = {}
    for dc, site in SITES.items():
        r = _render(KUBE / site)
        assert r.returncode == 0, r.stderr
        out[dc] = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout) if d}
    return out


@pytest.fixture(scope="module")
def dep() -> cfg.Deployment:
    # (parsed, not loaded: its secret_file is the path inside the pod)
    return cfg.parse(tomllib.loads((KUBE / "base" / "deployment.toml").read_text()))


def test_each_site_renders_and_validates(tmp_path):
    for site in SITES.values():
        r = _render(KUBE / site)
        assert r.returncode == 0, r.stderr
        out = _validate(r.stdout, tmp_path / f"{site}.yaml")
        assert out.returncode == 0, out.stdout + out.stderr
    # each tool refuses a broken copy: Kustomize a missing resource, the schema a wrong type
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copy)
    (copy / "site-a" / "kustomization.yaml").write_text(
        (KUBE / "site-a" / "kustomization.yaml").read_text().replace("  - rld0\n", "  - rld9\n"))
    assert _render(copy / "site-a").returncode != 0
    (copy / "site-a" / "kustomization.yaml").write_text((KUBE / "site-a" / "kustomization.yaml").read_text())
    (copy / "instance" / "deployment.yaml").write_text(
        (KUBE / "instance" / "deployment.yaml").read_text().replace("replicas: 1", "replicas: one"))
    r = _render(copy / "site-b")
    assert r.returncode == 0 and _validate(r.stdout, tmp_path / "broken.yaml").returncode != 0


def _container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_every_instance_runs_in_its_site_as_the_deployment_file_says(rendered, dep):
    for inst in dep.instances:
        docs = rendered[inst.dc]
        pod = docs["Deployment", f"pdd-{inst.name}"]
        c = _container(pod)
        assert c["args"][:5] == ["serve", "--config", "/etc/pdd/deployment.toml", "--instance", inst.name]
        assert {p["containerPort"] for p in c["ports"]} == {inst.port, inst.kv_port}
        assert c["resources"]["limits"]["nvidia.com/gpu"] == inst.engine.vllm.get("tensor_parallel_size", 1)
        assert c["startupProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        drain = c["lifecycle"]["preStop"]["exec"]["command"]
        assert drain[:3] == ["pdd", "drain", inst.name] and "--join" in c["args"]  # a drained pod comes back
        grace = float(_flag(c["args"], "--shutdown-grace-s"))
        stop_s = pod["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert stop_s > grace + float(_flag(drain, "--timeout"))
        labels = pod["spec"]["template"]["metadata"]["labels"]
        assert _selects(docs["PodDisruptionBudget", f"pdd-{inst.name}"]["spec"]["selector"]["matchLabels"], labels)
        service = docs["Service", f"pdd-{inst.name}"]["spec"]
        assert service["type"] == "ClusterIP" and _selects(service["selector"], labels)
        assert {p["port"] for p in service["ports"]} == {inst.port, inst.kv_port}
        assert inst.advertise[inst.dc] == f"pdd-{inst.name}.pdd.svc:{inst.kv_port}"
        policies = [d for (kind, _), d in docs.items() if kind == "NetworkPolicy"]
        assert any(all(labels.get(e["key"]) for e in p["spec"]["podSelector"].get("matchExpressions", []))
                   for p in policies), f"no NetworkPolicy over {inst.name}"
    router = rendered[dep.router.dc]["Deployment", "pdd-router"]
    c = _container(router)
    assert c["args"][:3] == ["router", "--config", "/etc/pdd/deployment.toml"] and router["spec"]["replicas"] == 2
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > float(
        _flag(c["args"], "--shutdown-grace-s"))
    assert rendered[dep.router.dc]["PodDisruptionBudget", "pdd-router"]["spec"]["minAvailable"] == 1


def test_a_kv_port_is_reachable_across_the_line_only_where_the_other_site_calls_it(rendered, dep):
    """B never calls A: P's and RLD's KV ports have no load balancer; MD's has an internal one,
    open to the other site's range alone, on its KV port alone."""
    called_across = {i.name for i in dep.instances if set(i.advertise) - {i.dc}}
    assert called_across == {"md0"}
    for docs in rendered.values():
        for (kind, name), d in docs.items():
            if kind != "Service" or d["spec"].get("type") != "LoadBalancer" or name.startswith("pdd-router"):
                continue
            reached = [i for i in dep.instances if _selects(d["spec"]["selector"], {"pdd/instance": i.name})]
            assert [i.name for i in reached] == [name.removeprefix("pdd-").removesuffix("-line")], name
            assert reached[0].name in called_across, f"{name} exposes {reached[0].name}, which no other site calls"
            assert [p["targetPort"] for p in d["spec"]["ports"]] == ["kv"], name
            assert d["spec"]["loadBalancerSourceRanges"] and any("internal" in k.lower() or "Internal" in v
                                                                 for k, v in d["metadata"]["annotations"].items())
    assert ("Service", "pdd-md0-line") in rendered["B"]


def test_the_secret_comes_only_from_secrets_the_operator_makes(rendered, dep):
    text = (KUBE / "base" / "deployment.toml").read_text()
    assert not dep.secret and "secret =" not in text and dep.secret_file
    for docs in rendered.values():
        assert not [name for kind, name in docs if kind == "Secret"]  # none rendered: none written in the repo
        for (kind, name), d in docs.items():
            if kind != "Deployment":
                continue
            spec = d["spec"]["template"]["spec"]
            secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
            assert set(secrets.values()) <= OPERATORS_SECRETS and "pdd-secret" in secrets.values(), name
            mounts = {m["name"]: m["mountPath"] for m in _container(d)["volumeMounts"]}
            secret_volume = next(v for v, s in secrets.items() if s == "pdd-secret")
            assert str(Path(dep.secret_file).parent) == mounts[secret_volume], name
            config = next(v for v in spec["volumes"] if v["name"] == "deployment")["configMap"]["name"]
            assert ("ConfigMap", config) in docs, name  # the generated (content-hashed) name, not the bare one
