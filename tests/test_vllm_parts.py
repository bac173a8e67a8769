"""The vLLM backend's parts, each on its own: the bridge's framing, the block-hash mapping
of vLLM's KV events, the layouts of vLLM's caches against vLLM's own packing kernel,
pdd's draw inside vLLM's sampler, the scheduler side's bookkeeping, and how pdd's
`[engine]` table becomes vLLM's arguments. No vLLM engine runs here (see
test_vllm_engine.py); vLLM must be installed (`pip install -e '.[vllm]'`)."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine.output_processor import RequestOutputCollector  # noqa: E402

from pdd import config as cfg  # noqa: E402
from pdd.engines.port import AUTO, EngineConfig, engine_options, for_backend  # noqa: E402
from pdd.engines.vllm import args as vargs  # noqa: E402
from pdd.engines.vllm import bridge, staging, streams  # noqa: E402
from pdd.engines.vllm.draw import PddDraw, draw_args  # noqa: E402
from pdd.engines.vllm.events import VllmHashes  # noqa: E402
from pdd.engines.vllm.scheduler_side import SchedulerSide  # noqa: E402
from pdd.kv.blocks import block_hashes  # noqa: E402
from pdd.sampling.draw import sample  # noqa: E402
from pdd.sampling.params import SamplingParams  # noqa: E402

# ---- pdd's draw inside vLLM ------------------------------------------------------------------

def test_draw_leaves_only_pdds_token_at_each_position():
    proc = PddDraw(None, torch.device("cpu"), False)
    params = SamplingParams(max_tokens=8, temperature=2.0, top_p=0.9, seed=77)
    vparams = SimpleNamespace(extra_args=draw_args(params, 77, [1], [21, 22, 23, 24, 25], frozenset()))  # 5 given
    outputs: list[int] = [11, 12]  # vLLM's live list: two tokens sampled in this request so far
    plain = SimpleNamespace(extra_args=None)
    proc.update_state(SimpleNamespace(batch_size=2, added=[(0, plain, [1], []), (1, vparams, [1], outputs)],
                                      removed=[], moved=[]))
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    out = proc.apply(logits.clone())
    want = sample(before[1:2], [params], [77], [5 + 2])[0]
    assert out[1].argmax().item() == want and torch.isinf(out[1]).sum() == 299
    assert torch.equal(out[0], before[0])  # a request without pdd's draw is untouched
    outputs.append(want)
    want_next = sample(before[1:2], [params], [77], [8])[0]
    assert proc.apply(before.clone())[1].argmax().item() == want_next


# ---- vLLM's cache under pdd's names ------------------------------------------------------------

def test_vllm_blocks_are_named_by_pdds_chained_hashes():
    tokens = list(range(100, 196))  # three blocks of 32
    names = VllmHashes(32)
    stored = names.stored(None, [b"a", b"b"], tokens[:64], 32) + names.stored(b"b", [b"c"], tokens[64:], 32)
    assert stored == block_hashes(tokens, 32)  # what the router's mirror computes for the prompt
    assert names.cached_prefix(block_hashes(tokens + [1] * 40, 32)) == 3
    assert names.stored(b"zz", [b"d"], tokens[:32], 32) == [] and names.unknown_parents == 1
    assert names.stored(None, [b"s"], tokens[:32], 32, [("pdd-uncached:r1",)]) == []  # an uncached import's salt
    assert names.removed([b"b", b"x"]) == [stored[1]]
    assert names.cached_prefix(block_hashes(tokens, 32)) == 1
    seq, hashes = names.snapshot()
    assert sorted(hashes) == sorted([stored[0], stored[2]])
    with pytest.raises(ValueError):
        names.stored(None, [b"e"], tokens[:16], 16)


def test_a_page_stays_cached_while_any_vllm_block_holds_it():
    tokens = list(range(100, 132))
    names = VllmHashes(32)
    page = block_hashes(tokens, 32)
    names.stored(None, [b"a"], tokens, 32)
    names.stored(None, [b"a"], tokens, 32)  # stored again (after an eviction vLLM missed telling): one block
    names.stored(None, [b"b"], tokens, 32)  # a second vLLM block with the same tokens
    assert names.removed([b"a"]) == page and names.cached_prefix(page) == 1
    assert names.removed([b"b"]) == page and names.cached_prefix(page) == 0
    names.stored(None, [b"c"], tokens, 32)
    assert names.cleared() == page and names.cached_prefix(page) == 0


# ---- the bridge ------------------------------------------------------------------------------

def test_bridge_carries_json_and_descriptors_and_refuses_strangers():
    got = []
    with tempfile.TemporaryDirectory() as d:
        server = bridge.BridgeServer(d, lambda peer, h: got.append((peer["side"], h)), lambda peer: None)
        assert oct(os.stat(d).st_mode & 0o777) == "0o700"
        channel = bridge.Channel(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        channel._sock.connect(server.path)
        channel.send({"op": "hello", "token": "wrong", "side": "worker"})
        try:
            channel.send({"op": "write"})  # (the server may have closed already: a broken pipe)
            stranger_gone = channel._sock.recv(1) == b""
        except (BrokenPipeError, ConnectionResetError):  # (or it closed with our frame unread)
            stranger_gone = True
        c = bridge.Channel(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        c._sock.connect(server.path)
        c.send({"op": "hello", "token": server.token, "side": "worker"})
        region = staging.Region.create(slot_bytes=4096, slots=2)
        region.flat[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        c.send({"op": "layout", "n": 1}, fds=(region.fd,))
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.close()
    assert stranger_gone
    assert got[0] == ("worker", {"op": "hello"}) and got[1][1]["op"] == "layout"
    fds = got[1][1]["fds"]
    assert len(fds) == 1 and fds[0] != region.fd
    mapped = staging.Region.attach(fds[0], 4096, 2)  # the same pages, seen from the other end
    assert mapped.flat[:4].tolist() == [1, 2, 3, 4]
    mapped.flat[4] = 9
    assert int(region.flat[4]) == 9


def test_a_bridge_frame_over_the_limits_is_not_read():
    a, b = socket.socketpair()
    a.sendall(bridge._FRAME.pack(bridge.MAGIC, bridge.MAX_HEADER_BYTES + 1))
    with pytest.raises(bridge.BridgeError):
        bridge.Channel(b).recv()


def test_a_message_whose_descriptors_do_not_match_its_header_is_refused():
    a, b = socket.socketpair()
    body = b'{"op":"layout","fds":2}'
    socket.send_fds(a, [bridge._FRAME.pack(bridge.MAGIC, len(body)) + body], [os.memfd_create("x")])
    with pytest.raises(bridge.BridgeError, match="names 2 descriptors and carried 1"):
        bridge.Channel(b).recv()


# ---- the scheduler side's bookkeeping ------------------------------------------------------------

class _Pool:
    num_gpu_blocks = 101

    def __init__(self, free: int) -> None:
        self.free = free

    def get_num_free_blocks(self) -> int:
        return self.free


def _request(vid: str, tokens: int, **pdd) -> SimpleNamespace:
    from vllm.v1.request import RequestStatus

    return SimpleNamespace(request_id=vid, num_tokens=tokens, num_computed_tokens=tokens,
                           kv_transfer_params={"pdd": pdd}, status=RequestStatus.FINISHED_LENGTH_CAPPED)


def _output(tokens: dict[str, int]) -> SimpleNamespace:
    return SimpleNamespace(total_num_scheduled_tokens=sum(tokens.values()), num_scheduled_tokens=tokens)


@pytest.fixture
def scheduler(monkeypatch):
    sent: list[dict] = []
    monkeypatch.setattr(bridge, "connect", lambda *a: SimpleNamespace(send=lambda h, p=b"": sent.append(h)))
    monkeypatch.setattr(bridge, "serve_forever", lambda *a: None)
    side = SchedulerSide(32, {"bridge": "", "token": ""})
    side.block_pool = _Pool(free=10)
    return side, sent


def test_a_reservation_is_an_async_load_reported_once(scheduler):
    side, sent = scheduler
    req = _request("v1", 300, rid="r1", op="import")
    assert side.get_num_new_matched_tokens(req, 64) == (236, True)  # all past vLLM's own hit
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14],)),
                                  236)
    assert sent[-1] == {"op": "reserved", "rid": "r1", "hit": 64, "blocks": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]}
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # preempted later: recomputed, not reloaded
    side.inbox.put(("loaded", "r1"))
    assert side.build_meta(_output({"v1": 0})).loaded == ["v1"]
    side.inbox.put(("loaded", "r1"))
    assert side.build_meta(_output({"v1": 1})).loaded == []  # never twice: vLLM asserts on that
    assert side.request_finished(req, [5]) is False
    assert sent[-1]["op"] == "finished" and sent[-1]["computed"] == 1 and sent[-1]["held"] is None


def test_a_pool_that_cannot_hold_the_prompt_refuses_and_an_aborted_load_is_reported(scheduler):
    side, sent = scheduler
    big = _request("v2", 32 * 11, rid="r2", op="import")
    assert side.get_num_new_matched_tokens(big, 0) == (None, False)
    assert sent[-1]["op"] == "refused" and sent[-1]["need"] == 11
    small = _request("v3", 32 * 3, rid="r3", op="import")
    side.get_num_new_matched_tokens(small, 0)
    side.update_state_after_alloc(small, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 96)
    side.request_finished(small, [1, 2, 3])  # aborted while its KV was on the way
    assert side.build_meta(_output({})).loaded == ["v3"]  # its workers report it: vLLM then frees the blocks


def test_a_hold_keeps_blocks_until_released_even_if_released_first(scheduler):
    side, sent = scheduler
    held = _request("v4", 200, rid="r4", hold=True)
    assert side.request_finished(held, [7, 8, 9, 10, 11, 12, 13]) is True
    assert sent[-1] == {"op": "finished", "rid": "r4", "computed": 0, "held": [7, 8, 9, 10, 11, 12, 13],
                        "tokens": 200}
    side.inbox.put(("free", "r4"))
    assert side.build_meta(_output({})).freed == ["v4"]
    side.inbox.put(("free", "r5"))  # released before its request finished
    side.build_meta(_output({}))
    assert side.request_finished(_request("v5", 50, rid="r5", hold=True), [1, 2]) is False


def test_usage_is_reported_when_it_changes(scheduler):
    side, sent = scheduler
    side.report_usage()
    side.report_usage()
    side.block_pool.free = 100
    side.report_usage()
    assert [h for h in sent if h["op"] == "load"] == [{"op": "load", "used_blocks": 90},
                                                       {"op": "load", "used_blocks": 0}]


# ---- a streaming session's outputs ------------------------------------------------------------

def _session(*kinds: tuple[str, int]) -> tuple[streams.Request, streams.Watch]:
    req = streams.Request("s1", [1, 2, 3], SamplingParams(max_tokens=8), 0, session=True)
    req.chunks.extend(kinds)
    watch = streams.Watch(lambda: None)
    req.watchers.append(watch)
    return req, watch


def _vllm_output(tokens: list[int], reason: str | None) -> RequestOutput:
    return RequestOutput("s1", None, [1, 2, 3], None, [CompletionOutput(0, "", tokens, None, None,
                                                                        finish_reason=reason)], False)


def _delivered(req: streams.Request, watch: streams.Watch, outputs: list[RequestOutput], merged: bool) -> tuple:
    """What pdd's watchers see of `outputs`, read one by one or after vLLM's collector merged them
    all (its consumer late: what a busy loop does); [(token, finish, caught_up)]."""
    collector = RequestOutputCollector(RequestOutputKind.DELTA, "s1")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    done = []
    for out in outputs:
        collector.put(out)
        if not merged:
            done.append(streams.deliver(req, collector.get_nowait()))
    if merged:
        out = collector.get_nowait()
        assert len(out.outputs[0].token_ids) == total  # (the collector merges in place, into the first)
        done.append(streams.deliver(req, out))
    seen = []
    while not watch.queue.empty():
        o = watch.queue.get_nowait()
        seen.append((o.token, o.finish_reason, o.caught_up))
    return seen, done[-1]


@pytest.mark.parametrize("merged", [False, True], ids=["one-by-one", "merged"])
def test_a_final_chunk_glued_to_the_load_chunk_still_streams(merged):
    """The load chunk's dropped token and finish, then the final chunk's tokens: the final
    chunk's tokens are the outputs, however vLLM's collector grouped them."""
    req, watch = _session((streams.LOAD, 0), (streams.FINAL, 1))
    outs = [_vllm_output([9], "length"), _vllm_output([11, 12], None), _vllm_output([13], "length")]
    seen, done = _delivered(req, watch, outs, merged)
    assert [(t, f) for t, f, _ in seen] == [(11, None), (12, None), (13, "length")]
    assert done and req.outputs == [11, 12, 13] and list(req.chunks) == [(streams.FINAL, 1)]


@pytest.mark.parametrize("merged", [False, True], ids=["one-by-one", "merged"])
def test_catch_up_chunks_glued_together_each_report_caught_up(merged):
    req, watch = _session((streams.LOAD, 0), (streams.SHADOW, 3), (streams.SHADOW, 5), (streams.FINAL, 6))
    outs = [_vllm_output([9], "length"), _vllm_output([1], "length"), _vllm_output([2], "length"),
            _vllm_output([21], None)]
    seen, done = _delivered(req, watch, outs, merged)
    assert seen == [(None, None, 3), (None, None, 5), (21, None, None)]
    assert not done and req.outputs == [21]


def test_a_kv_chunk_ended_without_its_token_ends_alone():
    req, watch = _session((streams.LOAD, 0), (streams.FINAL, 1))
    seen, done = _delivered(req, watch, [_vllm_output([], "abort")], merged=False)
    assert seen == [] and not done and list(req.chunks) == [(streams.FINAL, 1)]


# ---- pdd's [engine] table as vLLM's arguments ------------------------------------------------------

def test_engine_table_becomes_vllms_arguments(tiny_model_dir):
    config = EngineConfig(backend="vllm", page_size=32, num_pages=100, max_running=8, max_batch_tokens=512,
                          vllm={"seed": 3, "gpu_memory_utilization": 0.5})
    kw = vargs.engine_kwargs(tiny_model_dir, config, "/b.sock", "t", "ipc://e", "ipc://r")
    assert (kw["block_size"], kw["num_gpu_blocks_override"], kw["max_num_seqs"], kw["max_num_batched_tokens"]) == \
        (32, 101, 8, 512)
    assert kw["seed"] == 3 and kw["gpu_memory_utilization"] == 0.5
    # blocks x tokens x layers x K,V x heads x dim x fp32
    assert kw["kv_cache_memory_bytes"] == 101 * 32 * 4 * 2 * 2 * 64 * 4
    assert kw["kv_transfer_config"]["kv_connector_module_path"] == "pdd.engines.vllm.connector"
    assert kw["distributed_executor_backend"] == "uni" and kw["logits_processors"][0].endswith(":PddDraw")
    with pytest.raises(ValueError, match="block_size.*page_size"):
        vargs.engine_kwargs(tiny_model_dir, EngineConfig(backend="vllm", page_size=32, vllm={"block_size": 16}),
                            "", "", "", "")
    with pytest.raises(ValueError, match="multiple of 32"):
        vargs.engine_kwargs(tiny_model_dir, EngineConfig(backend="vllm", page_size=16), "", "", "", "")
    with pytest.raises(ValueError, match="emulated chip"):  # pacing is the embedded engine's
        vargs.engine_kwargs(tiny_model_dir, EngineConfig(backend="vllm", page_size=32, hardware="A"), "", "", "", "")
    with pytest.raises(ValueError, match=r"max_running = 8 and \[engine.vllm\] max_num_seqs"):  # one value, twice
        vargs.engine_kwargs(tiny_model_dir, replace(config, vllm={"max_num_seqs": 4}), "", "", "", "")


def test_vllm_sizes_itself_unless_told(monkeypatch):
    """On vLLM, pdd's own defaults are no choice: the pool, the budgets and the dtype are
    vLLM's (nothing of them passed), and on CPU each instance gets a KV budget of its own."""
    from pdd.model.store import resolve_model

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # (vLLM's own CPU budget would win)
    config = for_backend(EngineConfig(), "vllm")
    assert (config.num_pages, config.max_running, config.max_batch_tokens, config.dtype) == (AUTO, AUTO, AUTO, "auto")
    kw = vargs.engine_kwargs(resolve_model(""), config, "", "", "", "")
    assert not {"num_gpu_blocks_override", "max_num_seqs", "max_num_batched_tokens", "dtype", "max_model_len"} & set(kw)
    assert kw["kv_cache_memory_bytes"] == vargs.CPU_KV_BYTES
    # vLLM's own spelling is taken where pdd's is auto; a chosen value stays chosen
    kw = vargs.engine_kwargs(resolve_model(""), replace(config, vllm={"max_num_seqs": 4, "dtype": "bfloat16"}),
                             "", "", "", "")
    assert (kw["max_num_seqs"], kw["dtype"]) == (4, "bfloat16")
    chosen = for_backend(EngineConfig(num_pages=300, dtype="float32"), "vllm", {"num_pages", "dtype"})
    assert (chosen.num_pages, chosen.dtype, chosen.max_running) == (150, "float32", AUTO)  # 4,800 tokens in pages of 32
    with pytest.raises(ValueError, match="embedded engine needs a dtype"):
        EngineConfig(dtype="auto")
    with pytest.raises(ValueError, match='num_pages must be at least 1 or "auto" on vllm'):
        EngineConfig(num_pages=AUTO)


def test_vllm_table_and_backend_page_size_in_the_deployment_file():
    dep = cfg.parse({"engine": {"backend": "vllm", "vllm": {"tensor_parallel_size": 2}},
                     "instances": [{"name": "md0", "role": "main", "dc": "B",
                                    "engine": {"vllm": {"gpu_memory_utilization": 0.9}}},
                                   {"name": "p0", "role": "prefill",
                                    "engine": {"backend": "embedded", "page_size": 16}}]})
    md, p = dep.instances
    assert (dep.engine.page_size, dep.engine.num_pages) == (32, AUTO)  # vLLM's default page, vLLM's own pool
    assert md.engine.vllm == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.9}
    # an embedded instance in a vLLM deployment: pdd's sizes again, not "auto"
    assert (p.engine.backend, p.engine.page_size, p.engine.num_pages, p.engine.dtype) == ("embedded", 16, 2048,
                                                                                           "float32")
    assert cfg.parse(__import__("tomllib").loads(cfg.dump(dep))) == dep  # what `pdd up` writes, its children read
    assert for_backend(EngineConfig(page_size=64), "vllm").page_size == 64  # a chosen page size stays
    assert cfg.parse({"engine": {"backend": "vllm", "num_pages": "auto", "page_size": 32}}).engine.num_pages == AUTO
    assert cfg.parse({"engine": {"backend": "vllm", "num_pages": 64}}).engine.num_pages == 32  # 1,024 tokens
    with pytest.raises(cfg.ConfigError, match="num_pages"):
        cfg.parse({"engine": {"num_pages": "auto"}})  # the embedded engine's pool is a number


def test_a_parallel_instance_without_a_gpu_per_rank_is_refused_at_load():
    """TP 4 on one named GPU cannot start: refused when the file is read, naming the key."""
    gpu = {"backend": "vllm", "device": "cuda:0", "vllm": {"tensor_parallel_size": 4}}
    with pytest.raises(cfg.ConfigError, match=r"instances.md0.engine.device = 'cuda:0' names 1 GPU.* = 4: list"):
        cfg.parse({"instances": [{"name": "md0", "role": "main", "engine": gpu}]})
    with pytest.raises(cfg.ConfigError, match=r"^engine.device"):
        cfg.parse({"engine": gpu})
    four = cfg.parse({"instances": [{"name": "md0", "role": "main", "engine": {**gpu, "device": "cuda:4,5,6,7"}}]})
    assert vargs.engine_env(four.instances[0].engine, 1) == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert cfg.parse({"engine": {**gpu, "device": "cuda"}}).engine.device == "cuda"  # all it sees
    with pytest.raises(cfg.ConfigError, match="device must be"):
        cfg.parse({"engine": {"device": "cuda:0,0"}})


    assert engine_options(["tensor_parallel_size=2", "quantization=fp8", "enforce_eager=false"]) == \
        {"tensor_parallel_size": 2, "quantization": "fp8", "enforce_eager": False}


def test_a_request_vllm_defers_is_not_waiting_for_a_slot():
    """vLLM defers a request waiting for its KV (or for the connector, as the export of a
    finished one's output for MD's fill): it does not wait for a place in the batch, so a
    relay holding nothing is not loaded by it and takes the next request (a relay that
    counted it turned a session's second turn away, straight after its first)."""
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats

    from pdd.engines.vllm.stats import StatsTap
    from pdd.policy.capacity import relay_accepts

    into = {"prefix_cache_queries": 0, "prefix_cache_hits": 0}
    tap = StatsTap(into)
    tap.record(SchedulerStats(num_waiting_reqs=0, num_skipped_waiting_reqs=1,
                              prefix_cache_stats=PrefixCacheStats()), None)
    assert (into["waiting"], into["deferred"]) == (0, 1)
    assert relay_accepts(held=0, waiting=into["waiting"], max_running=128)
    tap.record(SchedulerStats(num_waiting_reqs=2, prefix_cache_stats=PrefixCacheStats()), None)
    assert into["waiting"] == 2 and not relay_accepts(held=2, waiting=into["waiting"], max_running=128)
