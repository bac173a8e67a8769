"""Two routers racing for one decode instance's last place (docs/deployment.md, "Two
routers"): each counts only what it committed itself, so both may plan onto md0; md0's
reservation is the authority. PD across the sites (pdd mode would hand a refused
reservation to its relay: the `main_refused` fallback). With md0 holding one request (`max_requests = 1`) for the
first router, the second router's request is refused by md0's reservation before any token
is sent and answered 429 in OpenAI's shape with a Retry-After, and once md0 is free again
the same request is served."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from procs import HTTP, free_port, pdd_process, pdd_up, stream_completion, wait_until

CONFIG = """mode = "pd-cross-dc"
[line]
bandwidth_mbps = 200.0
delay_ms = 2.0
jitter_ms = 0.5
[[instances]]
name = "p0"
role = "prefill"
dc = "A"
[[instances]]
name = "md0"
role = "main"
dc = "B"
[instances.engine]
max_requests = 1
"""
PROMPT = list(range(500, 620))


def test_the_router_that_loses_the_race_answers_429_then_serves(tmp_path):
    conf = tmp_path / "d.toml"
    conf.write_text(CONFIG)
    with pdd_up("--config", str(conf)) as dep:
        port = free_port()
        second = f"http://127.0.0.1:{port}"
        args = ["router", "--config", str(dep.run_dir / "deployment.toml"), "--port", str(port)]
        with pdd_process(args, f"{second}/ready") as router2, ThreadPoolExecutor(1) as pool:
            first = pool.submit(stream_completion, dep.url, PROMPT, 1500)
            md0 = dep.http["md0"]
            wait_until(lambda: HTTP.get(f"{md0}/pdd/stats", timeout=5).json()["node"]["held"] == 1, 30,
                       "md0 holds the first router's request")
            body = {"model": "tiny", "prompt": PROMPT[::-1], "max_tokens": 8, "temperature": 0}
            raced = HTTP.post(f"{second}/v1/completions", json=body, timeout=60)
            assert raced.status_code == 429, raced.text
            error = raced.json()["error"]
            assert error["type"] == "rate_limit_exceeded" and "md0" in error["message"], error
            assert int(raced.headers["retry-after"]) >= 1
            assert not first.done()  # (the race was run while md0 was full)
            got = first.result(timeout=120)
            assert got["error"] is None and len(got["ids"]) == 1500
            wait_until(lambda: HTTP.get(f"{md0}/pdd/stats", timeout=5).json()["node"]["held"] == 0, 30, "md0 free")
            time.sleep(0.2)
            again = HTTP.post(f"{second}/v1/completions", json=body, timeout=60)
            assert again.status_code == 200 and again.json()["pdd"]["instances"]["main"] == "md0", again.text
            assert router2.poll() is None
