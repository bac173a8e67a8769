"""`pdd bench transfer --compress` and `--lossy`: what the line's KV forms change, on the tiny model.

`--compress` measures lossless codecs on the KV the tiny model computes (whether they pay
on a 1 or 10 Gbit/s line); `--lossy`, what `[line] lossy_kv = "int8"` changes (greedy
tokens, logprobs, bytes). Neither needs root.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from pdd.lab.netns.transfer_loopback import prefilled
from pdd.lab.netns.transfer_receiver import engine_for


def _kv_pages(prompt_tokens: int) -> bytes:
    """The KV (all layers, K then V) the default tiny model computes for a prompt of random
    token IDs: the bytes a KV_LAYER frame carries, fp32."""
    engine, prompt = prefilled(prompt_tokens)
    blob = engine.export_kv("kv", 0, len(prompt))
    return blob.k.contiguous().numpy().tobytes() + blob.v.contiguous().numpy().tobytes()


def _codecs() -> dict[str, tuple[Any, Any]]:
    """name -> (compress, decompress), for what is installed."""
    import zlib

    out: dict[str, tuple[Any, Any]] = {"zlib-1": (lambda b: zlib.compress(b, 1), zlib.decompress)}
    try:
        import zstandard

        for level in (1, 3):
            c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
            out[f"zstd-{level}"] = (c.compress, d.decompress)
    except ImportError:
        pass
    try:
        import lz4.frame

        out["lz4"] = (lz4.frame.compress, lz4.frame.decompress)
    except ImportError:
        pass
    return out


def compress(args: argparse.Namespace) -> int:
    """Whether lossless compression pays on the line: for each codec, the ratio, one core's
    compress and decompress MB/s, and the rate a 1 and a 10 Gbit/s line then carries KV
    at (the slowest of compressing, the line times the ratio, and decompressing, as a
    pipeline) against the line alone."""
    import torch

    fp32 = _kv_pages(args.prompt_tokens)
    bf16 = torch.frombuffer(bytearray(fp32), dtype=torch.float32).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    rows: list[dict[str, Any]] = []
    for dtype, data in (("float32", fp32), ("bfloat16", bf16)):
        for name, (comp, decomp) in _codecs().items():
            began = time.perf_counter()
            packed = comp(data)
            c_s = time.perf_counter() - began
            began = time.perf_counter()
            assert decomp(packed) == data
            d_s = time.perf_counter() - began
            ratio, c_mb_s, d_mb_s = len(data) / len(packed), len(data) / c_s / 1e6, len(data) / d_s / 1e6
            carried = {gbit: min(c_mb_s, gbit * 125 * ratio, d_mb_s) for gbit in (1, 10)}
            rows.append(
                {
                    "dtype": dtype,
                    "codec": name,
                    "ratio": ratio,
                    "compress_mb_s": c_mb_s,
                    "decompress_mb_s": d_mb_s,
                    "kv_mb_s_at_1_gbit": carried[1],
                    "kv_mb_s_at_10_gbit": carried[10],
                }
            )
    title = f"Lossless codecs on {len(fp32) / 1e6:.1f} MB of the tiny model's KV ({args.prompt_tokens} tokens)"
    table = Table(title=title)
    for col in (
        "dtype",
        "codec",
        "ratio",
        "compress MB/s",
        "decompress MB/s",
        "KV MB/s at 1 Gbit/s (125)",
        "at 10 Gbit/s (1250)",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["dtype"],
            r["codec"],
            f"{r['ratio']:.3f}",
            f"{r['compress_mb_s']:.0f}",
            f"{r['decompress_mb_s']:.0f}",
            f"{r['kv_mb_s_at_1_gbit']:.0f}",
            f"{r['kv_mb_s_at_10_gbit']:.0f}",
        )
    Console().print(table)
    if args.out:
        args.out.write_text(json.dumps({"prompt_tokens": args.prompt_tokens, "rows": rows}, indent=2) + "\n")
    return 0


def lossy(args: argparse.Namespace) -> int:
    """Each prompt prefilled once (P), its KV then imported, as MD imports it, once exact
    and once through int8, and decoded greedily from P's first token: how often the tokens
    stay equal, how far the first decoded position's logprobs move (of the exact run's
    token, and the largest over the vocabulary), and the bytes the KV took on the line."""
    import random

    import torch

    from pdd.kv import codec
    from pdd.sampling.params import SamplingParams

    engine = engine_for(3 * (args.prompt_tokens + args.output_tokens) // 16 + 8)
    rng = random.Random(0)
    forms = ("", "int8")
    equal, token_dlp, max_dlp, line_bytes = 0, [], [], dict.fromkeys(forms, 0)
    for i in range(args.prompts):
        prompt = [rng.randrange(16, 4000) for _ in range(args.prompt_tokens)]
        p = engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1), hold=True)
        while p.num_computed < len(prompt) or not p.output:
            engine.step()
        first, blob = p.output[0], engine.export_kv(f"p{i}", 0, len(prompt))
        engine.release(f"p{i}")
        outputs, logprobs = {}, {}
        for form in forms:
            data = codec.encode(blob, form)
            line_bytes[form] += len(data)
            rid = f"{form or 'exact'}{i}"
            engine.reserve(rid, prompt, SamplingParams(max_tokens=args.output_tokens), use_cache=False)
            engine.import_kv(rid, codec.decode(data))
            seq = engine.start(rid, [first])
            seq.want_logits = True
            while engine.has_work():
                engine.step()
            outputs[form] = list(seq.output)
            assert seq.step_logits is not None  # (the first step after the import computed them)
            logprobs[form] = torch.log_softmax(seq.step_logits[-1].double(), dim=-1)
        engine.flush_cache()
        equal += outputs[""] == outputs["int8"]
        token = outputs[""][1]  # (the output's first token is P's)
        token_dlp.append(abs(float(logprobs[""][token] - logprobs["int8"][token])))
        max_dlp.append(float((logprobs[""] - logprobs["int8"]).abs().max()))
    title = (
        f"line.lossy_kv = int8 on the tiny model: {args.prompts} prompts of {args.prompt_tokens} tokens, "
        f"{args.output_tokens} greedy tokens each"
    )
    table = Table(title=title)
    for col in ("figure", "value"):
        table.add_column(col, justify="right")
    table.add_row("prompts whose greedy tokens are all equal", f"{equal} of {args.prompts}")
    table.add_row(
        "|logprob difference| of the exact token, mean / max",
        f"{sum(token_dlp) / len(token_dlp):.2e} / {max(token_dlp):.2e}",
    )
    table.add_row("largest |logprob difference| over the vocabulary", f"{max(max_dlp):.2e}")
    table.add_row("KV bytes on the line, exact (fp32) / int8", f"{line_bytes['']:,} / {line_bytes['int8']:,}")
    table.add_row(
        "bytes saved", f"{1 - line_bytes['int8'] / line_bytes['']:.1%} ({line_bytes[''] / line_bytes['int8']:.2f}x)"
    )
    Console().print(table)
    if args.out:
        out = {"equal": equal, "prompts": args.prompts, "token_dlp": token_dlp, "max_dlp": max_dlp, "bytes": line_bytes}
        args.out.write_text(json.dumps(out, indent=2) + "\n")
    return 0
