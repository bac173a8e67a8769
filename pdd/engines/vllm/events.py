"""vLLM's prefix cache, as pdd's router sees caches: chained block hashes, from vLLM's KV events.

vLLM publishes every block it caches (`BlockStored`: the blocks' hashes, their parent's
hash, their token ids) and evicts (`BlockRemoved`) over ZMQ, numbered, with a replay
socket for what a subscriber missed. vLLM's hashes are its own (seeded, salted,
SHA-256); pdd's router hashes a prompt with `pdd.kv.blocks.block_hashes` over pages of
the instance's page size. An instance on vLLM has one page size, vLLM's block size,
and only full blocks are ever cached, so each vLLM block is exactly one pdd page:
its pdd hash is `chain_hash(pdd hash of its parent, its tokens)`, and `VllmHashes`
keeps vLLM's hash -> pdd's hash for every cached block, which is also what a
snapshot reports. A request's cache_salt reaches vLLM as `SALT_PREFIX + salt`, and
its first block's hash chains from that salt's namespace root (`namespace_root`), as
the router hashes the prompt; blocks with other extra keys (an uncached import's own
salt, a LoRA, an image) are left out: no prompt the router hashes can hit them.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

from pdd.kv.blocks import chain_hash, namespace_root

log = logging.getLogger(__name__)
Listener = Callable[[int, str, list[int]], None]  # (pdd event number, "stored" / "removed", pdd hashes)
REPLAY_TIMEOUT_MS = 2000


SALT_PREFIX = "pdd-salt:"  # how a request's cache_salt is given to vLLM, to tell it from pdd's own salts


def salt_of(extra_keys: list[tuple[object, ...] | None] | None) -> str | None:
    """The pdd cache_salt a block event's extra keys carry ("" for none); None where they
    carry anything else (a LoRA, an image, an uncached import's own salt): such blocks
    are hashed apart from every prompt the router hashes."""
    if not any(extra_keys or ()):
        return ""
    first, *rest = extra_keys or [None]
    if any(rest) or not first or len(first) != 1 or not isinstance(first[0], str):
        return None
    return first[0].removeprefix(SALT_PREFIX) if first[0].startswith(SALT_PREFIX) else None


class VllmHashes:
    """vLLM's cached blocks under pdd's names; numbers pdd's events as they are applied."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.names: dict[bytes | int, int] = {}  # vLLM block hash -> pdd chained hash
        self.held: Counter[int] = Counter()  # pdd hash -> vLLM blocks under it (a lookup per page, not per block)
        self.seq = 0
        self.unknown_parents = 0  # stored blocks whose parent was never seen: left out (the mirror under-counts)
        self.lock = threading.Lock()

    def stored(
        self,
        parent: bytes | int | None,
        hashes: list[bytes | int],
        token_ids: list[int],
        block_size: int,
        extra_keys: list[tuple[object, ...] | None] | None = None,
    ) -> list[int]:
        if block_size != self.page_size:
            raise ValueError(f"vLLM cached blocks of {block_size} tokens; this instance's page is {self.page_size}")
        salt = salt_of(extra_keys)
        if salt is None:
            return []
        if parent is None:
            prev = namespace_root(salt)  # (vLLM puts a request's salt in its first block's keys)
        elif parent in self.names:
            prev = self.names[parent]
        else:
            self.unknown_parents += 1
            return []
        out = []
        for i, h in enumerate(hashes):
            prev = chain_hash(prev, token_ids[i * block_size : (i + 1) * block_size])
            if h in self.names:
                self._drop(self.names[h])
            self.names[h] = prev
            self.held[prev] += 1
            out.append(prev)
        return out

    def removed(self, hashes: list[bytes | int]) -> list[int]:
        out = [self.names.pop(h) for h in hashes if h in self.names]
        for name in out:
            self._drop(name)
        return out

    def cleared(self) -> list[int]:
        out = list(self.names.values())
        self.names.clear()
        self.held.clear()
        return out

    def _drop(self, name: int) -> None:
        self.held[name] -= 1
        if self.held[name] <= 0:
            del self.held[name]

    def snapshot(self) -> tuple[int, list[int]]:
        with self.lock:
            return self.seq, list(self.names.values())

    def cached_prefix(self, page_hashes: list[int]) -> int:
        """How many leading pages of a prompt (their pdd hashes) are cached now."""
        n = 0
        with self.lock:
            for h in page_hashes:
                if h not in self.held:
                    break
                n += 1
        return n


class EventSubscriber:
    """Reads vLLM's KV event stream on a daemon thread into `VllmHashes`, replaying gaps."""

    def __init__(self, endpoint: str, replay_endpoint: str, hashes: VllmHashes) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.hashes = hashes
        self.listener: Listener | None = None
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        if endpoint.startswith("tcp://"):  # a MoE rank's publisher connects here (`args.lockstep_rank_events`)
            self._sub.bind(endpoint)
        else:
            self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)  # typed: nothing but these event structs
        self._next = 0  # vLLM's next batch number
        self._running = True
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        zmq = self._zmq
        while self._running:
            if not self._sub.poll(200):
                continue
            try:
                _, seq_bytes, payload = self._sub.recv_multipart()
            except zmq.ZMQError:
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self._next:
                self._replay(self._next)
            if seq >= self._next:
                self._apply(seq, payload)

    def _replay(self, start: int) -> None:
        """Fetch batches [start, ...) that the PUB socket dropped."""
        zmq = self._zmq
        req = self._ctx.socket(zmq.REQ)
        req.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
        req.setsockopt(zmq.LINGER, 0)
        try:
            req.connect(self._replay_endpoint)
            req.send(start.to_bytes(8, "big"))
            while True:
                _, seq_bytes, payload = req.recv_multipart()
                if not payload:  # the end marker
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq >= self._next:
                    self._apply(seq, payload)
        except zmq.ZMQError as e:
            log.warning("vLLM KV event replay from %d failed (%s): the router's mirror may drift", start, e)
        finally:
            req.close()

    def _apply(self, seq: int, payload: bytes) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        self._next = seq + 1
        batch = self._decoder.decode(payload)
        for event in batch.events:
            with self.hashes.lock:
                if isinstance(event, BlockStored):
                    names, what = (
                        self.hashes.stored(
                            event.parent_block_hash,
                            list(event.block_hashes),
                            list(event.token_ids),
                            event.block_size,
                            event.extra_keys,
                        ),
                        "stored",
                    )
                elif isinstance(event, BlockRemoved):
                    names, what = self.hashes.removed(list(event.block_hashes)), "removed"
                else:  # AllBlocksCleared
                    names, what = self.hashes.cleared(), "removed"
                if not names:
                    continue
                self.hashes.seq += 1
                seq_now = self.hashes.seq
            if self.listener is not None:
                self.listener(seq_now, what, names)

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=2)
        self._sub.close(linger=0)
        self._ctx.term()
