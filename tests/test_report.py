"""The demo's report files, and `pdd demo` end to end against a substitute `pdd up`.

The substitute is a small launcher script with the `pdd up` contract: `--help` lists
its `--mode` choices, a deployment starts the fake OpenAI server of
test_bench_client.py as a child process and prints `router: http://127.0.0.1:PORT`.
It records its own PID and its child's so the test can check nothing outlives the demo.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from pdd.cli import main
from pdd.lab import demo_deploy
from pdd.lab.bench.report import write_report
from pdd.lab.bench.summary import summarize
from pdd.record import RequestRecord

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _record(i: int, ttft: float, **pdd: object) -> RequestRecord:
    return RequestRecord(id=f"0-{i}", session=0, turn=i, start_s=0.1 * i, prompt_tokens=1000,
                         output_tokens=20, ttft_ms=ttft, tpot_ms=25.0 + i, e2e_ms=ttft + 500.0,
                         max_itl_ms=40.0 + 10 * i, **pdd)


def _summary(records: list[RequestRecord], line_bytes: int = 0) -> dict:
    return summarize(records, line_bytes=line_bytes, slo_ttft_ms=2000.0, slo_tpot_ms=200.0)


def _summaries() -> dict[str, dict]:
    """Four modes shaped like the paper's story: PDD cuts the cross-DC TTFT tail."""
    hits = {"p_hit_tokens": 900, "d_hit_tokens": 900}
    return {
        "colocated": _summary([_record(i, 40.0 + i, cached_tokens=900, p_hit_tokens=900,
                                       d_hit_tokens=900) for i in range(10)]),
        "pd-same-dc": _summary([_record(i, 60.0 + i, **hits) for i in range(10)]),
        "pd-cross-dc": _summary([_record(i, 300.0 + 900 * (i >= 8), line_bytes=100_000, **hits)
                                 for i in range(10)], line_bytes=1_000_000),
        "pdd": _summary([_record(i, 80.0, line_bytes=100_000, relay_output_tokens=2,
                                 main_output_tokens=18, pipeline="P-RLD-MD" if i < 3 else "P-MD",
                                 handoff="one_shot" if i < 3 else None, handoff_tokens=2 if i < 3 else 0,
                                 handoff_stall_ms=12.0 + i if i < 3 else None, **hits)
                         for i in range(10)], line_bytes=1_000_000),
    }


def test_report_files_follow_the_contract(tmp_path: Path) -> None:
    summaries = _summaries()
    meta = {"command": "pdd demo --requests 10", "config": {"requests": 10},
            "date": "2026-01-01T00:00:00+00:00"}
    paths = write_report(tmp_path, summaries, title="demo", meta=meta)

    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == {"modes", "meta"}
    assert list(report["modes"]) == ["colocated", "pd-same-dc", "pd-cross-dc", "pdd"]
    assert report["modes"]["pdd"]["relay_output_tokens"] == 20
    assert report["meta"] == meta

    pngs = sorted(p for p in paths.values() if p.suffix == ".png")
    assert {p.name for p in pngs} == {"ttft.png", "decode.png", "line.png", "producers.png", "handoffs.png"}
    assert report["modes"]["pdd"]["handoffs"] == {"one_shot": 3, "catch_up": 0}
    assert report["modes"]["pdd"]["handoff_stall_ms"]["p50"] == 13.0
    for png in pngs:
        data = png.read_bytes()
        assert data.startswith(PNG_SIGNATURE), png
        assert len(data) > 10_000, f"{png.name} is suspiciously small: {len(data)} bytes"

    page = paths["html"].read_text()
    for mode in summaries:
        assert f"<th>{mode}</th>" in page
    for png in pngs:  # relative names: the folder can be moved as a whole
        assert f'src="{png.name}"' in page
    assert "TTFT p99 (ms)" in page and "pdd demo --requests 10" in page


def test_plots_without_data_are_left_out(tmp_path: Path) -> None:
    write_report(tmp_path, _summaries(), title="first", meta={})
    baseline = {"colocated": _summary([_record(i, 50.0) for i in range(5)])}
    paths = write_report(tmp_path, baseline, title="second", meta={})

    assert "line" not in paths and "producers" not in paths and "handoffs" not in paths
    # A plot from the earlier run in the same folder must not pass for this run's.
    assert not (tmp_path / "line.png").exists() and not (tmp_path / "producers.png").exists()
    page = paths["html"].read_text()
    assert 'src="ttft.png"' in page and "line.png" not in page


def test_html_escapes_hostile_text(tmp_path: Path) -> None:
    hostile = '<script>alert("x")</script> & <b>'
    summaries = {hostile: _summaries()["pdd"]}
    paths = write_report(tmp_path, summaries, title=hostile, meta={"command": hostile})
    page = paths["html"].read_text()
    assert "<script>" not in page and "<b>" not in page
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; &amp; &lt;b&gt;" in page


_LAUNCHER = """
import argparse, os, socket, subprocess, sys, time
import httpx

parser = argparse.ArgumentParser(prog="fake-up")
parser.add_argument("--mode", choices=["alpha", "beta", "broken"], required=True)
parser.add_argument("--port", type=int, default=0)
parser.add_argument("--config")
parser.add_argument("--model")
for line_option in ("--bandwidth-mbps", "--delay-ms", "--jitter-ms", "--dilation"):  # the line, the pacing
    parser.add_argument(line_option, type=float, required=True)
parser.add_argument("--hardware", choices=["native", "emulated", "A", "B"], required=True)
args = parser.parse_args()
if args.mode == "broken":
    print("fake-up: the broken mode cannot start", flush=True)
    sys.exit(3)
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
server = subprocess.Popen(
    [sys.executable, "-m", "uvicorn", "--factory", "test_bench_client:make_app",
     "--app-dir", {tests!r}, "--host", "127.0.0.1", "--port", str(port)],
    env={{**os.environ, "PYTHONPATH": {repo!r}}})
with open({pids!r}, "a") as f:
    f.write(f"{{os.getpid()}} {{server.pid}}\\n")
with open({pids!r} + ".args", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
print(f"fake-up: starting {{args.mode}}", flush=True)
while True:
    try:
        if httpx.get(f"http://127.0.0.1:{{port}}/v1/models", timeout=1).status_code == 200:
            break
    except httpx.TransportError:
        time.sleep(0.1)
print(f"router: http://127.0.0.1:{{port}}", flush=True)
server.wait()
"""


def _running(pid: int) -> bool:
    """A process that exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_demo_compares_modes_and_leaves_nothing_running(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    pids = tmp_path / "pids.txt"
    launcher = tmp_path / "fake_up.py"
    launcher.write_text(textwrap.dedent(_LAUNCHER).format(tests=str(TESTS), repo=str(REPO),
                                                          pids=str(pids)))
    monkeypatch.setattr(demo_deploy, "up_command", lambda *args: [sys.executable, str(launcher), *args])
    out = tmp_path / "report"

    code = main(["demo", "--out", str(out), "--modes", "alpha,broken,beta,gamma",
                 "--requests", "6", "--quiet"])

    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads((out / "report.json").read_text())
    assert list(report["modes"]) == ["alpha", "beta"]
    requests = json.loads((out / "requests.json").read_text())
    assert {mode: len(r) for mode, r in requests.items()} == {"alpha": 6, "beta": 6}
    for summary in report["modes"].values():
        assert summary["requests"] == 6 and summary["completed"] == 6
    failed = report["meta"]["failed_modes"]
    assert set(failed) == {"broken", "gamma"}
    # The user is told why each missing mode is missing.
    assert "the broken mode cannot start" in captured.err
    assert "skipping mode 'gamma'" in captured.err
    assert "alpha" in captured.out and "beta" in captured.out
    assert str((out / "report.html").resolve()) in captured.out

    started = [int(p) for line in pids.read_text().splitlines() for p in line.split()]
    assert len(started) == 4  # launcher + server, for alpha and beta
    assert not [pid for pid in started if _running(pid)]


def test_demo_fits_its_scenario_to_the_model_and_passes_it_to_every_deployment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tiny_model_dir: Path) -> None:
    pids = tmp_path / "pids.txt"
    launcher = tmp_path / "fake_up.py"
    launcher.write_text(textwrap.dedent(_LAUNCHER).format(tests=str(TESTS), repo=str(REPO), pids=str(pids)))
    monkeypatch.setattr(demo_deploy, "up_command", lambda *args: [sys.executable, str(launcher), *args])
    model = tmp_path / "short-context"  # the tiny model's weights with a 1,024-token context
    model.mkdir()
    for file in tiny_model_dir.iterdir():
        (model / file.name).symlink_to(file)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))

    code = main(["demo", "--out", str(tmp_path / "report"), "--modes", "alpha,beta", "--requests", "3",
                 "--model", str(model), "--quiet"])

    err = capsys.readouterr().err
    assert code == 0, err
    meta = json.loads((tmp_path / "report" / "report.json").read_text())["meta"]
    workload, line = meta["config"]["workload"], meta["config"]["line"]
    assert workload["max_context"] == 1000 and workload["output_tokens"] == [80, 192]  # x 0.25
    assert line["bandwidth_mbps"] == 12.5  # the paper line x 0.25: same seconds per full-context miss
    assert "context 1024 tokens" in meta["scenario_fit"] and meta["scenario_fit"] in " ".join(err.split())
    assert "--model" in meta["command"] and meta["config"]["model"] == str(model)
    launched = (tmp_path / "pids.txt.args").read_text().splitlines()
    assert len(launched) == 2 and all(f"--model {model}" in args for args in launched)
