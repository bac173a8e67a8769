"""Next-token choice: greedy for the oracle, seeded temperature/top-k/top-p otherwise.

A sampled token wins an exponential race: the argmax of `p_j / E_j` over the filtered
distribution `p`, where `E_j ~ Exp(1)` is a hash of (seed, position, token j). That is
an exact draw from `p` (vLLM samples the same way), and the same position draws the
same token on every instance.

Why a race and not an inverse CDF: two producers of a position compute its logits by
different paths (a 1-token decode, an N-token extend after a handoff), equal to about
1e-3. An inverse CDF moves its pick whenever any earlier token's mass moves across the
random number, and top-p's cut among near-equal tokens moves the whole tail; a race
changes winner only when the two best scores tie within that difference. Under the
same perturbation of the tiny model's hot (temperature 25, top-p 0.95) logits, the
race changed 1 draw in 2,000 where the inverse CDF changed 240
(`tests/test_engine.py::test_a_seeded_draw_survives_a_float_difference_in_the_logits`).

Before the choice, a request's logits are shaped as vLLM shapes them (`shape`): its
logit bias, `min_tokens` (no EOS nor stop token yet), then the repetition, frequency and
presence penalties; `min_p` filters the drawn distribution beside top-k and top-p. Each
is a function of the prompt and the output so far, which every producer of a position
holds (MD after a handoff holds P's and the relay's tokens as its output), so the same
position is shaped alike wherever it is produced.

The draw runs on the logits' device, a GPU's step's sampled rows at once: vLLM calls
this for each step's batch (`pdd.engines.vllm.draw`), over vocabularies of 150,000
tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pdd.sampling.guide import Guide
from pdd.sampling.params import Logprob, SamplingParams, draw_key

_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's


def _signed(word: int) -> int:
    """A 64-bit word as an int64 tensor holds it (two's complement)."""
    word &= (1 << 64) - 1
    return word - (1 << 64) if word >> 63 else word


def _splitmix(z: Any, shift: Callable[[Any, int], Any], mix1: Any, mix2: Any) -> Any:
    """splitmix64's finish of 64-bit words, numpy's or torch's: the top 53 bits."""
    z = (z ^ shift(z, 30)) * mix1
    z = (z ^ shift(z, 27)) * mix2
    return shift(z ^ shift(z, 31), 11)


def _words_numpy(keys: list[int], vocab: int) -> torch.Tensor:
    z = np.array([k & ((1 << 64) - 1) for k in keys], dtype=np.uint64)[:, None]
    z = z + np.arange(1, vocab + 1, dtype=np.uint64) * np.uint64(_GOLDEN)  # uint64 wraps mod 2**64
    words = _splitmix(z, lambda w, n: w >> np.uint64(n), np.uint64(_MIX1), np.uint64(_MIX2))
    return torch.from_numpy(words.astype(np.float64))


def _words_torch(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    z = torch.tensor([_signed(k) for k in keys], dtype=torch.int64, device=device)[:, None]
    z = z + torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _signed(_GOLDEN)  # wraps too

    def shift(w: torch.Tensor, n: int) -> torch.Tensor:  # logical: torch's >> on int64 keeps the sign
        return (w >> n) & ((1 << (64 - n)) - 1)

    return _splitmix(z, shift, _signed(_MIX1), _signed(_MIX2)).double()


def exponentials(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(keys), vocab] Exp(1) numbers (float64) on `device`: row r token j is a
    function of (`keys[r]`, j) alone, splitmix64 of the key plus j+1 golden steps. The
    same words on every device: integer arithmetic that wraps mod 2**64, in numpy on the
    CPU (several times faster there than torch's int64), in torch elsewhere; only the log
    may differ in its last bit, which moves a race no more than the logits' own noise."""
    words = _words_numpy(keys, vocab) if device.type == "cpu" else _words_torch(keys, vocab, device)
    return words.add_(0.5).div_(float(1 << 53)).log_().neg_()  # u in (0, 1), never 0: -log u


History = tuple[Sequence[int], Sequence[int]]  # a request's prompt and its output so far


def logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[Logprob]:
    """Each row's raw log-probability (log-softmax of the logits as the model gave them,
    before shaping and temperature: vLLM's default `logprobs_mode`) of its chosen token,
    and of its `tops[i]` likeliest tokens, likeliest first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    k = max(tops, default=0)
    best = torch.topk(lp, k, dim=-1) if k else None
    out: list[Logprob] = []
    for i, (value, top) in enumerate(zip(chosen, tops, strict=True)):
        pairs = (
            ()
            if best is None
            else tuple(zip(best.indices[i, :top].tolist(), best.values[i, :top].tolist(), strict=True))
        )
        out.append((value, pairs))
    return out


def shape(logits: torch.Tensor, params: SamplingParams, history: History, stops: frozenset[int]) -> torch.Tensor:
    """One row of logits [vocab] shaped by `params` (a new tensor), in vLLM's order:
    logit bias; `min_tokens` (EOS and the stop tokens, `stops`, masked while the output is
    shorter); the repetition penalty over the tokens of prompt and output; the frequency
    and presence penalties over the output's. (A logit bias beyond the vocabulary is refused
    where the request is taken.)"""
    prompt, output = history
    row = logits.clone()
    device, vocab = row.device, row.shape[0]
    if params.logit_bias:
        tokens, biases = zip(*params.logit_bias, strict=True)
        row[torch.tensor(tokens, device=device)] += torch.tensor(biases, dtype=row.dtype, device=device)
    if len(output) < params.min_tokens and not params.ignore_eos and stops:
        row[torch.tensor(sorted(stops), device=device)] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        seen[torch.tensor([*prompt, *output], dtype=torch.long, device=device)] = True
        penalized = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
        row = torch.where(seen, penalized, row)
    if (params.frequency_penalty or params.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(list(output), dtype=torch.long, device=device), minlength=vocab)
        row -= params.frequency_penalty * counts.to(row.dtype)
        row -= params.presence_penalty * (counts > 0).to(row.dtype)
    return row


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seeds: list[int],
    positions: list[int],
    histories: Sequence[History | None] = (),
    stops: Sequence[frozenset[int]] = (),
    guides: Sequence[Guide | None] = (),
) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32); row i is output position
    `positions[i]` of a request seeded `seeds[i]` (unused when greedy), its logits
    shaped by its parameters (`shape`) over `histories[i]` with stop tokens `stops[i]`
    where they ask for it, then held to its grammar (`guides[i]`, advanced over its output)."""
    shaped = [i for i, p in enumerate(params) if p.shapes]
    guided = [i for i, g in enumerate(guides) if g is not None]
    if shaped or guided:
        logits = logits.clone()
        for i in shaped:
            history = histories[i]
            if history is None:
                raise ValueError("a request whose logits are shaped needs its prompt and output")
            logits[i] = shape(logits[i], params[i], history, stops[i])
        for i in guided:
            guide = guides[i]
            assert guide is not None
            guide.mask(logits[i])
    out = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    # a GPU draws every row in one go; the CPU one row at a time, which stays in its cache
    # (a batch of 64 rows of 150,000 tokens took three times as long in one go)
    group = 1 if logits.device.type == "cpu" else max(len(rows), 1)
    for start in range(0, len(rows), group):
        chunk = rows[start : start + group]
        keys = [draw_key(seeds[i], positions[i]) for i in chunk]
        for i, token in zip(chunk, _race(logits[chunk], [params[i] for i in chunk], keys), strict=True):
            out[i] = token
    return out


def _race(logits: torch.Tensor, params: list[SamplingParams], keys: list[int]) -> list[int]:
    """The winner of each row's race over its filtered distribution (`draw_key`s given)."""
    device = logits.device

    def per_row(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=device)[:, None]

    scores = logits.double() / per_row([p.temperature for p in params])
    vocab = scores.shape[1]
    ks = [min(p.top_k, vocab) for p in params]
    if any(ks):
        # each row's k-th best score, from the best max(k) of every row (k = 0: no cut)
        best = torch.topk(scores, max(ks), dim=1).values
        kth = best.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device)[:, None])
        kth = kth.masked_fill(per_row([float(k == 0) for k in ks]) > 0, float("-inf"))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=1)
    if any(p.min_p > 0 for p in params):
        # below min_p times the row's top probability: no mass (vLLM's min-p, after temperature)
        floor = probs.max(dim=1, keepdim=True).values * per_row([p.min_p for p in params])
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)  # (top-p's cut measures what is left)
    if any(p.top_p < 1.0 for p in params):
        sorted_p, order = torch.sort(probs, dim=1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always the top token)
        cut = per_row([p.top_p if p.top_p < 1.0 else float("inf") for p in params])  # 1: no cut
        sorted_p = sorted_p.masked_fill((sorted_p.cumsum(1) - sorted_p) >= cut, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    # a filtered token has no mass, so it scores 0 and never wins
    return probs.div_(exponentials(keys, vocab, device)).argmax(dim=1).tolist()
