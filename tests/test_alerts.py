"""The alert rules proven to fire: deploy/prometheus/alerts.test.yml, run by `promtool test
rules`, holds for every rule of alerts.yml a case a little past its threshold that fires
after its `for:` time (and not before), with the labels and summary it pages with, and a case
just below it that stays silent. A pass means something because each rule, broken as an edit
could break it (its threshold moved up, moved down, its `for:` dropped), fails its cases:
the test breaks each and watches promtool refuse it. The live half, an instance stopped and
its alerts going pending on a real Prometheus, is in tests/test_router_api.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROM = Path(__file__).resolve().parents[1] / "deploy" / "prometheus"
RULES = PROM / "alerts.yml"
CASES = PROM / "alerts.test.yml"
THRESHOLD = re.compile(r"\s(>|<|==|>=|<=|!=)\s+([0-9.]+)\s*$")

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="Debian's prometheus (scripts/test.sh installs it)")


def _promtool(rules: dict, cases: dict, where: Path) -> subprocess.CompletedProcess:
    """`promtool test rules` of `cases` against `rules`, both written to `where`."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "alerts.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    (where / "alerts.test.yml").write_text(yaml.safe_dump(cases | {"rule_files": ["alerts.yml"]}, sort_keys=False))
    return subprocess.run(["promtool", "test", "rules", "alerts.test.yml"], cwd=where, capture_output=True,
                          text=True, timeout=120)


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _with_rule(rule_name: str, change) -> dict:
    """alerts.yml with the rule named `rule_name` passed through `change` (rule -> rule)."""
    doc = yaml.safe_load(RULES.read_text())
    for group in doc["groups"]:
        group["rules"] = [change(dict(r)) if r["alert"] == rule_name else r for r in group["rules"]]
    return doc


def _cases_of(rule_name: str) -> dict:
    """alerts.test.yml with only the cases that test `rule_name`."""
    doc = yaml.safe_load(CASES.read_text())
    doc["tests"] = [t for t in doc["tests"] if any(a["alertname"] == rule_name for a in t["alert_rule_test"])]
    return doc


def _moved(rule: dict, factor: float) -> dict:
    """`rule` with its threshold multiplied by `factor` (a zero threshold moved by one, the
    way `factor` points)."""
    op, value = THRESHOLD.search(rule["expr"]).groups()
    t = float(value)
    new = t * factor if t else (1.0 if factor > 1 else -1.0)
    return rule | {"expr": THRESHOLD.sub(f" {op} {new:g}", rule["expr"].strip())}


def test_every_rule_has_a_firing_case_and_a_silent_one():
    """For each rule: an evaluation expecting it to fire, one of the same series before its
    `for:` has run expecting nothing (that it is early enough, dropping `for:` shows), and
    a case whose series stay just below it expecting nothing at a time past its `for:` (so
    silence is not just the wait)."""
    cases = yaml.safe_load(CASES.read_text())["tests"]
    rules = _rules()
    assert len(rules) == 13
    for rule in rules:
        assert THRESHOLD.search(rule["expr"]), rule["alert"]
        evals = [(c["name"], a) for c in cases for a in c["alert_rule_test"] if a["alertname"] == rule["alert"]]
        fires = {name for name, a in evals if a["exp_alerts"]}
        silent = {name for name, a in evals if not a["exp_alerts"] and name not in fires}
        assert fires and silent, rule["alert"]
        minutes = int(rule.get("for", "0m").rstrip("m"))
        assert all(int(a["eval_time"].rstrip("m")) > minutes for name, a in evals if name in silent), rule["alert"]
        if minutes:
            assert any(name in fires and not a["exp_alerts"] for name, a in evals), rule["alert"]


def test_promtool_passes_the_cases(tmp_path):
    out = _promtool(yaml.safe_load(RULES.read_text()), yaml.safe_load(CASES.read_text()), tmp_path)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_a_broken_rule_fails_its_cases(rule, tmp_path):
    """The threshold a quarter up (the firing case no longer fires), a fifth down (the
    silent case fires), `==` made `!=` where the rule compares for equality, and `for:`
    dropped (it fires before its time): promtool refuses each, naming the rule."""
    name = rule["alert"]
    op = THRESHOLD.search(rule["expr"]).group(1)
    breaks = {"== made !=": lambda r: r | {"expr": r["expr"].replace(" == ", " != ")}} if op == "==" else {
        "threshold up": lambda r: _moved(r, 1.25), "threshold down": lambda r: _moved(r, 0.8)}
    if "for" in rule:
        breaks["for dropped"] = lambda r: {k: v for k, v in r.items() if k != "for"}
    for what, change in breaks.items():
        broken = _with_rule(name, change)
        assert broken != yaml.safe_load(RULES.read_text()), what
        out = _promtool(broken, _cases_of(name), tmp_path / what.replace(" ", "-"))
        assert out.returncode != 0 and name in out.stdout + out.stderr, f"{name} with its {what} passed:\n{out.stdout}"
