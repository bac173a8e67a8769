"""From an OpenAI request to what pdd runs, and from what it ran to OpenAI's response
shapes: sampling parameters checked against the context, prompt text checked as
Unicode, the usage object, the collected outcome of a generation."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from fastapi.exceptions import RequestValidationError
from msgspec.structs import replace  # sampling params are a msgspec struct

from pdd.api.protocol import ApiError, _Common
from pdd.record import RequestRecord
from pdd.sampling import MAX_CACHE_SALT, SamplingParams


@dataclass
class Outcome:
    """What a finished generation adds up to (filled while streaming)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    record: RequestRecord | None = None

    def served(self) -> dict:
        """The `pdd` object of the response: where the request ran."""
        return self.record.served() if self.record else {}


def sampling_params(
    req: _Common,
    prompt_len: int,
    max_tokens: int | None,
    default_max: int,
    limit: int,
    defaults: Mapping[str, float | int] = {},
    tenant: str = "",
) -> SamplingParams:
    """The request's sampling parameters, checked against the model's context `limit`;
    what the request leaves out comes from the model's generation config (`defaults`:
    temperature, top_p, top_k, max_new_tokens), as vLLM's server does. Its prefix-cache
    namespace is `cache_namespace`'s, `tenant` the name of its API key where each key's
    requests are kept apart (a server of several keys)."""
    given = req.model_fields_set
    default_max = int(defaults.get("max_new_tokens", default_max))
    if prompt_len == 0:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if prompt_len >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens; the prompt has {prompt_len} tokens.",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = min(default_max, limit - prompt_len)
    if max_tokens < 1:
        raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
    if prompt_len + max_tokens > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    temperature, top_p, top_k = (
        getattr(req, k) if k in given or k not in defaults else defaults[k] for k in ("temperature", "top_p", "top_k")
    )
    try:  # a JSON integer can be too large for any float (10**400): a client error, not a 500
        temperature, top_p = float(temperature), float(top_p)
    except OverflowError:
        raise ApiError(400, "temperature and top_p must be finite numbers") from None
    if not (0 <= temperature and math.isfinite(temperature)):  # as vLLM: no upper bound
        raise ApiError(400, "temperature must be a finite number >= 0", param="temperature")
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_API_SALT:
        raise ApiError(400, f"cache_salt must be 1 to {MAX_API_SALT} characters", param="cache_salt")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=int(top_k),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids),
            cache_salt=cache_namespace(unicode_text(req.cache_salt or "", "cache_salt"), tenant),
        )
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    if params.seed is None and not params.greedy:
        # Chosen here, once: every instance that samples a position of this request
        # (prefill, relay, main decode) then draws from the same seed.
        params = replace(params, seed=secrets.randbits(63))
    return params


MAX_API_SALT = MAX_CACHE_SALT - 16  # what a client may give; the namespace adds its kind


def cache_namespace(salt: str, tenant: str) -> str:
    """A request's prefix-cache namespace: its own `cache_salt` if it gives one (as on
    vLLM: requests that give the same salt share); else its API key's name where the
    server keeps each key's requests apart (so without a salt, no key's cached-token
    counts reveal another's prefixes); else the shared cache (""). The kinds are
    prefixed, so no salt a client gives names a key's namespace."""
    if salt:
        return f"salt:{salt}"
    return f"key:{tenant}" if tenant else ""


def usage(prompt_len: int, out: Outcome) -> dict:
    n = len(out.token_ids)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": n,
        "total_tokens": prompt_len + n,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def unicode_text(text: str, param: str) -> str:
    """JSON can carry a lone UTF-16 surrogate ("\\ud800"), which is no Unicode text:
    the tokenizer would fail on it deep inside, as a server error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400, f"{param} is not valid Unicode text ({e.reason} at position {e.start})", param=param
        ) from None
    return text


def validation_error(exc: RequestValidationError) -> ApiError:
    """A body that does not parse, as OpenAI's 400: its first five faults, `param` the first's field."""
    parts, params = [], []
    for err in exc.errors()[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        params.append(where)
    return ApiError(400, "; ".join(parts) or "invalid request", param=params[0] if params and params[0] else None)
