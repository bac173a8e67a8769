"""One instance's engine: model + KV pool + prefix cache + scheduler, stepped by a caller.

The engine is synchronous and single-threaded on purpose: a server runs `step()` in
one worker thread, so every structure here is touched by one thread only; the one
exception is a copy of KV into or out of a sequence's pages (`kv_moves`), which a
runtime runs beside the steps on its copy thread (`copies` says what keeps them apart). Besides the
plain request path it exposes the pieces disaggregation needs: hold a finished
prefill's pages for export, reserve a prefix and import KV for the rest, and extend a
sequence with given tokens in one forward pass.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdd.batching import Scheduler, Status
from pdd.engines.embedded.attention import PagedAttention
from pdd.engines.embedded.copies import Copies
from pdd.engines.embedded.kv_moves import KVMoves
from pdd.engines.embedded.kv_pool import KVPool
from pdd.engines.embedded.loader import load_model
from pdd.engines.embedded.paged_kv import PagedKV
from pdd.engines.embedded.sequence import Sequence
from pdd.engines.port import EngineConfig, RequestError, StepOutput
from pdd.kv import codec
from pdd.kv.copy_stream import CopyStream
from pdd.kv.layer_stream import LayerStream
from pdd.kv.pages import OutOfPages
from pdd.kv.radix_cache import RadixCache
from pdd.sampling.draw import logprobs as sampler_logprobs
from pdd.sampling.draw import sample
from pdd.sampling.guide import Guide, GuideError, Guides
from pdd.sampling.params import Logprob, SamplingParams


@dataclass
class EngineStats:
    steps: int = 0
    computed_tokens: int = 0  # tokens run through the model (prefill + extend + decode)
    prefill_tokens: int = 0  # prompt tokens computed (not served from cache)
    cached_prompt_tokens: int = 0
    decode_tokens: int = 0  # tokens sampled
    finished: int = 0
    aborted: int = 0  # requests stopped before their end (a client left, a peer failed)
    extra: dict[str, int] = field(default_factory=dict)


class Engine(KVMoves):
    def __init__(
        self, model_dir: str | Path, config: EngineConfig = EngineConfig(), eos_ids: frozenset[int] = frozenset()
    ) -> None:
        self.config = config
        self.model = load_model(model_dir, config.device, codec.DTYPES[config.dtype])
        self.model_cfg = self.model.cfg
        kv_dtype = codec.DTYPES[config.kv_dtype or config.dtype]
        self.pool = KVPool(self.model_cfg, config.num_pages, config.page_size, kv_dtype, config.device)
        self.cache = RadixCache(self.pool)  # a node subscribes through cache.on_event
        self.kv = PagedKV(self.pool, self.cache)
        self.scheduler = Scheduler(self.kv, config.max_batch_tokens, config.max_running)
        self.seqs: dict[str, Sequence] = {}
        self.copies: Copies | None = None  # the copy thread, where a runtime runs one (`pdd.engines.embedded.copies`)
        self.copy_stream = CopyStream(config.device)  # (a copy made here and now goes through it too)
        self.stats = EngineStats()
        self.eos_ids = eos_ids
        self.guides = Guides(Path(model_dir) / "tokenizer.json", self.model_cfg.vocab_size, sorted(eos_ids))
        # (start, tokens, prompt length) per sequence of the last step: what it computed, for
        # step-time calibration and pacing
        self.last_step: list[tuple[int, int, int]] = []

    # ---- request lifecycle -------------------------------------------------------------
    def _new_sequence(self, rid: str, prompt: list[int], params: SamplingParams, hold: bool) -> Sequence:
        if rid in self.seqs:
            raise RequestError(f"request id {rid!r} is already active")
        if not prompt:
            raise RequestError("prompt must contain at least one token")
        self._check_tokens(prompt)
        if any(t >= self.model_cfg.vocab_size for t, _ in params.logit_bias):
            raise RequestError(f"logit_bias names a token id beyond the vocabulary of {self.model_cfg.vocab_size}")
        guide = None
        if params.guide is not None:  # (built here, once: a grammar that does not compile is the request's error)
            try:
                guide = self.guides.start(*params.guide)
            except GuideError as e:
                raise RequestError(f"{params.guide[0]}: {e}") from None
        limit = min(self.model_cfg.max_position, self.pool.num_pages * self.pool.page_size)
        if len(prompt) + params.max_tokens > limit:
            raise RequestError(
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds the context window "
                f"of {limit} tokens"
            )
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(
            rid=rid, tokens=list(prompt), prompt_len=len(prompt), params=params, hold=hold, seed=seed, guide=guide
        )
        self.seqs[rid] = seq
        return seq

    def _check_tokens(self, tokens: list[int] | tuple[int, ...]) -> None:
        vocab = self.model_cfg.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in tokens):
            raise RequestError(f"token ids must be integers in [0, {vocab})")

    def add_request(
        self, rid: str, prompt: list[int], params: SamplingParams, hold: bool = False, stream: LayerStream | None = None
    ) -> Sequence:
        """Queue a request. With `hold`, its pages survive finishing until `release`; with
        `stream`, its prompt's KV is put there layer by layer as it is computed (`layer_taps`)."""
        seq = self._new_sequence(rid, prompt, params, hold)
        seq.stream = stream
        self.scheduler.add(seq)
        return seq

    def abort(self, rid: str) -> None:
        self._drop(rid, aborting=True)

    def release(self, rid: str) -> None:
        """Free a held (or reserved) sequence: its KV goes to the prefix cache. (Not an
        abort: P releases every request it handed over.)"""
        self._drop(rid, aborting=False)

    def _drop(self, rid: str, aborting: bool) -> None:
        seq = self.seqs.pop(rid, None)
        if seq is None:
            return
        if seq.copies:  # its copies stop before its pages go (waiting out one slice at most)
            if self.copies is not None:
                self.copies.cancel(seq)
            else:
                seq.copy_cancelled = True
            if seq.status == Status.RESERVED:  # only what its finished slices wrote is there
                seq.num_computed = min(seq.num_computed, seq.copied_end)
        self.stats.aborted += aborting and seq.status != Status.FINISHED
        if seq.status in (Status.WAITING, Status.RUNNING):
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
        if seq.status in (Status.RESERVED, Status.HELD):
            self.kv.release(seq)
        seq.status = Status.FINISHED

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---- disaggregation hooks ------------------------------------------------------------
    def reserve(self, rid: str, prompt: list[int], params: SamplingParams, use_cache: bool = True) -> int:
        """Lock the longest cached prefix of `prompt`, allocate pages for the rest, and
        return the cached length in tokens.

        The sequence waits (not schedulable) until KV for the rest is imported and
        `start` is called. At least one prompt token is left for import. Pages are
        taken now, not on import, so a reservation that succeeds can always be filled;
        when the pool cannot hold the prompt, OutOfPages is raised and nothing is kept.
        Without `use_cache` nothing is reused (the plain cross-datacenter PD baseline).
        """
        seq = self._new_sequence(rid, prompt, params, hold=False)
        match = self.cache.match_prefix(prompt[: len(prompt) - 1] if use_cache else [], salt=params.cache_salt)
        self.cache.lock(match.node)
        need = self.pool.pages_for(len(prompt)) - match.num_pages
        short = need - self.pool.free_pages
        if short > 0 and short > self.cache.evictable_pages():  # don't wipe the cache for nothing
            self.cache.unlock(match.node)
            del self.seqs[rid]
            raise OutOfPages(f"reservation needs {need} pages, {self.pool.free_pages} free")
        if short > 0:
            self.cache.evict(short)
        seq.cache_node, seq.pages = match.node, list(match.pages) + self.pool.allocate(need)
        seq.num_computed = seq.cached_tokens = match.num_pages * self.pool.page_size
        seq.status = Status.RESERVED
        return seq.num_computed

    def start(
        self, rid: str, tokens: list[int] | tuple[int, ...] = (), shadow: bool = False, step_cap: int = 0
    ) -> Sequence:
        """Make a reserved sequence schedulable, appending already-generated tokens.

        Everything after the imported KV (e.g. P's first token, or a relay's tokens in a
        handoff) is computed in one extend step; then decoding continues. With `shadow`
        (a catch-up chunk) the tokens are computed, at most `step_cap` a step, but
        nothing is sampled: the sequence waits reserved for the next chunk. A shadow
        sequence still computing takes more tokens, and a non-shadow start ends its
        catch-up.
        """
        seq = self.seqs.get(rid)
        shadowing = seq is not None and seq.shadow and seq.status in (Status.WAITING, Status.RUNNING)
        if seq is None or not (seq.status == Status.RESERVED or shadowing):
            raise RequestError(f"request {rid!r} is not reserved")
        self._check_tokens(tokens)
        if seq.num_output + len(tokens) > seq.params.max_tokens:
            raise RequestError(
                f"{seq.num_output + len(tokens)} output tokens exceed max_tokens {seq.params.max_tokens}"
            )
        seq.tokens.extend(tokens)
        seq.shadow, seq.step_cap = shadow, step_cap
        if not shadow and seq.num_pending == 0 and seq.num_computed > seq.prompt_len:
            # catch-up computed every handed-over token: recompute the last one (same
            # token, position and context, so the same KV) for the logits of the next
            seq.num_computed -= 1
        if seq.status == Status.RESERVED:
            if seq.num_pending < 1 and not shadow:
                raise RequestError("nothing left to compute: import must leave the last token")
            if seq.num_pending and seq.copies:
                seq.start_deferred = True  # (`copied` schedules it once its KV is in place)
            elif seq.num_pending:
                self.scheduler.add(seq)
        return seq

    def cut(self, rid: str) -> list[int]:
        """Stop a sequence now and return its output (a relay handing off): its pages
        go to the prefix cache."""
        seq = self.seqs.get(rid)
        if seq is None:
            raise RequestError(f"request {rid!r} is not active")
        output = seq.output
        self.abort(rid)
        return output

    def extend(self, rid: str, tokens: list[int], want_logits: bool = False) -> None:
        """Append given tokens to an active sequence; the next step computes them at once."""
        seq = self.seqs.get(rid)
        if seq is None or seq.status not in (Status.WAITING, Status.RUNNING):
            raise RequestError(f"request {rid!r} is not active")
        self._check_tokens(tokens)
        seq.tokens.extend(tokens)
        seq.want_logits = want_logits

    # ---- stepping ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        self.last_step = [(seq.num_computed, n, seq.prompt_len) for seq, n in batch]
        if not batch:
            return []
        device = self.config.device
        ids: list[int] = []
        pos: list[int] = []
        spans: list[tuple[list[int], int, int]] = []
        for seq, n in batch:
            ids.extend(seq.tokens[seq.num_computed : seq.num_computed + n])
            pos.extend(range(seq.num_computed, seq.num_computed + n))
            spans.append((seq.pages, seq.num_computed, n))
        attn = PagedAttention(self.pool, spans, device)
        attn.on_layer = self.layer_taps(batch)
        hidden = self.model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), attn)
        ready, offset = [], 0  # sequences with nothing pending, and their last row
        for seq, n in batch:
            if seq.want_logits:
                seq.step_logits = self.model.logits(hidden[offset : offset + n]).cpu()
                seq.want_logits = False
            if seq.params.prompt_logprobs is not None and seq.num_computed < seq.prompt_len:
                self._prompt_logprobs(seq, hidden[offset : offset + n])
            if seq.num_computed < seq.prompt_len:
                prompt_part = min(n, seq.prompt_len - seq.num_computed)
                self.stats.prefill_tokens += prompt_part
            seq.num_computed += n
            if not seq.published and seq.num_computed >= seq.prompt_len:
                self._publish(seq)
            if seq.num_pending == 0:
                ready.append((seq, offset + n - 1))
            offset += n
        self.stats.steps += 1
        self.stats.computed_tokens += offset
        step = self.stats.steps
        outputs = [StepOutput(seq.rid, None, None, step=step) for seq, _ in batch if seq.num_pending > 0]
        for seq, _ in ready:
            if seq.shadow:  # a catch-up chunk is in: wait for the next one, sample nothing
                self.scheduler.pause(seq)
                outputs.append(StepOutput(seq.rid, None, None, caught_up=seq.num_output, step=step))
        sampling = [(seq, row) for seq, row in ready if not seq.shadow]
        if sampling:
            logits = self.model.logits(hidden[[row for _, row in sampling]])
            seqs = [seq for seq, _ in sampling]
            positions = [s.num_output for s in seqs]
            histories = [(s.tokens[: s.prompt_len], s.output) if s.params.shapes else None for s in seqs]
            stops = [self.eos_ids | frozenset(s.params.stop_token_ids) for s in seqs]
            guides = [self._guide(s) for s in seqs]
            params = [s.params for s in seqs]
            tokens = sample(logits, params, [s.seed for s in seqs], positions, histories, stops, guides)
            lps = self._logprobs(logits, seqs, tokens)
            for seq, tok, position, lp in zip(seqs, tokens, positions, lps, strict=True):
                seq.tokens.append(tok)
                self.stats.decode_tokens += 1
                reason = self._finish_reason(seq, tok)
                if reason:
                    self._finish(seq, reason)
                prompt_lps = seq.prompt_logprobs if position == 0 and seq.params.prompt_logprobs is not None else None
                outputs.append(
                    StepOutput(
                        seq.rid,
                        tok,
                        reason,
                        seq.cached_tokens,
                        position,
                        step=step,
                        logprob=lp,
                        prompt_logprobs=prompt_lps,
                    )
                )
        return outputs

    def _publish(self, seq: Sequence) -> None:
        """Give the prefix cache the prompt's full pages as soon as they are computed, not
        when the request ends: a request for the same prefix meanwhile (another choice of
        the same request, another turn) reuses them. The sequence holds them locked. Where
        another sequence cached some of them first, nothing is published: its own pages
        stay its own (a cached copy's KV may differ in the last bits)."""
        seq.published = True
        full = seq.prompt_len // self.pool.page_size * self.pool.page_size
        tokens, pages = seq.tokens[:full], seq.pages[: full // self.pool.page_size]
        cached = self.cache.match_prefix(tokens, touch=False, salt=seq.params.cache_salt)
        if cached.pages != pages[: cached.num_pages] or cached.num_pages == len(pages):
            return
        node = self.cache.insert(tokens, pages, seq.params.cache_salt)
        self.cache.lock(node)
        self.cache.unlock(seq.cache_node)
        seq.cache_node = node

    PROMPT_LOGITS_ROWS = 256  # rows of logits at a time: [rows, vocab] floats, 150 MB for 150k tokens

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """The raw log-probabilities of the prompt tokens after the rows `hidden` computes
        (positions from `seq.num_computed`), by position: the first token has none. A
        sequence computed again from 0 (preempted) starts its list again."""
        start = seq.num_computed
        del seq.prompt_logprobs[start + 1 :]
        if start == 0:
            seq.prompt_logprobs[:] = [None]
        rows = min(hidden.shape[0], seq.prompt_len - 1 - start)  # (the last prompt row predicts the output)
        top = seq.params.prompt_logprobs or 0
        for a in range(0, rows, self.PROMPT_LOGITS_ROWS):
            b = min(rows, a + self.PROMPT_LOGITS_ROWS)
            logits = self.model.logits(hidden[a:b])
            nexts = seq.tokens[start + a + 1 : start + b + 1]
            seq.prompt_logprobs.extend(sampler_logprobs(logits, nexts, [top] * len(nexts)))

    @staticmethod
    def _guide(seq: Sequence) -> Guide | None:
        """The sequence's grammar, advanced over its output so far (tokens given by P or a
        relay included: the grammar's state is a function of the output alone)."""
        if seq.guide is not None:
            seq.guide.advance(seq.output)
        return seq.guide

    @staticmethod
    def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[Logprob | None]:
        """Each sampled token's raw log-probabilities, where its request asks for them."""
        out: list[Logprob | None] = [None] * len(seqs)
        asked = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if asked:
            tops = [seqs[i].params.logprobs or 0 for i in asked]
            got = sampler_logprobs(logits[asked], [tokens[i] for i in asked], tops)
            for i, lp in zip(asked, got, strict=True):
                out[i] = lp
        return out

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and (tok in self.eos_ids or tok in p.stop_token_ids):
            return "stop"
        if seq.num_output >= p.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.stats.finished += 1
        self.stats.cached_prompt_tokens += seq.cached_tokens
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        if seq.status == Status.FINISHED:
            del self.seqs[seq.rid]

    # ---- conveniences ------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion together (tests, benchmarks, offline use)."""
        rids = [f"gen-{id(self)}-{i}" for i in range(len(prompts))]
        seqs = [self.add_request(r, p, params) for r, p in zip(rids, prompts, strict=True)]
        while self.has_work():
            self.step()
        return [s.output for s in seqs]

    def flush_cache(self) -> int:
        return self.cache.flush()
