"""A self-describing binary format for a slice of one sequence's KV.

A blob carries a token range and a layer range of K and V in token-major layout, so
the importer can lay it into pages of any size, and its own dtype. The JSON header
says what the bytes are; the chained block hashes of the covered prefix let the
importer refuse KV that belongs to a different prompt. No pickle: a header is parsed
as JSON and every size is checked against the bytes actually present.

Two kinds of cache need more than that, and say so in fields plain blobs leave out:
* `latent`: an MLA cache (DeepSeek V2/V3, Kimi K2) keeps one latent vector per token
  and no heads, no K/V split: the blob carries it as K with one head, and V is empty;
* an fp8 dtype (`RAW_DTYPES`): the bytes as the exporter's cache held them, meaningful
  only with the per-layer scales they were quantized with (`scales`, K then V of each
  layer). pdd moves them unchanged into a cache of the same dtype and scales and
  converts them into nothing else: it could not do it exactly.
"""

from __future__ import annotations

import copy
import json
import math
import struct
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from pdd.names import KV_COMPRESSIONS, LOSSY_KV_FORMS

MAGIC = b"PDKV"
VERSION = 1
_PREFIX = struct.Struct("!4sHI")  # magic, version, header length
MAX_HEADER = 1 << 20
ALIGN = 16  # a blob's tensors start this many bytes into it, a multiple (`_header_bytes`)
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# carried as bytes, never converted: vLLM's fp8 caches ("fp8"/"fp8_e4m3" is e4m3fn on CUDA, e4m3fnuz on ROCm)
RAW_DTYPES: dict[str, torch.dtype] = {
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "float8_e4m3fnuz": torch.float8_e4m3fnuz,
}
ALL_DTYPES = {**DTYPES, **RAW_DTYPES}
# Lossy forms for the line only (`[line] lossy_kv`): int8 with one fp32 scale per token,
# head and side (absmax / 127), dequantized to float32 on arrival. Never a cache's dtype.
LOSSY_FORMS = LOSSY_KV_FORMS
_SCALE = torch.float32
# Lossless compression for the line only (`[line] compress_kv`): the payload through zstd
# level 1, which paid +29 % on a 1 Gbit/s line for bf16 KV (BENCHMARKS.md, "KV over a long line")
COMPRESSIONS = KV_COMPRESSIONS
_ZSTD_LEVEL = 1
_EXTRAS = {"latent": False, "scales": [], "compressed": ""}  # header fields a plain blob leaves out


class KVFormatError(ValueError):
    pass


@dataclass(frozen=True)
class KVHeader:
    num_layers: int  # of the model
    layer_start: int
    layer_end: int
    kv_heads: int
    head_dim: int
    dtype: str
    page_size: int  # of the exporter; informational
    token_start: int
    token_end: int
    block_size: int
    block_hashes: list[int]  # chained hashes of the full blocks of tokens [0, token_end)
    latent: bool = False  # one latent vector a token (MLA) in K, one head, V empty
    scales: list[float] = field(default_factory=list)  # fp8: K and V scale of each layer in the range
    compressed: str = ""  # the payload as it travels: "" as it is, or "zstd" (of `payload_bytes` bytes)

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def sides(self) -> int:
        """K and V, or the latent alone."""
        return 1 if self.latent else 2

    @property
    def payload_bytes(self) -> int:
        if self.dtype in LOSSY_FORMS:  # the int8 values, then a scale a head and token
            per = self.num_tokens * self.kv_heads * (self.head_dim + _SCALE.itemsize)
        else:
            per = self.num_tokens * self.kv_heads * self.head_dim * ALL_DTYPES[self.dtype].itemsize
        return self.sides * (self.layer_end - self.layer_start) * per


@dataclass
class KVBlob:
    header: KVHeader
    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim]
    v: torch.Tensor  # the same, or [layers, tokens, kv_heads, 0] for a latent blob


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in ALL_DTYPES.items():
        if d == dtype:
            return name
    raise KVFormatError(f"unsupported KV dtype {dtype}")


def encode(blob: KVBlob, lossy: str = "", compress: str = "") -> bytes:
    """The blob's bytes (`encode_parts`, joined)."""
    return b"".join(encode_parts(blob, lossy, compress))


def encode_parts(blob: KVBlob, lossy: str = "", compress: str = "") -> list[bytes | bytearray | memoryview]:
    """The blob's bytes as parts: its prefix and header, then its tensors' own memory (a
    frame takes them as they are: the KV is not copied to be sent). With `lossy` ("int8"),
    quantized for the line (a blob of an fp8 cache travels as it is: it is quantized
    already); with `compress` ("zstd"), its payload compressed, losslessly."""
    tensors = list((blob.k, blob.v)[: blob.header.sides])
    header_fields = dict(vars(blob.header))  # (shallow: `asdict` deep-copies the hashes, per frame)
    if lossy and blob.header.dtype in DTYPES:
        if lossy not in LOSSY_FORMS:
            raise KVFormatError(f"unknown lossy KV form {lossy!r} (known: {', '.join(LOSSY_FORMS)})")
        quantized = [_to_int8(t) for t in tensors]
        tensors = [q for q, _ in quantized] + [scale for _, scale in quantized]
        header_fields["dtype"] = lossy
    body: list[bytes | bytearray | memoryview] = [part for t in tensors for part in _parts_of(t)]
    if compress:
        if compress not in COMPRESSIONS:
            raise KVFormatError(f"unknown KV compression {compress!r} (known: {', '.join(COMPRESSIONS)})")
        import zstandard

        body = [zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(b"".join(body))]
        header_fields["compressed"] = compress
    return [_header_bytes(header_fields), *body]


def _header_bytes(header_fields: dict[str, Any]) -> bytes:
    """A blob's prefix and JSON header (the fields at their default left out), padded with
    spaces to a multiple of `ALIGN` bytes: the tensors that follow start as aligned in the
    receiver's buffer as the blob does, so it reads them in place (`_tensor_of`)."""
    fields = {k: v for k, v in header_fields.items() if _EXTRAS.get(k, ...) != v}
    header = json.dumps(fields, separators=(",", ":")).encode()
    header += b" " * (-(_PREFIX.size + len(header)) % ALIGN)
    return _PREFIX.pack(MAGIC, VERSION, len(header)) + header


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in row-major order, as a view of its memory where it is contiguous
    (copied once where it is not)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data


def _parts_of(t: torch.Tensor) -> list[memoryview]:
    """A tensor's bytes in row-major order, as views of its memory: one where it is
    contiguous, one a layer where each layer is (some tokens of an exported blob: its
    layers are apart in memory, each layer's tokens together), copied once otherwise."""
    if t.is_contiguous() or t.dim() < 2 or t.stride(-1) != 1 or not t[0].is_contiguous():
        return [_bytes_of(t)]
    rows = t.view(torch.uint8).flatten(1).numpy()  # (a layer a row, each row's bytes together)
    return [row.data for row in rows]


def _to_int8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dimension (a head's vector), with its fp32 scale."""
    x = t.to(torch.float32)
    scale = x.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return torch.round(x / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8), scale


def _check_header(raw: dict) -> KVHeader:
    try:
        h = KVHeader(**raw)
    except TypeError as e:
        raise KVFormatError(f"bad KV header fields: {e}") from None
    ints = (
        h.num_layers,
        h.layer_start,
        h.layer_end,
        h.kv_heads,
        h.head_dim,
        h.page_size,
        h.token_start,
        h.token_end,
        h.block_size,
    )
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in ints):
        raise KVFormatError("KV header sizes must be integers")
    if not isinstance(h.dtype, str) or h.dtype not in (*ALL_DTYPES, *LOSSY_FORMS):  # (a list is not even hashable)
        raise KVFormatError(f"unknown KV dtype {h.dtype!r}")
    if type(h.latent) is not bool:
        raise KVFormatError("KV header latent must be true or false")
    if h.compressed not in ("", *COMPRESSIONS):
        raise KVFormatError(f"unknown KV compression {h.compressed!r}")
    want = 2 * (h.layer_end - h.layer_start) if h.dtype in RAW_DTYPES else 0
    if (
        not isinstance(h.scales, list)
        or len(h.scales) != want
        or not all(type(x) in (int, float) and 0 < x < float("inf") for x in h.scales)
    ):
        raise KVFormatError(f"KV header needs {want} positive scales for {h.dtype} over its layers")
    if not (0 <= h.layer_start < h.layer_end <= h.num_layers and 0 <= h.token_start < h.token_end):
        raise KVFormatError("KV header ranges are empty or out of order")
    if min(h.kv_heads, h.head_dim, h.page_size, h.block_size) < 1:
        raise KVFormatError("KV header dimensions must be positive")
    if (
        not isinstance(h.block_hashes, list)
        or len(h.block_hashes) != h.token_end // h.block_size
        or not all(type(x) is int for x in h.block_hashes)
    ):
        raise KVFormatError("KV header block hashes do not cover the token range")
    return h


def decode(data: bytes | bytearray | memoryview) -> KVBlob:
    """The blob `data` holds, checked. Its K and V are views of `data` where that is a
    writable buffer (a received frame's payload) whose payload is aligned for its dtype:
    the caller hands the buffer over and writes no more into it."""
    data = memoryview(data)
    if len(data) < _PREFIX.size:
        raise KVFormatError("KV blob shorter than its prefix")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise KVFormatError("not a KV blob (bad magic)")
    if version != VERSION:
        raise KVFormatError(f"KV blob version {version}, this build reads {VERSION}")
    if hlen > MAX_HEADER or _PREFIX.size + hlen > len(data):
        raise KVFormatError("KV header length out of bounds")
    try:
        raw = json.loads(bytes(data[_PREFIX.size : _PREFIX.size + hlen]))
    except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." nested past the stack
        raise KVFormatError(f"KV header is not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise KVFormatError("KV header is not an object")
    h = _check_header(raw)
    body = data[_PREFIX.size + hlen :]
    if h.compressed:
        body = memoryview(_decompressed(body, h.payload_bytes))
        h = replace(h, compressed="")
    if len(body) != h.payload_bytes:
        raise KVFormatError(f"KV payload is {len(body)} bytes, header says {h.payload_bytes}")
    shape = (h.layer_end - h.layer_start, h.num_tokens, h.kv_heads, h.head_dim)
    if h.dtype in LOSSY_FORMS:
        return _dequantized(h, body, shape)
    flat = _tensor_of(body, ALL_DTYPES[h.dtype])
    if h.latent:
        return KVBlob(h, flat.view(shape), flat[:0].view(*shape[:3], 0))
    half = flat.numel() // 2
    return KVBlob(h, flat[:half].view(shape), flat[half:].view(shape))


def _tensor_of(body: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """The payload as a flat tensor of `dtype`: a view of the caller's buffer where that is
    writable (a frame's payload, read into a buffer of its own: the blob takes it over) and
    aligned for `dtype` (torch reads a misaligned tensor wrongly or not at all), a copy
    otherwise (an immutable `bytes`, or a payload at an odd offset in its frame)."""
    if not body.readonly:
        view = torch.frombuffer(body, dtype=torch.uint8)
        if view.data_ptr() % dtype.itemsize == 0:
            return view.view(dtype)
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype)


def _decompressed(body: memoryview, size: int) -> bytes:
    """A zstd payload of exactly `size` bytes once decompressed: never more is produced (a
    frame that claims more, or holds more, is refused)."""
    import zstandard

    try:
        out = zstandard.ZstdDecompressor().decompress(body, max_output_size=size)
    except zstandard.ZstdError as e:
        raise KVFormatError(f"KV payload does not decompress: {e}") from None
    if len(out) != size:
        raise KVFormatError(f"KV payload decompresses to {len(out)} bytes, header says {size}")
    return out


def _dequantized(h: KVHeader, body: memoryview, shape: tuple[int, int, int, int]) -> KVBlob:
    """An int8 blob as float32 (what the importer converts from): values times scales."""
    n = h.sides * math.prod(shape)
    q = _tensor_of(body[:n], torch.int8).view(h.sides, *shape).to(torch.float32)
    scale = _tensor_of(body[n:], _SCALE).view(h.sides, *shape[:3], 1)  # (read only: the result is new)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise KVFormatError("int8 KV scales must be finite and not negative")
    x = q * scale
    k = x[0]
    v = x[1] if h.sides == 2 else k[..., :0]
    return KVBlob(replace(h, dtype="float32"), k, v)


def token_slice(blob: KVBlob, start: int, end: int) -> KVBlob:
    """Tokens [start, end) of a blob (absolute positions), as a blob of their own."""
    h = blob.header
    if not h.token_start <= start < end <= h.token_end:
        raise KVFormatError(f"[{start}, {end}) is not within [{h.token_start}, {h.token_end})")
    a, b = start - h.token_start, end - h.token_start
    header = replace(h, token_start=start, token_end=end, block_hashes=h.block_hashes[: end // h.block_size])
    return KVBlob(header, blob.k[:, a:b], blob.v[:, a:b])


def split_layers(blob: KVBlob) -> list[KVBlob]:
    """One blob per layer, as they travel (so the receiver works while the rest is on the line)."""
    h = blob.header
    return [
        KVBlob(_of_layers(h, h.layer_start + i, h.layer_start + i + 1, h.scales[2 * i : 2 * i + 2]), k, v)
        for i, (k, v) in enumerate(zip(blob.k.split(1), blob.v.split(1), strict=True))
    ]


def _of_layers(h: KVHeader, start: int, end: int, scales: list[float]) -> KVHeader:
    """`h` for layers [start, end) with their `scales` (`replace`'s result, without its
    cost: a header a frame, every frame)."""
    out = copy.copy(h)
    for name, value in (("layer_start", start), ("layer_end", end), ("scales", scales)):
        object.__setattr__(out, name, value)
    return out


def _same_tokens(a: KVHeader, b: KVHeader) -> bool:
    """Whether two layer slices' headers describe the same tokens of the same cache."""
    return all(
        getattr(a, f) == getattr(b, f)
        for f in ("num_layers", "kv_heads", "head_dim", "dtype", "page_size", "token_start", "token_end",
                  "block_size", "latent", "compressed", "block_hashes")
    )  # fmt: skip


def joined_header(parts: list[KVBlob]) -> KVHeader:
    """The header of consecutive layer slices of the same tokens, as one blob."""
    first, last = parts[0].header, parts[-1].header
    for a, b in zip(parts, parts[1:], strict=False):  # (each with the next)
        if b.header.layer_start != a.header.layer_end:
            raise KVFormatError(f"KV layers arrive out of order: {a.header.layer_end} then {b.header.layer_start}")
        if not _same_tokens(a.header, b.header):
            raise KVFormatError("KV layer slices describe different tokens")
    return _of_layers(first, first.layer_start, last.layer_end, [x for p in parts for x in p.header.scales])


def join_layers(parts: list[KVBlob]) -> KVBlob:
    """One blob from consecutive layer slices of the same tokens (as they travel per layer):
    the one slice itself where it holds every layer."""
    header = joined_header(parts)
    if len(parts) == 1:
        return parts[0]
    return KVBlob(header, torch.cat([p.k for p in parts]), torch.cat([p.v for p in parts]))


def encode_layers(parts: list[KVBlob], lossy: str = "", compress: str = "") -> list[bytes | bytearray | memoryview]:
    """Consecutive layer slices of the same tokens encoded as one blob, in parts (each
    layer's K, then each one's V: the slices' own memory, not joined first)."""
    if len(parts) == 1 or lossy or compress:
        return encode_parts(join_layers(parts), lossy, compress)
    sides = parts[0].header.sides
    body = [_bytes_of(p.k) for p in parts] + ([_bytes_of(p.v) for p in parts] if sides == 2 else [])
    return [_header_bytes(vars(joined_header(parts))), *body]


def layer_groups(blob: KVBlob, max_bytes: int) -> list[KVBlob]:
    """`blob` as blobs of consecutive layers, each of up to `max_bytes` of KV (one layer at
    least): what travels as one frame. A frame a layer of a few dozen tokens is tens of
    KiB, and each frame costs both ends a fixed time besides its bytes."""
    h = blob.header
    per_layer = h.payload_bytes // max(1, h.layer_end - h.layer_start)
    step, layers, out = max(1, max_bytes // max(1, per_layer)), blob.k.shape[0], []
    for i in range(0, layers, step):
        j = min(layers, i + step)
        header = _of_layers(h, h.layer_start + i, h.layer_start + j, h.scales[2 * i : 2 * j])
        out.append(KVBlob(header, blob.k[i:j], blob.v[i:j]))
    return out
