"""A two-site deployment across network namespaces, on the kernel's TCP.

One namespace per host: the router, P, RLD and a client in site A, MD in site B, each
at its own 10.77.x.y address (and all on the same ports), joined through a line
namespace whose tbf shapes each direction to 50 Mbit/s. Each process is `pdd serve
--config F --instance NAME` or `pdd router --config F` under `ip netns exec`, with TLS
on every framed connection. Checked: greedy parity with a colocated instance, the
decode-side hit of a second turn, the bytes the line's kernel interfaces carried
against the KV MD was missing, heartbeats across the line (and a silent line noticed),
every metric the Grafana dashboard queries, and a drain of MD. A second, smaller
deployment puts a `pdd line` hop on the route into B, for the delay the kernel's tbf
cannot add.

Needs root. Without it the test skips, and in CI a skip is a failure (conftest.py).
The namespaces are removed on the way out, also after a failure; a crashed run's are
removed by the next (`pdd.lab.netns.lab.remove_stale`).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import dashboard
import pytest
from procs import HTTP, kv_bytes_per_token, standalone, wait_until
from prometheus_client.parser import text_string_to_metric_families

from pdd import config as cfg
from pdd.lab.netns.cli import LabLauncher, hosts, lab_deployment
from pdd.lab.netns.lab import enter, lab

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

LINE_MBPS = 50.0
FIRST_TOKENS, NEXT_TOKENS = 64, 16  # agentic turns: long inputs, short outputs


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(16, 4096) for _ in range(n)] for n in (700, 820, 760)]


def _follow_up(prompt: list[int], answer: list[int], k: int) -> list[int]:
    """The agent's next turn: the context, the answer, a tool output."""
    return prompt + answer + [(31 * i + k) % 4000 + 16 for i in range(40)]


class Site:
    """The running deployment, and a client inside site A."""

    def __init__(self, net, dep: cfg.Deployment, conf: Path, launcher: LabLauncher) -> None:
        self.net, self.dep, self.conf, self.launcher = net, dep, conf, launcher
        self.url = dep.router.url
        self.pool = ThreadPoolExecutor(4, initializer=enter, initargs=(net.hosts["client"].ns,))

    def call(self, fn, *args):
        """`fn(*args)` from the client host."""
        return self.pool.submit(fn, *args).result()

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        return self.call(_complete, self.url, prompt, max_tokens)

    def instances(self) -> dict:
        return self.call(lambda: HTTP.get(f"{self.url}/pdd/stats", timeout=10).json()["instances"])


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    r = HTTP.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                 "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return {"ids": body["choices"][0]["token_ids"], "pdd": body["pdd"]}


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict:
    """Colocated greedy outputs (one instance on loopback) for every prompt sent here."""
    first = _prompts()
    with standalone(tiny_model_dir) as url:
        def ids(prompt: list[int], n: int) -> list[int]:
            r = HTTP.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n,
                                                         "temperature": 0, "ignore_eos": True}, timeout=120)
            return r.json()["choices"][0]["token_ids"]

        answers = [ids(p, FIRST_TOKENS) for p in first]
        second = [_follow_up(p, a, k) for k, (p, a) in enumerate(zip(first, answers, strict=True))]
        return {"first": first, "second": second, "answers": answers + [ids(p, NEXT_TOKENS) for p in second],
                "long": ids(first[0][:300], 400)}


@pytest.fixture(scope="module")
def site(tmp_path_factory, tiny_model_dir):
    run_dir = tmp_path_factory.mktemp("sites")
    base = cfg.Deployment(line=cfg.LineSpec(bandwidth_mbps=LINE_MBPS, delay_ms=0.5, jitter_ms=0.0),
                          liveness=cfg.LivenessSpec(heartbeat_s=1.0, dead_after_s=3.0))
    with lab(hosts("pdd", base), LINE_MBPS) as net:
        tls = run_dir / "tls"
        addrs = [f"--host={h.addr}" for h in net.hosts.values()]
        subprocess.run([sys.executable, "-m", "pdd.cli", "cert", "--out", str(tls), *addrs], check=True,
                       capture_output=True)
        dep = replace(lab_deployment(net, base, "pdd", hop=False),
                      tls=cfg.TLSSpec(str(tls / "cert.pem"), str(tls / "key.pem"), str(tls / "cert.pem")))
        launcher = LabLauncher(dep, run_dir, net)
        try:
            launcher.start()
            s = Site(net, dep, launcher.config_path, launcher)
            yield s
            s.pool.shutdown()
        finally:
            launcher.stop()


def test_a_line_emulator_hop_in_the_line_namespace_adds_its_delay_to_the_routes_into_b(tmp_path, reference):
    """Where a test needs delay (the kernel here has no netem), `pdd line` sits on the
    route: MD advertises the hop's address to A, and the hop relays to MD's own."""
    base = cfg.Deployment(line=cfg.LineSpec(bandwidth_mbps=LINE_MBPS, delay_ms=25.0, jitter_ms=0.0))
    with lab(hosts("pd-cross-dc", base), LINE_MBPS) as net:
        dep = lab_deployment(net, base, "pd-cross-dc", hop=True)
        md = dep.instance("md0")
        assert dep.address(md, "A") == (net.gateway("A"), cfg.parse_addr(md.advertise["A"])[1]) != (md.host, 9100)
        launcher = LabLauncher(dep, tmp_path, net)
        try:
            launcher.start()
            client = ThreadPoolExecutor(1, initializer=enter, initargs=(net.hosts["client"].ns,))
            got = client.submit(_complete, dep.router.url, reference["first"][0], FIRST_TOKENS).result()
            stats = client.submit(lambda: HTTP.get(f"{dep.router.url}/pdd/stats", timeout=10).json()).result()
            p0 = dep.instance("p0")
            page = client.submit(lambda: HTTP.get(f"http://{p0.host}:{p0.port}/metrics", timeout=10).text).result()
            client.shutdown()
        finally:
            launcher.stop()
    assert got["ids"] == reference["answers"][0] and got["pdd"]["pipeline"] == "P-MD"
    one_way = next(s.value for f in text_string_to_metric_families(page) for s in f.samples
                   if s.name == "pdd_line_one_way_delay_seconds" and s.labels["dc"] == "B")
    assert one_way >= 0.025, "P measured the hop's delay on the line"
    assert stats["line_bytes"] >= got["pdd"]["line_bytes"] > 0, "the router sums the KV bytes P counted across the line"


def test_every_process_runs_in_its_host_namespace_from_the_deployment_file(site):
    conf = cfg.load(site.conf)
    assert conf.tls.enabled and {i.dc for i in conf.instances} == {"A", "B"}
    assert not conf.line.admin_port and not any(i.advertise for i in conf.instances), "no emulator on this line"
    for name, proc in site.launcher.children:
        ns = site.net.hosts[name].ns
        want = ["router", "--config"] if name == "router" else ["serve", "--config", str(site.conf), "--instance", name]
        assert proc.args[:4] == ["ip", "netns", "exec", ns] and want[0] in proc.args
        assert proc.args[proc.args.index(want[0]):][:len(want)] == want
    md = conf.instance("md0")
    assert (md.host, md.kv_port) == conf.address(md, "A"), "MD is reached at its own address across the line"


def test_parity_decode_side_hit_and_line_bytes(site, reference, tiny_model_dir):
    before = site.net.line_bytes()
    first = [site.complete(p, FIRST_TOKENS) for p in reference["first"]]
    page = site.dep.engine.page_size
    # Each first turn ends on the relay while MD's copy still crosses, behind the later
    # turns' urgent KV. A next turn sent before its copy lands is served by the relay
    # (MD holds no prefix yet): right, but not what this test measures, so it waits.
    kept = sum((len(p) + len(a)) // page for p, a in zip(reference["first"], reference["answers"], strict=False))
    wait_until(lambda: site.instances()["md0"]["mirror_pages"] >= kept, 30, "MD holds every first turn")
    second = [site.complete(p, NEXT_TOKENS) for p in reference["second"]]
    time.sleep(0.5)  # the last acknowledgements and cache events cross too
    after = site.net.line_bytes()
    got = first + second
    assert [g["ids"] for g in got] == reference["answers"]
    for p, a, g in zip(reference["first"], reference["answers"], second, strict=False):  # MD kept turn one: it hits
        assert g["pdd"]["d_hit_tokens"] >= (len(p) + len(a)) // page * page - page, g["pdd"]
    bpt = kv_bytes_per_token(tiny_model_dir)
    prompts = reference["first"] + reference["second"]
    missed = sum((len(p) - g["pdd"]["d_hit_tokens"]) * bpt for p, g in zip(prompts, got, strict=True))
    line = sum(after[s] - before[s] for s in after)
    print(f"\nline (kernel, both ways) {line:,} B; missed KV {missed:,} B ({line / missed:.4f}x); into B "
          f"{after['B'] - before['B']:,}, into A {after['A'] - before['A']:,}; P counted "
          f"{[g['pdd']['line_bytes'] for g in got]}; pipelines {[g['pdd']['pipeline'] for g in got]}; "
          f"handoffs {[g['pdd']['handoff'] for g in got]}")
    assert missed <= line <= 1.05 * missed
    for p, g in zip(prompts, got, strict=True):  # P's own count, where it reached the router before the request ended
        kv = (len(p) - g["pdd"]["d_hit_tokens"]) * bpt
        assert g["pdd"]["line_bytes"] == 0 and g["pdd"]["fallbacks"] == ["relay_finished"] or \
            kv <= g["pdd"]["line_bytes"] <= kv * 1.02 + 4096, g["pdd"]


def test_heartbeats_cross_the_line_and_a_silent_line_is_noticed(site, reference):
    before = site.net.line_bytes()
    time.sleep(1.5)  # idle: only heartbeats (and their acknowledgements) cross
    after = site.net.line_bytes()
    assert all(after[s] > before[s] for s in after), (before, after)
    assert site.instances()["md0"]["healthy"]
    site.net.blackhole(True)
    try:
        wait_until(lambda: not site.instances()["md0"]["healthy"], 10, "the router drops the silent MD")
        degraded = site.complete(reference["first"][1], FIRST_TOKENS)  # the relay serves meanwhile
        assert degraded["ids"] == reference["answers"][1] and degraded["pdd"]["main_output_tokens"] == 0
    finally:
        site.net.blackhole(False)
    wait_until(lambda: site.instances()["md0"]["healthy"], 15, "the router reconnects to MD")
    back = site.complete(reference["first"][2], FIRST_TOKENS)
    assert back["ids"] == reference["answers"][2]


def test_every_metric_the_dashboard_queries_is_on_a_live_metrics_page(site):
    urls = [site.url] + [f"http://{i.host}:{i.port}" for i in site.dep.instances]
    assert dashboard.check([site.call(lambda u=u: HTTP.get(f"{u}/metrics", timeout=10).text) for u in urls]) >= 20


def test_main_drains_across_the_line_without_failing_a_request(site, reference):
    running = site.pool.submit(_complete, site.url, reference["first"][0][:300], 400)
    wait_until(lambda: site.instances()["md0"]["queued_tokens"] > 0, 30, "md0 has work")
    command = [sys.executable, "-m", "pdd.cli", "drain", "md0", "--timeout", "30", "--config", str(site.conf)]
    drain = site.call(lambda: subprocess.run(command, capture_output=True, text=True, timeout=120))
    assert drain.returncode == 0 and "md0 drained and left" in drain.stdout, drain.stdout + drain.stderr
    done = running.result(timeout=120)
    assert done["ids"] == reference["long"] and done["pdd"]["instances"]["main"] == "md0"
    md = dict(site.launcher.children)["md0"]
    wait_until(lambda: md.poll() is not None, 15, "md0's process exits")
    assert "md0" not in site.instances()
