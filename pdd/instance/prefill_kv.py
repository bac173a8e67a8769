"""A prefill's KV to each decode-side peer (the prefill role's senders).

A peer's sender starts as soon as P asks it to reserve, before prefill: once the
reservation answers, it sends the KV after the peer's hit as the engine computes it,
a chunk's layers in frames of up to `KV_FRAME_BYTES` (`pdd.kv.layer_stream`), so the line and the relay's
path are busy while later layers run; what the stream does not carry (the prefix P's
own cache served, or all of it on an engine that streams nothing) it exports from P's
held pages. The pipeline is chosen only after prefill (`pdd.instance.prefill`): the
sender of a peer left out is cancelled, and each chosen one is finished with KV_DONE,
which follows its last layer. MD's copy behind a relay sends nothing until the choice:
it is background work if the relay takes the request and urgent if not, and a frame
sent as background before the choice would wait behind every other request's urgent
KV, holding back the urgent frames behind it (the receiver imports in token order).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pdd.engines.port import EnginePort
from pdd.instance.peers import PeerPool
from pdd.instance.role import PeerBusy
from pdd.kv import codec
from pdd.kv.layer_stream import LayerStream
from pdd.policy.transfer import LineMeter, Priority, kv_chunks, kv_range
from pdd.sampling.params import Logprob
from pdd.transfer import messages as m

log = logging.getLogger(__name__)
# KV a frame carries at most: consecutive layers of a chunk travel together up to it (a frame
# costs each end a fixed time besides its bytes; `pdd bench transfer --loopback`)
KV_FRAME_BYTES = 1 << 20
ACK_TIMEOUT_S = 60.0  # a peer that acknowledges none of a request's KV for this long has failed it
# A streamed sender keeps at most what the line carries in this long (and a round trip) ahead of
# what its peer acknowledged: enough that the acknowledgements (after each chunk's import) never
# idle the line, little enough that whole chunks go first on a slow one
AHEAD_S = 0.5


@dataclass(eq=False)
class PrefillJob:
    """One request on P, from SUBMIT until its KV is handed over (or it fails)."""

    submit: m.Submit
    router_id: str
    acks: dict[str, asyncio.Future[m.ReserveAck]] = field(default_factory=dict)  # peer -> its ReserveAck
    loaded: dict[str, asyncio.Future[m.KVAck]] = field(default_factory=dict)  # peer -> its KVAck(done)
    reserve_sent: dict[str, float] = field(default_factory=dict)  # peer -> when RESERVE went
    holders: set[str] = field(default_factory=set)  # peers holding state P must drop if it stops
    stream: LayerStream | None = None  # the prompt's KV as the forward computes it
    senders: dict[str, asyncio.Task[int]] = field(default_factory=dict)  # peer -> its KV frames, bytes sent
    priority: dict[str, Priority] = field(default_factory=dict)  # peer -> what its frames go as, once known
    chosen: dict[str, asyncio.Event] = field(default_factory=dict)  # peer -> set once its priority is
    acked: dict[str, int] = field(default_factory=dict)  # peer -> the token its acknowledged KV reaches
    wakes: dict[str, asyncio.Event] = field(default_factory=dict)  # peer -> its streaming sender's (`acked` moved)
    exports: int = 0  # holders of P's pages (the prefill, senders still to export): released at none
    background: bool = False  # only MD's copy behind a relay is left: not foreground work any more
    task: asyncio.Task[None] | None = None
    submitted: float = field(default_factory=time.monotonic)
    last_ack: float = field(default_factory=time.monotonic)  # the last KV acknowledged by any peer
    progress_sent: float = 0.0  # when the router was last told the KV moves
    # peer -> the forms its KV crosses in: lossy ("": exact) and compressed ("": as it is)
    forms: dict[str, tuple[str, str]] = field(default_factory=dict)
    first_logprob: Logprob | None = None  # P's token's, where the request asks for logprobs
    prompt_logprobs: list[Logprob | None] | None = None  # the prompt's, where asked: P's alone

    @property
    def rid(self) -> str:
        return self.submit.rid

    def futures(self, peer: str) -> list[asyncio.Future[Any]]:
        return [f for f in (self.acks.get(peer), self.loaded.get(peer)) if f is not None and not f.done()]


async def answer(job: PrefillJob, peer: str, timeout: float | None) -> m.ReserveAck | None:
    """The peer's reservation; None if it has not answered within `timeout` (None: as
    long as it takes; a decode instance holds a reservation back while its pool is full,
    and a lost one is dropped by liveness)."""
    try:
        ack = await asyncio.wait_for(asyncio.shield(job.acks[peer]), timeout)
    except TimeoutError:
        return None
    if ack.error:  # (a busy peer's refusal is for now: the client may come back, a 429)
        raise (PeerBusy if ack.busy else RuntimeError)(f"{peer} refused: {ack.error}")
    return ack


async def reservation(job: PrefillJob, peer: str) -> m.ReserveAck:
    """The peer's reservation, however long it takes (see `answer`)."""
    ack = await answer(job, peer, None)
    assert ack is not None  # without a timeout, `answer` waits for the reply
    return ack


class KVSenders:
    def __init__(
        self,
        engine: EnginePort,
        peers: PeerPool,
        chunk_tokens: int,
        line: Callable[[str], LineMeter],
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
    ) -> None:
        self.engine, self.peers, self.chunk_tokens, self.line, self.spawn = engine, peers, chunk_tokens, line, spawn
        self.in_prefill = 0  # KV frames sent while their prefill was still computing

    def start(self, job: PrefillJob, peer: str, priority: Priority | None) -> None:
        """Begin `peer`'s sender (its reservation is asked for): frames go as `priority`,
        or (None) wait for the one `finish` gives."""
        job.chosen[peer] = asyncio.Event()
        if priority is not None:
            job.priority[peer] = priority
            job.chosen[peer].set()
        job.exports += 1
        job.senders[peer] = self.spawn(self._frames(job, peer))

    def drop(self, job: PrefillJob, peer: str) -> None:
        """The pipeline leaves `peer` out: stop its frames (it is told to drop its reservation)."""
        sender = job.senders.pop(peer, None)
        if sender is not None:
            _stop(sender)

    @staticmethod
    def stop(job: PrefillJob) -> None:
        """The request is over: every sender still running stops; what one failed of, when
        nobody waited for it, is no error to log (the request's own error says it)."""
        for sender in job.senders.values():
            _stop(sender)

    async def finish(self, job: PrefillJob, peer: str, first: int, emit: bool, priority: Priority) -> int:
        """The rest of `peer`'s KV as `priority`, then KV_DONE; the payload bytes sent."""
        job.priority[peer] = priority
        job.chosen[peer].set()
        start, end = kv_range(len(job.submit.prompt), (await reservation(job, peer)).hit)
        line = self.line(peer)
        line.begin((job.rid, peer), start, end, self.engine.kv_bytes_per_token, priority)
        line.acked((job.rid, peer), job.acked.get(peer, start), False, time.monotonic())
        began = time.monotonic()
        sent = await job.senders[peer]
        done = m.KVDone(job.rid, first, emit, job.first_logprob, job.prompt_logprobs)  # (see `KVDone`)
        await self.peers.send_bulk(peer, priority, done)
        job.holders.discard(peer)  # the KV is complete there: the peer's job no longer needs P
        took_ms = 1000 * (time.monotonic() - began)
        log.debug("%s: KV [%d, %d) to %s done %.1f ms after prefill", job.rid, start, end, peer, took_ms)
        return sent

    async def _frames(self, job: PrefillJob, peer: str) -> int:
        """Tokens [hit, prompt) of the KV to `peer`: the part P's cache served, exported,
        then the stream's pieces as they come. RuntimeError if the prefill ended short."""
        assert job.stream is not None  # (set before any sender starts)
        sent = 0
        try:
            start, end = kv_range(len(job.submit.prompt), (await reservation(job, peer)).hit)
            first = await job.stream.started()
            streamed = end if first is None else max(start, first)
            if start < streamed:
                blob = await self.engine.export_kv(job.rid, start, streamed)
                sent += await self._send(job, peer, [[f] for f in export_frames(blob, self.chunk_tokens)])
        finally:
            self.exported(job)
        return sent + await self._streamed(job, peer, start, end, streamed)

    async def _streamed(self, job: PrefillJob, peer: str, start: int, end: int, reach: int) -> int:
        """The stream's pieces within [start, end), each sent once it is there, the lowest
        (first token, layer) first, and no further ahead of what the peer acknowledged than
        the line carries in a round trip and `AHEAD_S` (four chunks at least): a step's layers
        come one after the other over all its tokens, and on a line slower than the forward
        pass whole chunks must still go first (the receiver imports, and acknowledges, in
        token order; written in the order they came, a whole prompt's layer 0 went before
        any chunk was whole, and a slow line's first acknowledgement came seconds late)."""
        stream = job.stream
        assert stream is not None  # (set before any sender starts)
        pending: list[tuple[int, int, int, codec.KVBlob]] = []  # (first token, layer, arrival, one frame's KV)
        arrived, ended = job.wakes.setdefault(peer, asyncio.Event()), asyncio.Event()
        order = itertools.count()
        est = self.line(peer).estimate
        ahead_bytes = est.bytes_per_s * (AHEAD_S + 2 * est.one_way_s)
        ahead = max(4 * self.chunk_tokens, int(ahead_bytes / max(1, self.engine.kv_bytes_per_token)))

        async def take() -> int:
            top = reach
            try:
                async for piece in stream.follow():
                    h = piece.blob.header
                    a, b = max(h.token_start, start), min(h.token_end, end)
                    if a >= b:
                        continue
                    if piece.ready is not None:
                        await asyncio.to_thread(piece.ready)
                    for x, y in kv_chunks(a, b, self.chunk_tokens):
                        heapq.heappush(pending, (x, h.layer_start, next(order), codec.token_slice(piece.blob, x, y)))
                    arrived.set()
                    top = max(top, b) if h.layer_start == 0 else top
            finally:
                ended.set()
                arrived.set()
            return top

        taker = asyncio.ensure_future(take())
        sent = 0
        try:
            while pending or not ended.is_set():
                if pending and pending[0][0] - job.acked.get(peer, start) <= ahead:
                    sent += await self._send(job, peer, [_next_frame(pending)])
                else:
                    arrived.clear()
                    await arrived.wait()
            top = await taker
        finally:
            taker.cancel()
        if top < end:
            raise RuntimeError(f"prefill of {job.rid} ended with its KV computed to {top} of {end} tokens")
        return sent

    def exported(self, job: PrefillJob) -> None:
        """One holder of P's pages is done with them: at none, they go (a slow line need not hold them)."""
        job.exports -= 1
        if not job.exports:
            self.spawn(self.engine.release(job.rid))

    async def _send(self, job: PrefillJob, peer: str, frames: list[list[codec.KVBlob]]) -> int:
        """`frames`, in order, each consecutive layer slices of one chunk sent as one frame;
        the payload bytes sent."""
        sent, (lossy, compress) = 0, job.forms.get(peer, ("", ""))
        await job.chosen[peer].wait()
        for group in frames:
            data = codec.encode_layers(group, lossy, compress)
            sent += await self.peers.send_bulk(peer, job.priority[peer], kv=(job.rid, data))
            self.in_prefill += job.stream is not None and not job.stream.closed
        return sent


def _next_frame(pending: list[tuple[int, int, int, codec.KVBlob]]) -> list[codec.KVBlob]:
    """The lowest pending piece and the next layers of its tokens already there, up to a
    frame's worth (`KV_FRAME_BYTES`): nothing waits to fill a frame."""
    group = [heapq.heappop(pending)[3]]
    size = group[0].header.payload_bytes
    while pending:
        h, last = pending[0][3].header, group[-1].header
        if (h.token_start, h.token_end, h.layer_start) != (last.token_start, last.token_end, last.layer_end):
            break
        if size + h.payload_bytes > KV_FRAME_BYTES:
            break
        size += h.payload_bytes
        group.append(heapq.heappop(pending)[3])
    return group


def export_frames(blob: codec.KVBlob, chunk_tokens: int) -> list[codec.KVBlob]:
    """An exported blob as P sends it: chunk by chunk of `chunk_tokens`, each chunk's layers
    in frames of up to `KV_FRAME_BYTES` (`codec.layer_groups`)."""
    h = blob.header
    return [
        group
        for a, b in kv_chunks(h.token_start, h.token_end, chunk_tokens)
        for group in codec.layer_groups(codec.token_slice(blob, a, b), KV_FRAME_BYTES)
    ]


def _stop(sender: asyncio.Task[int]) -> None:
    """Stop a sender nobody will wait for: cancelled if it runs; what it failed of, if it
    ended so, taken (no error to log: the request's own outcome says it)."""
    if not sender.done():
        sender.cancel()
    elif not sender.cancelled():
        sender.exception()


async def loaded(job: PrefillJob, peer: str) -> None:
    """Wait for the peer to confirm it holds all the KV, however slow the line, as long as
    some of the request's KV is acknowledged every `ACK_TIMEOUT_S` from the moment the
    last of it was sent."""
    job.last_ack = time.monotonic()
    while True:
        left = job.last_ack + ACK_TIMEOUT_S - time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(job.loaded[peer]), max(left, 0.0))
            return
        except TimeoutError:
            if time.monotonic() - job.last_ack >= ACK_TIMEOUT_S:
                raise TimeoutError(f"{peer} acknowledged no KV of {job.rid} for {ACK_TIMEOUT_S:g} s") from None
