"""An instance's framed-protocol side: requests from the router, KV between P and D.

Roles:
- standalone: SUBMIT runs the whole request; tokens go back to the submitting router.
- prefill (P): SUBMIT prefills, while the decode instance reserves; then P streams
  the KV the decode side lacks — chunk by chunk, one layer per frame — and tells it
  the first token. P reports hit lengths and bytes moved to the router (RESULT).
- main (MD): RESERVE locks its longest cached prefix and answers the authoritative
  hit; KV frames are imported as they arrive; KV_DONE starts decoding, whose tokens
  go to every connected router. Its radix cache events are published with sequence
  numbers so routers can mirror it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

from pdd.config import Deployment, InstanceSpec
from pdd.engine.kv_pool import OutOfPages
from pdd.engine.radix_cache import CacheEvent
from pdd.engine.sequence import SamplingParams
from pdd.instance.messages import BadMessage, int_of, params_from_wire, params_to_wire, rid_of, tokens_of
from pdd.instance.runtime import EngineRuntime
from pdd.kv import codec
from pdd.transfer import wire
from pdd.transfer.wire import FramedConnection, MsgType

log = logging.getLogger(__name__)
ACK_TIMEOUT_S = 60.0
RESERVE_WAIT_S = 45.0  # a full decode pool holds a reservation back this long, then refuses
HELLO_TIMEOUT_S = 10.0
MAX_TOMBSTONES = 4096


class Node:
    def __init__(self, spec: InstanceSpec, dep: Deployment, runtime: EngineRuntime, key: bytes) -> None:
        self.spec = spec
        self.dep = dep
        self.runtime = runtime
        self.key = key
        self.routers: set[FramedConnection] = set()
        self.event_seq = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.server: asyncio.Server | None = None
        self._peers: dict[str, FramedConnection] = {}
        self._peer_lock = asyncio.Lock()
        self._acks: dict[str, tuple[str, asyncio.Future]] = {}  # rid -> (decode instance, its RESERVE_ACK)
        self._tasks: set[asyncio.Task] = set()
        self._aborted: dict[str, None] = {}  # recent aborts, oldest first
        self._streams: set[str] = set()  # decode side: requests whose tokens go to the routers

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.server = await wire.serve(self._handle, self.spec.host, self.spec.kv_port, self.key)

    def on_cache_event(self, event: CacheEvent) -> None:
        """Called on the engine thread, which numbers events: a snapshot taken there (see
        `_send_snapshot`) then has exactly the events up to its number in it."""
        self.event_seq += 1
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._publish, self.event_seq, event)

    def _publish(self, seq: int, event: CacheEvent) -> None:
        self._broadcast(MsgType.CACHE_EVENT, {"seq": seq, "kind": event[0], "hashes": event[1]})

    def _tombstone(self, rid: str) -> None:
        """Remember an aborted id, so a request that arrives after its abort never runs."""
        self._aborted[rid] = None
        while len(self._aborted) > MAX_TOMBSTONES:
            del self._aborted[next(iter(self._aborted))]

    async def stop(self) -> None:
        if self.server:
            self.server.close()
        for t in list(self._tasks):
            t.cancel()
        for conn in [*self.routers, *self._peers.values()]:
            conn.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    async def _send(conn: FramedConnection, kind: MsgType, msg: dict) -> None:
        try:
            await conn.send_json(kind, msg)
        except (ConnectionError, RuntimeError) as e:
            log.debug("send to %s failed: %s", conn.peer, e)

    # ---- inbound connections -----------------------------------------------------------------
    async def _handle(self, conn: FramedConnection) -> None:
        # a peer that connects and says nothing (or half a frame) does not hold a slot forever
        hello = await asyncio.wait_for(wire.server_handshake(conn), HELLO_TIMEOUT_S)
        peer_role = hello.get("role")
        if peer_role == "router":
            await self._serve_router(conn)
        elif peer_role == "prefill" and self.spec.role == "main":
            await self._serve_prefill_peer(conn)
        else:
            await conn.send_json(MsgType.ERROR, {"message": f"{self.spec.role} does not serve {peer_role!r}"})

    async def _send_snapshot(self, conn: FramedConnection) -> None:
        """All cached hashes and the number of the last event they include.

        The router is subscribed before this, so no later event is missed; events it gets
        that the snapshot already holds (numbers up to the snapshot's) it ignores.
        """
        seq, hashes = await self.runtime.call(lambda e: (self.event_seq, e.cache.hashes()))
        await conn.send_json(MsgType.CACHE_EVENT, {"seq": seq, "kind": "snapshot", "hashes": hashes,
                                                   "page_size": self.runtime.engine.pool.page_size})

    async def _serve_router(self, conn: FramedConnection) -> None:
        submitted: set[str] = set()  # requests this router runs here, until they end
        self.routers.add(conn)
        try:
            await self._send_snapshot(conn)
            while True:
                frame = await conn.recv()
                msg = frame.json()
                try:
                    if frame.type == MsgType.SUBMIT:
                        self._spawn(self._submit(conn, msg, submitted))
                    elif frame.type == MsgType.ABORT:
                        rid = rid_of(msg)
                        self._tombstone(rid)
                        self.runtime.abort(rid)
                    elif frame.type == MsgType.CACHE_EVENT:  # the router lost track: resend all
                        self._spawn(self._send_snapshot(conn))
                    elif frame.type == MsgType.PING:
                        await conn.send(MsgType.PONG, frame.payload)
                except BadMessage as e:
                    await conn.send_json(MsgType.ERROR, {"rid": msg.get("rid"), "message": str(e)})
        finally:
            # Nobody will read these tokens any more: stop computing them. A decode
            # instance streams to every router, so its requests stop with the last one.
            self.routers.discard(conn)
            for rid in submitted | (set() if self.routers else self._streams):
                self._tombstone(rid)
                self.runtime.abort(rid)

    async def _submit(self, conn: FramedConnection, msg: dict, submitted: set[str]) -> None:
        rid = rid_of(msg)
        if rid in self._aborted:
            return
        submitted.add(rid)
        try:
            prompt, params = tokens_of(msg, "prompt"), params_from_wire(msg.get("params"))
            if self.spec.role == "standalone":
                await self._generate(conn, rid, prompt, params)
            elif self.spec.role == "prefill":
                await self._prefill(conn, rid, prompt, params, msg)
            else:
                raise BadMessage(f"a {self.spec.role} instance does not take SUBMIT")
        except Exception as e:  # the request fails; the instance keeps serving
            if not isinstance(e, (BadMessage, ConnectionError, asyncio.TimeoutError, ValueError)):
                log.exception("request %s failed", rid)
            await self._send(conn, MsgType.ERROR, {"rid": rid, "message": f"{type(e).__name__}: {e}"})
        finally:
            submitted.discard(rid)

    async def _generate(self, conn: FramedConnection, rid: str, prompt: list[int], params: SamplingParams) -> None:
        async for out in self.runtime.generate(rid, prompt, params):
            await conn.send_json(MsgType.TOKENS, _tokens_msg(rid, out))

    # ---- prefill side ------------------------------------------------------------------------
    async def _peer(self, name: str) -> FramedConnection:
        """A shared connection to a decode instance (through the WAN when remote)."""
        async with self._peer_lock:
            conn = self._peers.get(name)
            if conn is not None and not conn.closed:
                return conn
            target = self.dep.instance(name)
            host, port = self.dep.address(target, self.spec.dc)
            conn = await wire.open_connection(host, port, self.key)
            try:
                await asyncio.wait_for(wire.client_handshake(conn, {"role": "prefill", "name": self.spec.name}),
                                       HELLO_TIMEOUT_S)
            except BaseException:
                conn.close()
                raise
            self._peers[name] = conn
            self._spawn(self._read_peer(name, conn))
            return conn

    async def _read_peer(self, name: str, conn: FramedConnection) -> None:
        try:
            while True:
                msg = (await conn.recv()).json()
                _, fut = self._acks.pop(str(msg.get("rid")), (None, None))
                if fut and not fut.done():
                    fut.set_result(msg)
        except (ConnectionError, wire.FrameError) as e:
            log.warning("connection to decode instance %s lost: %s", name, e)
        finally:
            if self._peers.get(name) is conn:
                del self._peers[name]
            conn.close()
            for rid, (peer, fut) in list(self._acks.items()):  # requests waiting on this peer fail now
                if peer == name:
                    del self._acks[rid]
                    if not fut.done():
                        fut.set_exception(ConnectionError(f"decode instance {name} unreachable"))

    async def _prefill(self, conn: FramedConnection, rid: str, prompt: list[int], params: SamplingParams, msg: dict) -> None:
        decode = msg.get("decode")
        if not isinstance(decode, str):
            raise BadMessage("decode must name the decode instance")
        md = await self._peer(decode)
        ack = asyncio.get_running_loop().create_future()
        self._acks[rid] = (decode, ack)
        first, cached, reason = None, 0, None
        try:
            await md.send_json(MsgType.RESERVE, {"rid": rid, "prompt": prompt, "params": params_to_wire(params),
                                                 "use_cache": bool(msg.get("use_cache", True))})
            async for out in self.runtime.generate(rid, prompt, replace(params, max_tokens=1), hold=True):
                first, cached, reason = out.token, out.cached_tokens, out.finish_reason
            if first is None:
                raise RuntimeError("prefill was aborted")
            reply = await asyncio.wait_for(ack, ACK_TIMEOUT_S)
            if reply.get("error"):
                raise RuntimeError(f"decode instance refused: {reply['error']}")
            hit = int_of(reply, "hit")
            done = reason == "stop" or params.max_tokens == 1
            sent = 0 if done else await self._send_kv(md, rid, hit, len(prompt))
            if done:  # nothing left to decode: P's token is the whole answer
                await md.send_json(MsgType.RELEASE, {"rid": rid})
            else:
                await md.send_json(MsgType.KV_DONE, {"rid": rid, "first_token": first})
        except BaseException:
            self._acks.pop(rid, None)
            await self._send(md, MsgType.ABORT, {"rid": rid})
            raise
        finally:
            await self.runtime.call(lambda e: e.release(rid))
        remote = self.dep.instance(decode).dc != self.spec.dc
        await conn.send_json(MsgType.RESULT, {"rid": rid, "p_hit": cached, "d_hit": hit, "kv_bytes": sent,
                                              "wan_bytes": sent if remote else 0})
        if done:
            await conn.send_json(MsgType.TOKENS, {"rid": rid, "tokens": [first], "finish_reason": reason or "length",
                                                  "cached_tokens": cached})

    async def _send_kv(self, md: FramedConnection, rid: str, start: int, end: int) -> int:
        """Stream tokens [start, end) of rid's KV: chunk by chunk, one layer per frame."""
        sent = 0
        step = self.dep.policy.kv_chunk_tokens
        for a in range(start, end, step):
            b = min(end, a + step)
            blob = await self.runtime.call(lambda e, a=a, b=b: e.export_kv(rid, a, b))
            for i in range(blob.k.shape[0]):
                header = replace(blob.header, layer_start=blob.header.layer_start + i, layer_end=blob.header.layer_start + i + 1)
                layer = codec.encode(codec.KVBlob(header, blob.k[i : i + 1], blob.v[i : i + 1]))
                payload = wire.pack_with_header({"rid": rid}, layer)
                await md.send(MsgType.KV_LAYER, payload)
                sent += len(payload)
        return sent

    # ---- decode side -------------------------------------------------------------------------
    async def _serve_prefill_peer(self, conn: FramedConnection) -> None:
        pending: set[str] = set()  # reserved here by this peer, KV not complete yet
        layers: dict[str, list[codec.KVBlob]] = {}  # rid -> layers of the chunk in flight
        try:
            while True:
                frame = await conn.recv()
                try:
                    await self._on_peer_frame(conn, frame, pending, layers)
                except Exception as e:  # one bad request must not end the connection's others
                    log.warning("request from prefill peer failed: %s: %s", type(e).__name__, e)
                    rid = _maybe_rid(frame)
                    if rid:  # tell whoever waits: P (for its reservation) and the routers
                        pending.discard(rid)
                        layers.pop(rid, None)
                        self.runtime.abort(rid)
                        await self._send(conn, MsgType.RESERVE_ACK, {"rid": rid, "error": str(e)})
                        self._broadcast(MsgType.ERROR, {"rid": rid, "message": f"decode instance: {e}"})
        finally:
            gone = list(pending)
            pending.clear()
            for rid in gone:  # the prefill side is gone: drop what it reserved (or waits for)
                await self.runtime.call(lambda e, rid=rid: e.release(rid))

    async def _on_peer_frame(self, conn: FramedConnection, frame: wire.Frame, pending: set[str],
                             layers: dict[str, list[codec.KVBlob]]) -> None:
        if frame.type == MsgType.KV_LAYER:
            header, body = wire.unpack_with_header(frame.payload)
            rid, blob = rid_of(header), codec.decode(body)
            chunk = layers.setdefault(rid, [])
            chunk.append(blob)
            if blob.header.layer_end == blob.header.num_layers:  # the chunk's last layer: import it whole
                del layers[rid]
                whole = codec.join_layers(chunk)
                await self.runtime.call(lambda e: e.import_kv(rid, whole))
            return
        msg = frame.json()
        rid = rid_of(msg)
        if frame.type == MsgType.RESERVE:
            prompt, params = tokens_of(msg, "prompt"), params_from_wire(msg.get("params"))
            pending.add(rid)
            self._spawn(self._reserve(conn, rid, prompt, params, bool(msg.get("use_cache", True)), pending))
        elif frame.type == MsgType.KV_DONE:
            first = int_of(msg, "first_token")
            pending.discard(rid)
            q = self.runtime.watch(rid)
            try:
                cached = await self.runtime.call(lambda e: e.start(rid, [first]).cached_tokens)
            except Exception:
                self.runtime.unwatch(rid)
                raise
            self._broadcast(MsgType.TOKENS, {"rid": rid, "tokens": [first], "finish_reason": None, "cached_tokens": cached})
            self._spawn(self._forward(rid, q))
        elif frame.type in (MsgType.RELEASE, MsgType.ABORT):
            pending.discard(rid)
            await self.runtime.call(lambda e: e.release(rid))

    async def _reserve(self, conn: FramedConnection, rid: str, prompt: list[int], params: SamplingParams,
                       use_cache: bool, pending: set[str]) -> None:
        """Reserve, waiting while the pool is full: finishing requests free pages.

        A task of its own, so a waiting reservation never stalls the KV frames of the
        requests whose completion it waits for.
        """
        deadline = time.monotonic() + RESERVE_WAIT_S
        while rid in pending and rid not in self._aborted:  # an ABORT or RELEASE while waiting withdraws it
            try:
                hit = await self.runtime.call(lambda e: e.reserve(rid, prompt, params, use_cache))
            except OutOfPages as e:
                if time.monotonic() > deadline:
                    pending.discard(rid)
                    await self._send(conn, MsgType.RESERVE_ACK, {"rid": rid, "error": f"decode instance full: {e}"})
                    return
                await asyncio.sleep(0.05)
                continue
            except Exception as e:
                pending.discard(rid)
                await self._send(conn, MsgType.RESERVE_ACK, {"rid": rid, "error": str(e)})
                return
            if rid not in pending:
                await self.runtime.call(lambda e: e.release(rid))
                return
            await self._send(conn, MsgType.RESERVE_ACK, {"rid": rid, "hit": hit})
            return

    async def _forward(self, rid: str, q: asyncio.Queue) -> None:
        self._streams.add(rid)
        try:
            async for out in EngineRuntime.stream(q):
                self._broadcast(MsgType.TOKENS, _tokens_msg(rid, out))
        except RuntimeError as e:  # the engine failed this request: say so, don't go silent
            self._broadcast(MsgType.ERROR, {"rid": rid, "message": f"decode instance: {e}"})
        finally:
            self._streams.discard(rid)
            self.runtime.unwatch(rid)

    def _broadcast(self, kind: MsgType, msg: dict) -> None:
        for conn in list(self.routers):
            self._spawn(self._send(conn, kind, msg))


def _tokens_msg(rid: str, out) -> dict:
    return {"rid": rid, "tokens": [] if out.token is None else [out.token], "finish_reason": out.finish_reason,
            "cached_tokens": out.cached_tokens}


def _maybe_rid(frame: wire.Frame) -> str | None:
    try:
        if frame.type == MsgType.KV_LAYER:
            return rid_of(wire.unpack_with_header(frame.payload)[0])
        return rid_of(frame.json())
    except (BadMessage, wire.FrameError, ValueError):
        return None

