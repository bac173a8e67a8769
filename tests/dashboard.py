"""Checks of the monitoring files against live /metrics pages: every series the Grafana
dashboard (deploy/grafana/pdd.json) queries is exported, every legend's label is one the
series carry (or a target label of deploy/prometheus/prometheus.yml), and no exported
label is one Prometheus sets on the scrape (instance, job, the target labels), which it
would rename to exported_* and so show the scraped process in its place."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import yaml
from procs import HTTP, free_port, stop_group
from prometheus_client.parser import text_string_to_metric_families

from pdd.lab.deploy import wait_http

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "pdd.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"


def target_labels() -> set[str]:
    """The labels Prometheus puts on every scraped series: instance, job, and the static ones."""
    conf = yaml.safe_load(PROMETHEUS.read_text())
    static = {k for job in conf["scrape_configs"] for t in job.get("static_configs", []) for k in t.get("labels", {})}
    return {"instance", "job"} | static


def _targets(dashboard: dict) -> list[dict]:
    return [t for panel in dashboard["panels"] for t in panel.get("targets", [])]


def queried(dashboard: dict) -> set[str]:
    """Metric names in the dashboard's PromQL (every pdd series is named pdd_...)."""
    exprs = [t["expr"] for t in _targets(dashboard)]
    exprs += [v.get("query", "") if isinstance(v.get("query"), str) else v.get("query", {}).get("query", "")
              for v in dashboard.get("templating", {}).get("list", [])]
    return {name for e in exprs for name in re.findall(r"\bpdd_[a-z0-9_]+", e)}


def exposed(text: str) -> dict[str, set[str] | None]:
    """Every series name a /metrics page can have, with the label names its samples carry
    (None for a family with no sample yet: a labelled counter nothing has counted in)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gauge": ("",), "summary": ("_sum", "_count", "_created")}
    names: dict[str, set[str] | None] = {}
    for fam in text_string_to_metric_families(text):
        for s in suffixes.get(fam.type, ("",)) if not fam.samples else ():  # (a sampled family says its own)
            names.setdefault(fam.name + s, None)
        for sample in fam.samples:
            names[sample.name] = (names.get(sample.name) or set()) | set(sample.labels)
    return names


def check(pages: list[str]) -> int:
    """Assert the above over the /metrics `pages` of a deployment's processes; the number of
    series the dashboard queries."""
    series: dict[str, set[str]] = {}
    sampled: set[str] = set()
    for page in pages:
        for name, labels in exposed(page).items():
            series.setdefault(name, set()).update(labels or ())
            sampled |= {name} if labels is not None else set()
    clash = {name: labels & target_labels() for name, labels in series.items() if labels & target_labels()}
    assert not clash, f"labels Prometheus would rename to exported_*: {clash}"
    dashboard = json.loads(DASHBOARD.read_text())
    wanted = queried(dashboard)
    assert wanted <= set(series), f"the dashboard queries metrics nothing exports: {sorted(wanted - set(series))}"
    for t in _targets(dashboard):
        names = re.findall(r"\bpdd_[a-z0-9_]+", t["expr"])
        if not set(names) <= sampled:  # (a family with no sample yet says nothing of its labels)
            continue
        carried = set().union(*(series[n] for n in names)) | target_labels()
        shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
        assert shown <= carried, f"legend {t['legendFormat']!r} of {t['expr']!r} shows labels no series has"
    return len(wanted)


# ---- through a real Prometheus --------------------------------------------------------------

ALERTS = DEPLOY / "prometheus" / "alerts.yml"
SCRAPE_S = 1  # the test's scrape and rule interval; the shipped file's 10 s would make it wait minutes
WINDOW = "30s"  # Grafana's $__rate_interval here: several scrapes of traffic


@contextlib.contextmanager
def prometheus(targets: dict[str, dict[str, str]], where: Path) -> Iterator[str]:
    """Debian's Prometheus on loopback, scraping `targets` (job -> {address: the shipped
    file's target labels for it}) with deploy/prometheus/prometheus.yml's jobs and labels,
    loading alerts.yml; its URL, the server stopped on exit."""
    conf = yaml.safe_load(PROMETHEUS.read_text())
    conf["global"] = {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"}
    conf["rule_files"] = [str(ALERTS)]
    for job in conf["scrape_configs"]:
        shipped = {k for t in job["static_configs"] for k in t.get("labels", {})}
        job["static_configs"] = [{"targets": [addr], "labels": labels}
                                 for addr, labels in targets[job["job_name"]].items()]
        assert all(set(t["labels"]) == shipped for t in job["static_configs"]), (job["job_name"], shipped)
    (where / "prometheus.yml").write_text(yaml.safe_dump(conf))
    port = free_port()
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={where / 'prometheus.yml'}", f"--storage.tsdb.path={where / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(where / "prometheus.log", "w"), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_http(f"{url}/-/ready", proc, 30)
        except RuntimeError as e:
            raise AssertionError(f"prometheus: {e}\n{(where / 'prometheus.log').read_text()}") from None
        yield url
    finally:
        stop_group(proc)


def query(url: str, expr: str) -> list[dict]:
    """An instant query's series: [{"metric": {label: value}, "value": [t, "v"]}]."""
    r = HTTP.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "success", (expr, r.text)
    return r.json()["data"]["result"]


def panel_queries() -> list[tuple[str, str, str]]:
    """Every dashboard query as Prometheus runs it (its variables at their defaults, the
    rate window `WINDOW`): (panel title, expr, legend)."""
    dashboard = json.loads(DASHBOARD.read_text())
    values = {v["name"]: v["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), str)}
    values["__rate_interval"] = WINDOW
    out = []
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            expr = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], t["expr"])
            out.append((panel["title"], expr, t.get("legendFormat", "")))
    return out


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


def unthresholded(expr: str) -> str:
    """An alert's `QUANTITY OP THRESHOLD` as a filter no more: `OP bool`, which keeps every
    series of QUANTITY (as 0 or 1) for the test to see its labels."""
    body, n = re.subn(r"\s(>|<|==|>=|<=|!=)\s+([0-9.]+)\s*$", r" \1 bool \2", expr.strip())
    assert n == 1, f"an alert is QUANTITY OP THRESHOLD: {expr!r}"
    return body


def rule_health(url: str) -> dict[str, str]:
    """Each loaded rule's health after its evaluations ("ok", "err", "unknown")."""
    groups = HTTP.get(f"{url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    return {r["name"]: r["health"] + (f": {r['lastError']}" if r.get("lastError") else "")
            for g in groups for r in g["rules"]}
