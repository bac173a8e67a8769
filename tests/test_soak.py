"""`pdd soak` end to end: a short soak through a real pdd-mode deployment, with main
decode killed -9 and restarted and the line blackholed, must lose no request and leak
no page. The verdict is read from the numbers in its JSON report, not its exit code
alone, so a soak that sent nothing or injected nothing cannot pass."""

from __future__ import annotations

import json

from procs import pdd_process


def test_a_short_soak_with_a_kill_and_a_blackhole_loses_and_leaks_nothing(tmp_path):
    conf = tmp_path / "soak.toml"
    conf.write_text("[router]\ntoken_timeout_s = 10.0\n")  # a request with no first token fails fast
    out = tmp_path / "soak.json"
    args = ["soak", "--config", str(conf), "--duration-s", "20", "--concurrency", "4", "--seed", "1",
            "--faults", "kill-md,blackhole", "--fault-every-s", "2", "--timeout-s", "30", "--settle-s", "20",
            "--out", str(out), "--quiet"]
    with pdd_process(args) as proc:
        output, _ = proc.communicate(timeout=150)
    report = json.loads(out.read_text())
    totals = report["totals"]
    print(f"\nsoak: {totals}, faults {[(f['kind'], round(f['clear'] - f['start'], 1)) for f in report['faults']]}, "
          f"{report['wall_s']:.0f} s")
    assert sorted({f["kind"] for f in report["faults"]}) == ["blackhole", "kill-md"], report["faults"]
    assert all(f["ok"] for f in report["faults"]), "the killed instance did not rejoin"
    assert totals["sent"] > 0 and totals["completed"] > 0
    assert totals["lost"] == 0, report["lost_requests"]
    assert report["leaked_pages"] == 0, report["pages"]
    assert report["probes"]["completed"] == report["probes"]["sent"]
    assert proc.returncode == 0, output[-3000:]
