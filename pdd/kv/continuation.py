"""Whether imported KV can land in a request: the one check every engine makes before an
import (`check_continuation`), against its cache's form (`CacheForm`)."""

from __future__ import annotations

from dataclasses import dataclass

from pdd.kv.blocks import PrefixHashes
from pdd.kv.codec import RAW_DTYPES, KVHeader


@dataclass(frozen=True)
class CacheForm:
    """What an importer's cache holds beyond its shape: a latent or K and V, and its dtype
    when that is one pdd carries as bytes (fp8), with the K and V scale of every layer."""

    latent: bool = False
    raw_dtype: str | None = None  # None: a cache blobs of `DTYPES` are converted into
    scales: tuple[float, ...] = ()

    def refuses(self, h: KVHeader) -> str | None:
        """Why `h`'s bytes cannot be written into this cache exactly (None: they can)."""
        if h.latent != self.latent:
            return f"imported KV holds {_HOLDS[h.latent]}, this cache {_HOLDS[self.latent]}"
        if h.dtype not in RAW_DTYPES and self.raw_dtype is None:
            return None
        if h.dtype != self.raw_dtype:
            return f"imported KV is {h.dtype} and this cache {self.raw_dtype or 'not fp8'}: pdd converts no fp8 KV"
        if tuple(h.scales) != self.scales[2 * h.layer_start : 2 * h.layer_end]:
            return f"imported {h.dtype} KV was quantized with other scales than this cache's: pdd cannot requantize"
        return None


_HOLDS = {True: "one latent vector a token (MLA)", False: "K and V"}
PLAIN = CacheForm()


def check_continuation(
    h: KVHeader,
    shape: tuple[int, int, int],
    prompt: PrefixHashes | list[int],
    computed: int,
    prompt_len: int,
    cache: CacheForm = PLAIN,
) -> str | None:
    """Why imported KV cannot land in a request that has computed `computed` tokens of the
    prompt whose block hashes are `prompt`'s (its tokens, or their hashes kept across a
    request's chunks) (None: it can): the cache's form (`CacheForm.refuses`), the model's
    (layers, kv heads, head dim) `shape`, every layer, the range continuing where the
    request's KV ends, within its prompt, and the same prompt (block hashes). Every
    engine refuses the same things."""
    why = cache.refuses(h)
    if why:
        return why
    if (h.num_layers, h.kv_heads, h.head_dim) != shape:
        return "imported KV has another model shape"
    if (h.layer_start, h.layer_end) != (0, shape[0]):
        return f"imported KV covers layers [{h.layer_start}, {h.layer_end}), not all {shape[0]}"
    if h.token_start != computed or h.token_end > prompt_len:
        return f"imported KV range [{h.token_start}, {h.token_end}) does not continue at {computed}"
    if not isinstance(prompt, PrefixHashes) or prompt.block_size != h.block_size:
        prompt = PrefixHashes(prompt if isinstance(prompt, list) else prompt.tokens, h.block_size)
    if prompt.upto(h.token_end) != h.block_hashes:
        return "imported KV belongs to another prompt (block hashes differ)"
    return None
