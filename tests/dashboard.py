"""Checks of the monitoring files against live /metrics pages: every series the Grafana
dashboard (deploy/grafana/pdd.json) queries is exported, every legend's label is one the
series carry (or a target label of deploy/prometheus/prometheus.yml), and no exported
label is one Prometheus sets on the scrape (instance, job, the target labels), which it
would rename to exported_* and so show the scraped process in its place."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

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
        for s in suffixes.get(fam.type, ("",)):
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
