"""deploy/kubernetes as an operator uses it: `kubectl kustomize` renders each site's overlay
(kubectl carries Kustomize), `kubernetes-validate --strict` checks what it renders against
the Kubernetes schema (an unknown field fails), each shown first to refuse a file broken on
purpose. What is rendered runs the deployment file it mounts: a Deployment per instance in
its own site, on its ports, with as many GPUs as its ranks, probed on /health and /ready,
drained by its preStop, given longer than its grace to stop; a PodDisruptionBudget each; the
secret only from Secrets the operator makes; a KV port reachable from the other site only
where the deployment file says that site calls it, through an internal load balancer, and a
NetworkPolicy over every instance. The same holds for md-dp2/, MD a data-parallel group of
2 ranks (a pod a rank); there rank 0's RPC Service selects rank 0 alone, the group's ranks
reach each other and nothing outside the group reaches the RPC port."""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from pdd import config as cfg
from pdd.config import groups

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"
SITES = {"A": "site-a", "B": "site-b"}
LAYOUTS = {"": "md0", "md-dp2": "md0-dp0 md0-dp1"}  # each layout's directory: what site A calls in site B
OPERATORS_SECRETS = {"pdd-secret", "pdd-tls", "pdd-ca", "pdd-keys"}  # base/kustomization.yaml says how to make them

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (it carries Kustomize)")


def _render(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", "kustomize", str(site)], capture_output=True, text=True, timeout=60)


def _validate(text: str, where: Path) -> subprocess.CompletedProcess:
    where.write_text(text)
    return subprocess.run(
        [str(VALIDATE), "--strict", "--quiet", str(where)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request) -> str:
    return request.param


def _rendered(layout: str) -> dict[str, dict[tuple[str, str], dict]]:
    """Each datacenter's rendered resources by (kind, name)."""
    out = {}
    for dc, site in SITES.items():
        r = _render(KUBE / layout / site)
        assert r.returncode == 0, r.stderr
        out[dc] = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout) if d}
    return out


@pytest.fixture(scope="module")
def rendered(layout) -> dict[str, dict[tuple[str, str], dict]]:
    return _rendered(layout)


def _toml(layout: str) -> Path:
    return KUBE / layout / ("config" if layout else "base") / "deployment.toml"


def _parsed(layout: str) -> cfg.Deployment:
    # (parsed, not loaded: its secret_file is the path inside the pod)
    return cfg.parse(tomllib.loads(_toml(layout).read_text()))


@pytest.fixture(scope="module")
def dep(layout) -> cfg.Deployment:
    return _parsed(layout)


def test_each_site_renders_and_validates(tmp_path):
    for site in (Path(layout) / s for layout in LAYOUTS for s in SITES.values()):
        r = _render(KUBE / site)
        assert r.returncode == 0, r.stderr
        out = _validate(r.stdout, tmp_path / f"{str(site).replace('/', '-')}.yaml")
        assert out.returncode == 0, out.stdout + out.stderr
    # each tool refuses a broken copy: Kustomize a missing resource, the schema a wrong type
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBE, copy)
    (copy / "site-a" / "kustomization.yaml").write_text(
        (KUBE / "site-a" / "kustomization.yaml").read_text().replace("  - rld0\n", "  - rld9\n")
    )
    assert _render(copy / "site-a").returncode != 0
    (copy / "site-a" / "kustomization.yaml").write_text((KUBE / "site-a" / "kustomization.yaml").read_text())
    (copy / "instance" / "deployment.yaml").write_text(
        (KUBE / "instance" / "deployment.yaml").read_text().replace("replicas: 1", "replicas: one")
    )
    r = _render(copy / "site-b")
    assert r.returncode == 0 and _validate(r.stdout, tmp_path / "broken.yaml").returncode != 0


def _container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _rpc_ports(inst: cfg.InstanceSpec) -> set[int]:
    """The port a group's rank 0 takes its group's other ranks on (none for other instances)."""
    vllm = inst.engine.vllm
    return {vllm[groups.RPC_PORT]} if inst.group and vllm.get(groups.RANK) == 0 else set()


def test_every_instance_runs_in_its_site_as_the_deployment_file_says(rendered, dep):
    for inst in dep.instances:
        docs = rendered[inst.dc]
        pod = docs["Deployment", f"pdd-{inst.name}"]
        c = _container(pod)
        assert c["args"][:5] == ["serve", "--config", "/etc/pdd/deployment.toml", "--instance", inst.name]
        assert {p["containerPort"] for p in c["ports"]} == {inst.port, inst.kv_port, *_rpc_ports(inst)}
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
        assert any(
            all(labels.get(e["key"]) for e in p["spec"]["podSelector"].get("matchExpressions", [])) for p in policies
        ), f"no NetworkPolicy over {inst.name}"
    router = rendered[dep.router.dc]["Deployment", "pdd-router"]
    c = _container(router)
    assert c["args"][:3] == ["router", "--config", "/etc/pdd/deployment.toml"] and router["spec"]["replicas"] == 2
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > float(
        _flag(c["args"], "--shutdown-grace-s")
    )
    assert rendered[dep.router.dc]["PodDisruptionBudget", "pdd-router"]["spec"]["minAvailable"] == 1


def test_a_kv_port_is_reachable_across_the_line_only_where_the_other_site_calls_it(rendered, dep, layout):
    """B never calls A: P's and RLD's KV ports have no load balancer; MD's has an internal one,
    open to the other site's range alone, on its KV port alone."""
    called_across = {i.name for i in dep.instances if set(i.advertise) - {i.dc}}
    assert called_across == set(LAYOUTS[layout].split())
    for docs in rendered.values():
        for (kind, name), d in docs.items():
            if kind != "Service" or d["spec"].get("type") != "LoadBalancer" or name.startswith("pdd-router"):
                continue
            reached = [i for i in dep.instances if _selects(d["spec"]["selector"], {"pdd/instance": i.name})]
            assert [i.name for i in reached] == [name.removeprefix("pdd-").removesuffix("-line")], name
            assert reached[0].name in called_across, f"{name} exposes {reached[0].name}, which no other site calls"
            assert [p["targetPort"] for p in d["spec"]["ports"]] == ["kv"], name
            assert d["spec"]["loadBalancerSourceRanges"] and any(
                "internal" in k.lower() or "Internal" in v for k, v in d["metadata"]["annotations"].items()
            )
    assert {("Service", f"pdd-{name}-line") for name in called_across} <= set(rendered["B"])


def test_the_secret_comes_only_from_secrets_the_operator_makes(rendered, dep, layout):
    text = _toml(layout).read_text()
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


def test_the_group_layouts_file_is_the_base_file_with_md0_a_group_of_two():
    """md-dp2's deployment file parses into md0's ranks, one pod each, both sites reading it;
    all else is base/deployment.toml's."""
    base, group = _parsed(""), _parsed("md-dp2")
    ranks = groups.of(group.instances, "md0")
    assert [r.name for r in ranks] == ["md0-dp0", "md0-dp1"]
    assert {r.engine.vllm[groups.SIZE] for r in ranks} == {2} and all(
        r.engine.vllm["enable_expert_parallel"] for r in ranks
    )
    assert [i for i in group.instances if not i.group] == [i for i in base.instances if i.name != "md0"]
    assert replace(group, instances=()) == replace(base, instances=())
    configs = {dc: [name for kind, name in docs if kind == "ConfigMap"] for dc, docs in _rendered("md-dp2").items()}
    assert configs["A"] == configs["B"] and len(configs["A"]) == 1  # one file (one content hash) in both sites
    data = _rendered("md-dp2")["A"]["ConfigMap", configs["A"][0]]["data"]["deployment.toml"]
    assert cfg.parse(tomllib.loads(data)) == group


def test_the_groups_rpc_service_is_rank_0s_pod_by_the_name_its_ranks_dial():
    docs = _rendered("md-dp2")["B"]
    r0, r1 = groups.of(_parsed("md-dp2").instances, "md0")
    host, port = r0.engine.vllm[groups.ADDRESS], r0.engine.vllm[groups.RPC_PORT]
    name = host.removesuffix(".pdd.svc")
    service = docs["Service", name]["spec"]
    # headless: the name resolves to rank 0's own pod, which its vLLM binds; listed before it is ready
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
    assert [p["port"] for p in service["ports"]] == [port]
    pods = {r.name: docs["Deployment", f"pdd-{r.name}"]["spec"]["template"]["metadata"]["labels"] for r in (r0, r1)}
    assert [r for r, labels in pods.items() if _selects(service["selector"], labels)] == ["md0-dp0"]
    rank0 = _container(docs["Deployment", "pdd-md0-dp0"])["ports"]
    assert {"name": service["ports"][0]["targetPort"], "containerPort": port} in rank0


def _peer_admits(peer: dict, source: dict) -> bool:
    """Whether a NetworkPolicy `from` peer admits `source` (a pod's labels and namespace, or an address)."""
    if "ipBlock" in peer:
        return ipaddress.ip_address(source.get("ip", "0.0.0.0")) in ipaddress.ip_network(peer["ipBlock"]["cidr"])
    if "ip" in source:
        return False
    namespaces = peer.get("namespaceSelector")
    if namespaces is None and source["namespace"] != "pdd":
        return False
    if namespaces is not None and not _matches(namespaces, {"kubernetes.io/metadata.name": source["namespace"]}):
        return False
    return _matches(peer.get("podSelector", {}), source.get("labels", {}))


def _matches(selector: dict, labels: dict) -> bool:
    exists = all(e["operator"] == "Exists" and e["key"] in labels for e in selector.get("matchExpressions", []))
    return exists and _selects(selector.get("matchLabels", {}), labels)


def _admits(docs: dict, pod: dict, port: tuple[str, int], source: dict) -> bool:
    """Whether the NetworkPolicies among `docs` let `source` reach the pod's port (name, number)."""
    labels = pod["spec"]["template"]["metadata"]["labels"]
    for (kind, _), policy in docs.items():
        if kind != "NetworkPolicy" or not _matches(policy["spec"]["podSelector"], labels):
            continue
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if (not ports or set(port) & set(ports)) and any(_peer_admits(p, source) for p in rule["from"]):
                return True
    return False


def test_the_groups_ranks_reach_each_other_and_nothing_outside_the_group_reaches_its_rpc_port():
    docs = _rendered("md-dp2")["B"]
    rank0, rank1 = docs["Deployment", "pdd-md0-dp0"], docs["Deployment", "pdd-md0-dp1"]
    rpc = ("rpc", groups.of(_parsed("md-dp2").instances, "md0")[0].engine.vllm[groups.RPC_PORT])
    torch_distributed = ("", 29500)  # vLLM draws these at start: any port between the ranks
    in_group = {"namespace": "pdd", "labels": rank1["spec"]["template"]["metadata"]["labels"]}
    assert _admits(docs, rank0, rpc, in_group) and _admits(docs, rank0, torch_distributed, in_group)
    assert _admits(
        docs, rank1, torch_distributed, {"namespace": "pdd", "labels": rank0["spec"]["template"]["metadata"]["labels"]}
    )
    outside = [
        {"namespace": "pdd", "labels": {"pdd/instance": "md1", "app.kubernetes.io/component": "main"}},
        {"namespace": "pdd", "labels": {"app.kubernetes.io/component": "router"}},
        {"namespace": "monitoring", "labels": {}},
        {"ip": "10.1.0.7"},  # site A, across the line
    ]
    for source in outside:
        assert not _admits(docs, rank0, rpc, source), source
        assert not _admits(docs, rank0, torch_distributed, source), source
    assert _admits(docs, rank0, ("kv", 9100), outside[0]) and _admits(docs, rank0, ("kv", 9100), outside[3])
