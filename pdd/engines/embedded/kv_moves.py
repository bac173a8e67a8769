"""The embedded engine's KV in and out (a part of `Engine`): an import or export is
checked and claimed on the engine thread, and copied by `pdd.engines.embedded.copies`, beside the
steps where a runtime runs a copy thread, here and now otherwise."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from pdd.batching import Scheduler, Status
from pdd.engines.embedded.copies import Copies, Copy, export_copy, import_copy
from pdd.engines.embedded.kv_pool import KVPool
from pdd.engines.embedded.sequence import Sequence
from pdd.engines.port import RequestError
from pdd.kv import codec, continuation
from pdd.kv.blocks import HASH_BLOCK, PrefixHashes, block_hashes
from pdd.kv.copy_stream import CopyStream

if TYPE_CHECKING:
    from pdd.model.config import ModelConfig


class KVMoves:
    """What `Engine` holds that these use."""

    pool: KVPool
    model_cfg: ModelConfig
    seqs: dict[str, Sequence]
    scheduler: Scheduler
    copies: Copies | None
    copy_stream: CopyStream

    def import_kv(self, rid: str, blob: codec.KVBlob) -> None:
        """Write imported KV for tokens [token_start, token_end), all layers, of a reserved
        sequence, here and now (the runtime copies beside its steps instead: `claim_import`)."""
        copy = self.claim_import(rid, blob)
        copy.run_here()
        self.copied(copy)

    def claim_import(self, rid: str, blob: codec.KVBlob) -> Copy:
        """Check an import and claim its tokens; the `Copy` writes them. Ranges must follow
        each other: token_start is what is computed (or claimed) so far, so imported KV
        never overwrites cached (shared) pages nor leaves a hole."""
        seq = self.seqs.get(rid)
        if seq is None or seq.status != Status.RESERVED:
            raise RequestError(f"request {rid!r} is not reserved for import")
        self._check_blob(seq, blob.header)
        copy = import_copy(self.pool, seq, blob, self.copy_stream)
        if not seq.copies:
            seq.copied_end = seq.num_computed
        seq.copies += 1
        seq.num_computed = blob.header.token_end
        return copy

    def copied(self, copy: Copy) -> None:
        """A claimed copy ended (done, failed or cancelled): a start that waited for it runs now."""
        seq = copy.seq
        seq.copies -= 1
        if not seq.copies and seq.start_deferred and not seq.copy_cancelled:
            seq.start_deferred = False
            self.scheduler.add(seq)

    def _check_blob(self, seq: Sequence, h: codec.KVHeader) -> None:
        cfg = self.model_cfg
        if seq.prompt_hashes is None:
            seq.prompt_hashes = PrefixHashes(seq.tokens[: seq.prompt_len])
        shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        why = continuation.check_continuation(h, shape, seq.prompt_hashes, seq.num_computed, seq.prompt_len)
        if why:
            raise RequestError(why)

    def layer_taps(self, batch: list[tuple[Sequence, int]]) -> Callable[[int, torch.Tensor, torch.Tensor], None] | None:
        """What a step's forward calls after each layer (`PagedAttention.on_layer`): the
        layer's KV of the prompt tokens it computes for each streaming sequence, put on
        that sequence's `LayerStream` (copied to the host: off the device without waiting
        on CUDA, `CopyStream.to_host`); None when no sequence of the batch streams."""
        taps = []
        offset = 0
        for seq, n in batch:
            if seq.stream is not None and seq.num_computed < seq.prompt_len:
                seq.stream.begin(seq.num_computed)
                end = min(seq.num_computed + n, seq.prompt_len)
                taps.append((offset, seq.stream, self._kv_header(seq, range(0, 1), seq.num_computed, end)))
            offset += n
        if not taps:
            return None

        def on_layer(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            for start, stream, header in taps:
                rows = slice(start, start + header.num_tokens)
                (kk, vv), ready = self.copy_stream.to_host([k[rows].to(self.pool.dtype), v[rows].to(self.pool.dtype)])
                blob = codec.KVBlob(replace(header, layer_start=layer, layer_end=layer + 1), kk[None], vv[None])
                stream.put(blob, ready)

        return on_layer

    def _kv_header(self, seq: Sequence, layers: range, token_start: int, token_end: int) -> codec.KVHeader:
        """The header of this engine's KV of `seq`'s tokens [token_start, token_end)."""
        return codec.KVHeader(
            num_layers=self.model_cfg.num_layers,
            layer_start=layers.start,
            layer_end=layers.stop,
            kv_heads=self.model_cfg.num_kv_heads,
            head_dim=self.model_cfg.head_dim,
            dtype=codec.dtype_name(self.pool.dtype),
            page_size=self.pool.page_size,
            token_start=token_start,
            token_end=token_end,
            block_size=HASH_BLOCK,
            block_hashes=block_hashes(seq.tokens[:token_end], HASH_BLOCK),
        )

    def export_kv(self, rid: str, token_start: int, token_end: int, layers: range | None = None) -> codec.KVBlob:
        """KV of tokens [token_start, token_end) of a sequence, here and now (the runtime
        copies beside its steps instead: `claim_export`)."""
        copy = self.claim_export(rid, token_start, token_end, layers)
        blob = copy.run_here()
        self.copied(copy)
        return blob

    def claim_export(self, rid: str, token_start: int, token_end: int, layers: range | None = None) -> Copy:
        """Check an export; the `Copy` gathers the KV into its result, a blob (on the CPU)."""
        seq = self.seqs.get(rid)
        if seq is None:
            raise RequestError(f"request {rid!r} is not active")
        if not 0 <= token_start < token_end <= seq.num_computed:
            raise RequestError(f"cannot export [{token_start}, {token_end}): {seq.num_computed} tokens computed")
        header = self._kv_header(seq, layers or range(self.model_cfg.num_layers), token_start, token_end)
        seq.copies += 1
        return export_copy(self.pool, seq, header, self.copy_stream)
