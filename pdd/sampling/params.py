"""What a request asks of the sampler, and where its randomness comes from.

No torch here: the router and the HTTP layer handle sampling parameters without
loading a model.

Seeded sampling must give the same tokens whichever instance produces a position (P
samples the first token, a relay the next few, the main decode instance the rest).
So a position's random numbers are a function of (seed, position) alone, never of a
generator's state that depends on how many draws an instance made before.
"""

from __future__ import annotations

import hashlib
import math
import sys
from typing import ClassVar

import msgspec

MIN_TEMPERATURE = 1e-5
_FLOAT_MAX = sys.float_info.max


MAX_CACHE_SALT = 256
GUIDE_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")  # (`pdd.engines.embedded.guide`)
MAX_LOGPROBS = 20  # top log-probabilities a token may carry (OpenAI's top_logprobs bound)
# a prompt's log-probabilities, counted as entries (its tokens x (1 + top)): what one frame
# carries back from P with room to spare (`wire.MAX_JSON_BYTES`, about 30 bytes an entry)
MAX_PROMPT_LOGPROB_ENTRIES = 262_144

# One output token's log-probability, and the top tokens' (id, log-probability), likeliest first
Logprob = tuple[float, tuple[tuple[int, float], ...]]


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A struct, not a dataclass, so a SUBMIT's parameters decode (and are checked) with
    the message around them; `msgspec.structs.replace` makes a changed copy. A field left
    at its default is left out on the wire (`omit_defaults`): an empty `cache_salt` (added
    in protocol 5) never reaches a peer of protocol 4, which would refuse the field."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # The request's prefix-cache namespace (OpenAI's and vLLM's `cache_salt`): its KV is
    # reused only by requests with the same salt. Not a sampling parameter: carried here
    # because these travel with the request to every instance. Empty: the shared cache.
    cache_salt: str = ""
    # Logit shaping, as vLLM has it: functions of the prompt and the output so far, so every
    # producer of a position (P, a relay, MD after a handoff) shapes it alike
    # (`pdd.sampling.draw.shape`). Protocol 6's: left out at their defaults.
    presence_penalty: float = 0.0  # minus this for each token already in the output
    frequency_penalty: float = 0.0  # minus this times the count of each token in the output
    repetition_penalty: float = 1.0  # tokens of the prompt or output: logit / this if > 0, else * this
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    min_p: float = 0.0  # drawn tokens only: drop those below min_p x the top token's probability
    min_tokens: int = 0  # no EOS nor stop token before this many output tokens
    # Each output token's log-probability, and this many of the likeliest's beside it (None:
    # none); raw, as vLLM's default `logprobs_mode`: before shaping, temperature and filters
    logprobs: int | None = None
    # Constrained decoding (`pdd.engines.embedded.guide`): (kind, spec), the output held to a JSON
    # Schema, any JSON object, a regex, one of a list of strings, or a Lark grammar
    guide: tuple[str, str] | None = None
    # Each prompt token's log-probability given the tokens before it, and this many of the
    # likeliest's beside it (None: none; vLLM's `prompt_logprobs`): computed on P alone,
    # which computes the whole prompt for them (no prefix cache), raw like `logprobs`
    prompt_logprobs: int | None = None

    # field -> the protocol version that added it; an instance speaking an older one is not
    # planned a request that sets it (`needs_protocol`; cache_salt: 4 would ignore it)
    SINCE: ClassVar[dict[str, int]] = {
        "cache_salt": 5,
        "presence_penalty": 6,
        "frequency_penalty": 6,
        "repetition_penalty": 6,
        "logit_bias": 6,
        "min_p": 6,
        "min_tokens": 6,
        "logprobs": 6,
        "guide": 6,
        "prompt_logprobs": 7,
    }

    def __post_init__(self) -> None:
        ints = (self.max_tokens, self.top_k, *self.stop_token_ids) + (() if self.seed is None else (self.seed,))
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            raise ValueError("max_tokens, top_k, seed and stop_token_ids must be integers")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (self.temperature, self.top_p)):
            raise ValueError("temperature and top_p must be numbers")
        if not all(-_FLOAT_MAX <= v <= _FLOAT_MAX for v in (self.temperature, self.top_p)):
            # inf, NaN, or an integer no float holds (10**400 from JSON): the sampler divides by it
            raise ValueError("temperature and top_p must be finite numbers")
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT:
            raise ValueError(f"cache_salt must be a string of at most {MAX_CACHE_SALT} characters")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError("ignore_eos must be true or false")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        self._check_shaping()

    def _check_shaping(self) -> None:
        floats = [self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.min_p]
        floats += [b for _, b in self.logit_bias]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in floats):
            raise ValueError("penalties, min_p and logit_bias values must be finite numbers")
        if not (isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)):
            raise ValueError("min_tokens must be an integer")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t, _ in self.logit_bias):
            raise ValueError("logit_bias keys must be token ids (integers >= 0)")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError("repetition_penalty must be in (0, 2]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not all(-100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(f"{name} must be 0 to {MAX_LOGPROBS} top tokens")
        if self.min_tokens < 0:  # (above max_tokens is a client's error, `pdd.api.shaping`; P runs
            raise ValueError("min_tokens must be >= 0")  # a request for its first token alone)

    @property
    def shapes(self) -> bool:
        """Whether the logits are shaped before the choice (`pdd.sampling.draw.shape`)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def needs_protocol(self) -> tuple[int, str]:
        """The oldest protocol an instance must speak to honour what this sets, and a field
        that needs it ((0, "") when nothing does)."""
        return max(((v, f) for f, v in self.SINCE.items() if getattr(self, f) != _DEFAULTS[f]), default=(0, ""))

    @property
    def greedy(self) -> bool:
        # below this, logits / temperature overflows float32: the top token is certain anyway
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(SamplingParams)}


def draw_key(seed: int, position: int) -> int:
    """The 64-bit key of output position `position`'s draw (`pdd.sampling.draw`).

    A hash of both, so any integer seed works (however large or negative) and every
    producer of that position draws from the same random numbers.
    """
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8, person=b"pdd-draw").digest()
    return int.from_bytes(digest, "little")
