"""KV blobs as they travel (`pdd.kv.codec`): a frame of some tokens of an exported blob is
sent from the blob's own memory, and read as tensors in place of the buffer it arrived in."""

import ctypes

import pytest
import torch

from pdd.kv import codec
from pdd.kv.blocks import HASH_BLOCK, block_hashes
from pdd.transfer import messages as m
from pdd.transfer.wire import Frame, MsgType

LAYERS, TOKENS, HEADS, DIM = 6, 128, 2, 8


def _blob(tokens: int = TOKENS) -> codec.KVBlob:
    """An exported blob's shape: [layers, tokens, heads, dim], each layer's tokens together."""
    k, v = (torch.randn(LAYERS, tokens, HEADS, DIM).to(torch.bfloat16) for _ in range(2))
    header = codec.KVHeader(
        num_layers=LAYERS,
        layer_start=0,
        layer_end=LAYERS,
        kv_heads=HEADS,
        head_dim=DIM,
        dtype="bfloat16",
        page_size=16,
        token_start=0,
        token_end=tokens,
        block_size=HASH_BLOCK,
        block_hashes=block_hashes(list(range(tokens)), HASH_BLOCK),
    )
    return codec.KVBlob(header, k, v)


def _span(x: memoryview | torch.Tensor) -> tuple[int, int]:
    """The addresses of a buffer's (or a contiguous tensor's) first byte and past its last."""
    if isinstance(x, torch.Tensor):
        return x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()
    return ctypes.addressof(ctypes.c_char.from_buffer(x)), ctypes.addressof(ctypes.c_char.from_buffer(x)) + x.nbytes


def _within(inner: memoryview | torch.Tensor, outer: memoryview | torch.Tensor) -> bool:
    (a, b), (lo, hi) = _span(inner), _span(outer)
    return lo <= a and b <= hi


def test_some_tokens_of_an_exported_blob_are_sent_from_its_own_memory() -> None:
    """A chunk's tokens are apart in each layer of an exported blob: the frame's parts are
    views of each layer's run (a `.contiguous()` copy of the chunk was a pass over every
    byte P sends); joined, they are the chunk's bytes."""
    blob = _blob()
    chunk = codec.layer_groups(codec.token_slice(blob, 32, 96), 1 << 20)[0]
    parts = [memoryview(p).cast("B") for p in codec.encode_parts(chunk)]
    header, body = parts[0], parts[1:]
    assert len(body) == 2 * LAYERS
    assert all(_within(p, blob.k) for p in body[:LAYERS]) and all(_within(p, blob.v) for p in body[LAYERS:])
    back = codec.decode(bytearray(b"".join(parts)))
    assert torch.equal(back.k, blob.k[:, 32:96]) and torch.equal(back.v, blob.v[:, 32:96])
    assert len(header) % codec.ALIGN == 0


@pytest.mark.parametrize("rid_len", range(1, 18))
def test_a_kv_frames_tensors_are_read_in_place_whatever_its_headers_lengths(rid_len: int) -> None:
    """Both headers before the tensors (the frame's, naming the request; the blob's, whose
    hashes grow with its tokens) are padded to `ALIGN` bytes: the tensors start aligned in
    the buffer the frame was read into, so they are read there. Unpadded, a header of odd
    length left bfloat16 tensors misaligned, and the receiver copied them (62% of the
    frames of a 1024-token prompt)."""
    blob = _blob(16 * rid_len)
    parts = m.kv_payload("r" * rid_len, codec.encode_parts(blob))
    payload = memoryview(bytearray(b"".join(memoryview(p).cast("B") for p in parts)))  # (as a frame is read)
    layer, data = m.decode_kv(Frame(MsgType.KV_LAYER, 1, payload))
    got = codec.decode(data)
    assert layer.rid == "r" * rid_len
    assert _within(got.k, payload) and _within(got.v, payload) and got.k.data_ptr() % codec.ALIGN == 0
    assert torch.equal(got.k, blob.k) and torch.equal(got.v, blob.v)
