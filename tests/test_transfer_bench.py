"""`pdd bench transfer --loopback`'s whole KV path, and the codec's copies on it.

The codec writes the bytes it always wrote, as parts (the tensors' own memory behind the
header: a frame takes them without joining them), and reads a writable, aligned payload in place: a received frame's
buffer becomes the blob's K and V. An immutable or misaligned payload is copied, and
reads back the same. The bench carries KV of the tiny model and of realistic pages (bf16),
each row naming its shape, dtype and bytes a token.
"""

from __future__ import annotations

import argparse
import json
import struct

import pytest
import torch

from pdd.kv import codec, continuation
from pdd.kv.blocks import block_hashes


def _blob(dtype: str, tokens: int = 48, latent: bool = False) -> codec.KVBlob:
    heads = 1 if latent else 2
    h = codec.KVHeader(num_layers=3, layer_start=0, layer_end=3, kv_heads=heads, head_dim=64, dtype=dtype,
                       page_size=16, token_start=0, token_end=tokens, block_size=16,
                       block_hashes=block_hashes(list(range(tokens)), 16), latent=latent)
    gen = torch.Generator().manual_seed(tokens)
    k = torch.randn(3, tokens, heads, 64, generator=gen).to(codec.DTYPES[dtype])
    v = k[..., :0] if latent else torch.randn(3, tokens, heads, 64, generator=gen).to(codec.DTYPES[dtype])
    return codec.KVBlob(h, k, v)


def _inside(t: torch.Tensor, buf: bytearray) -> bool:
    base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    return base <= t.data_ptr() < base + len(buf)


@pytest.mark.parametrize("dtype", sorted(codec.DTYPES))
@pytest.mark.parametrize("latent", [False, True])
def test_the_codec_writes_the_same_bytes_and_reads_a_frame_buffer_in_place(dtype, latent):
    blob = _blob(dtype, latent=latent)
    # non-contiguous K (as a layer or token slice may be) encodes as its row-major bytes
    strided = codec.KVBlob(blob.header, blob.k.transpose(1, 2).contiguous().transpose(1, 2), blob.v)
    for b in (blob, strided):
        data = codec.encode(b)
        (hlen,) = struct.unpack_from("!I", data, 6)
        payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in (b.k, b.v)[: b.header.sides])
        assert isinstance(data, bytes) and data[10 + hlen :] == payload and len(data) == 10 + hlen + len(payload)
        assert json.loads(data[10 : 10 + hlen])["dtype"] == dtype
        itemsize = codec.DTYPES[dtype].itemsize
        for shift in range(4):  # the payload at every offset in a received frame's buffer
            buf = bytearray(shift) + bytearray(data)
            got = codec.decode(memoryview(buf)[shift:])
            assert torch.equal(got.k, blob.k) and torch.equal(got.v, blob.v)
            aligned = (torch.frombuffer(buf, dtype=torch.uint8).data_ptr() + shift + 10 + hlen) % itemsize == 0
            assert _inside(got.k, buf) == aligned  # read in place where aligned, copied where not
        got = codec.decode(data)  # immutable bytes: copied, and writable
        assert torch.equal(got.k, blob.k) and torch.equal(got.v, blob.v)
        got.k.add_(1)
        assert codec.decode(data).k.equal(blob.k)


def test_int8_and_zstd_payloads_read_the_same_from_any_buffer():
    blob = _blob("float32")
    for lossy, compress in (("int8", ""), ("", "zstd"), ("int8", "zstd")):
        data = codec.encode(blob, lossy, compress)
        want = codec.decode(data)
        for shift in range(4):
            got = codec.decode(memoryview(bytearray(shift) + bytearray(data))[shift:])
            assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v) and got.header == want.header


@pytest.mark.parametrize("latent", [False, True])
def test_a_chunks_layers_travel_in_frames_of_up_to_a_size(latent):
    """An exported blob goes chunk by chunk, each chunk's layers in frames of up to
    `KV_FRAME_BYTES` (`export_frames`, `codec.layer_groups`); a streamed chunk's layers that
    are there together go as one frame from their own memory (`encode_layers`). Either reads
    back as the blob it came from."""
    from pdd.instance import prefill_kv

    blob = _blob("bfloat16", tokens=48, latent=latent)
    layer_bytes = codec.token_slice(blob, 0, 16).header.payload_bytes // 3
    caps = ((2 * layer_bytes, [(0, 2), (2, 3)]), (100 * layer_bytes, [(0, 3)]), (1, [(0, 1), (1, 2), (2, 3)]))
    for cap, layers in caps:
        frames = codec.layer_groups(codec.token_slice(blob, 16, 32), cap)
        assert [(f.header.layer_start, f.header.layer_end) for f in frames] == layers
        for f in frames:
            got = codec.decode(bytearray(codec.encode(f)))
            i, j = f.header.layer_start, f.header.layer_end
            assert torch.equal(got.k, blob.k[i:j, 16:32]) and torch.equal(got.v, blob.v[i:j, 16:32])
    whole = prefill_kv.export_frames(blob, 16)
    assert [(f.header.token_start, f.header.layer_end) for f in whole] == [(0, 3), (16, 3), (32, 3)]
    pieces = codec.split_layers(codec.token_slice(blob, 32, 48))
    parts = codec.encode_layers(pieces)
    assert b"".join(parts) == codec.encode(codec.join_layers(pieces)) == codec.encode(whole[2])
    assert codec.decode(bytearray(b"".join(parts))).header == codec.joined_header(pieces)
    with pytest.raises(codec.KVFormatError, match="different tokens"):
        codec.joined_header([pieces[0], codec.split_layers(whole[0])[1]])


def test_a_prompts_hashes_are_computed_once_across_its_chunks(monkeypatch):
    """An import's check compares the chunk's block hashes with the prompt's, kept across
    the request's chunks (`PrefixHashes`): each block hashed once, not once a chunk."""
    from pdd.kv import blocks

    tokens = list(range(1000, 1256))
    hashes = blocks.PrefixHashes(tokens)
    calls = []
    chain = blocks.chain_hash
    monkeypatch.setattr(blocks, "chain_hash", lambda parent, t: calls.append(1) or chain(parent, t))
    for end in range(16, 257, 16):
        assert hashes.upto(end) == block_hashes(tokens[:end], 16)
    assert len(calls) == 256 // 16 + sum(range(1, 17))  # its own: once each; block_hashes': every time
    h = codec.token_slice(_blob("bfloat16", tokens=48), 0, 32).header
    assert continuation.check_continuation(h, (3, 2, 64), blocks.PrefixHashes(list(range(48))), 0, 48) is None
    assert "another prompt" in continuation.check_continuation(h, (3, 2, 64), blocks.PrefixHashes([7] * 48), 0, 48)


def test_the_loopback_bench_carries_kv_of_the_tiny_model_and_of_realistic_pages(tmp_path, monkeypatch):
    """Every row once, small: the realistic model's KV geometry shrunk (the bench's own is
    Qwen2.5-0.5B's, 24 layers) so the test builds it in seconds; bf16 pools on both ends."""
    from pdd.lab.netns import transfer, transfer_loopback

    monkeypatch.setitem(transfer_loopback.REALISTIC, "layers", 2)
    monkeypatch.setitem(transfer_loopback.REALISTIC, "hidden", 256)
    monkeypatch.setitem(transfer_loopback.REALISTIC, "heads", 4)
    monkeypatch.setitem(transfer_loopback.REALISTIC, "intermediate", 64)
    p = argparse.ArgumentParser()
    transfer.add_arguments(p)
    out = tmp_path / "loopback.json"
    args = p.parse_args(["--loopback", "--mbytes", "2", "--frame-kib", "256", "--prompt-tokens", "64",
                         "--repeats", "1", "--out", str(out)])
    assert args.model_shape == "both"
    assert transfer.run(args) == 0
    report = json.loads(out.read_text())
    assert set(report["loopback_mb_s"]) == {"raw", "auth", "plain", "kv", "kv_realistic"}
    assert all(rate > 0 for rate in report["loopback_mb_s"].values())
    # each end's CPU a GB, every row: the sender's work a byte is more than raw TCP's for the KV
    cpu = report["cpu_s_per_gb"]
    assert all(0 < x < 100 for row in cpu.values() for end in row.values() for x in end), cpu
    assert cpu["kv_realistic"]["sender"][0] > cpu["raw"]["sender"][0]
    assert report["core_gb_per_s"]["raw"] == pytest.approx(1 / max(cpu["raw"]["sender"][0], cpu["raw"]["receiver"][0]))
    assert report["kv_bytes_per_token"] == {"kv": 4096, "kv_realistic": 2 * 2 * 2 * 64 * 2}
    assert "float32" in report["labels"]["kv"] and "4,096 B a token" in report["labels"]["kv"]
    assert "bfloat16" in report["labels"]["kv_realistic"] and "1,024 B a token" in report["labels"]["kv_realistic"]
    assert "2 layers x 2 KV heads x 64" in report["labels"]["kv_realistic"]
