"""From an OpenAI request to what pdd runs, and from what it ran to OpenAI's response
shapes: sampling parameters checked against the context, prompt text checked as
Unicode, the usage object, the collected outcome of a generation."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi.exceptions import RequestValidationError
from msgspec.structs import replace  # sampling params are a msgspec struct

from pdd.api.protocol import ApiError, ChatCompletionRequest, _Common
from pdd.record import RequestRecord
from pdd.sampling.params import MAX_CACHE_SALT, MAX_LOGPROBS, MAX_PROMPT_LOGPROB_ENTRIES, SamplingParams


@dataclass
class Outcome:
    """What a finished generation adds up to (filled while streaming)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    record: RequestRecord | None = None
    logprobs: list[dict] = field(default_factory=list)  # the `logprobs` object of each piece, where asked
    prompt_logprobs: list[dict | None] | None = None  # vLLM's shape, where asked (`LogprobFormatter.prompt`)

    def served(self) -> dict:
        """The `pdd` object of the response: where the request ran."""
        return self.record.served() if self.record else {}


UNSET = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # OpenAI's and vLLM's, where the model's config has none


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
    temperature, top_p, top_k = _draw(req, defaults)
    if req.cache_salt is not None and not 0 < len(req.cache_salt) <= MAX_API_SALT:
        raise ApiError(400, f"cache_salt must be 1 to {MAX_API_SALT} characters", param="cache_salt")
    shaping = _shaping(req)
    if prompt_len * (1 + shaping.get("prompt_logprobs", -1)) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ApiError(
            400,
            f"prompt logprobs of {prompt_len} tokens x {1 + shaping['prompt_logprobs']} are more than "
            f"{MAX_PROMPT_LOGPROB_ENTRIES:,} entries",
            param="prompt_logprobs",
        )
    if shaping.get("min_tokens", 0) > max_tokens:
        raise ApiError(
            400, f"min_tokens ({shaping['min_tokens']}) exceeds max_tokens ({max_tokens})", param="min_tokens"
        )
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids),
            cache_salt=cache_namespace(unicode_text(req.cache_salt or "", "cache_salt"), tenant),
            **shaping,
        )
    except ValueError as e:
        named = [k for k in shaping if str(e).startswith(k)]
        raise ApiError(400, str(e), param=named[0] if named else None) from None
    if params.seed is None and not params.greedy:
        # Chosen here, once: every instance that samples a position of this request
        # (prefill, relay, main decode) then draws from the same seed.
        params = replace(params, seed=secrets.randbits(63))
    return params


def _draw(req: _Common, defaults: Mapping[str, float | int]) -> tuple[float, float, int]:
    """The request's temperature, top_p and top_k; what it leaves out or gives as null (as
    vLLM takes null: the default) from the model's generation config, else `UNSET`."""
    temperature, top_p, top_k = (
        getattr(req, k) if getattr(req, k) is not None else defaults.get(k, UNSET[k])
        for k in ("temperature", "top_p", "top_k")
    )
    try:  # a JSON integer can be too large for any float (10**400): a client error, not a 500
        temperature, top_p = float(temperature), float(top_p)
    except OverflowError:
        raise ApiError(400, "temperature and top_p must be finite numbers") from None
    if not (0 <= temperature and math.isfinite(temperature)):  # as vLLM: no upper bound
        raise ApiError(400, "temperature must be a finite number >= 0", param="temperature")
    return temperature, top_p, int(top_k)


def _shaping(req: _Common) -> dict[str, Any]:
    """The request's logit shaping, as `SamplingParams` fields (what it leaves out: none)."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        value = getattr(req, name)
        if value is not None:
            try:
                out[name] = float(value)
            except OverflowError:
                raise ApiError(400, f"{name} must be a finite number", param=name) from None
    if req.min_tokens is not None:
        out["min_tokens"] = req.min_tokens
    try:
        guide = req.guide()
    except (ValueError, TypeError) as e:  # (a json string that does not parse)
        raise ApiError(400, f"structured_outputs.json: {e}", param="structured_outputs") from None
    if guide is not None:
        out["guide"] = guide
    top = req.top_logprobs_asked()
    if top is not None:
        if not 0 <= top <= MAX_LOGPROBS:
            name = "top_logprobs" if isinstance(req, ChatCompletionRequest) else "logprobs"
            raise ApiError(400, f"{name} must be 0 to {MAX_LOGPROBS}", param=name)
        out["logprobs"] = top
    prompt_top = req.prompt_logprobs_asked()
    if prompt_top is not None:
        if not 0 <= prompt_top <= MAX_LOGPROBS:
            raise ApiError(400, f"prompt_logprobs must be 0 to {MAX_LOGPROBS}", param="prompt_logprobs")
        out["prompt_logprobs"] = prompt_top
    if req.logit_bias:
        bias = []
        for key, value in req.logit_bias.items():
            if not key.isdigit() or len(key) > 9:
                raise ApiError(400, f"logit_bias keys must be token ids, not {key[:32]!r}", param="logit_bias")
            try:
                bias.append((int(key), float(value)))
            except OverflowError:
                raise ApiError(400, "logit_bias values must be in [-100, 100]", param="logit_bias") from None
        out["logit_bias"] = tuple(sorted(bias))
    return out


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


def usage(prompt_len: int, *outs: Outcome) -> dict:
    """OpenAI's usage of a request's choices: the prompt once, the completions summed."""
    n = sum(len(out.token_ids) for out in outs)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": n,
        "total_tokens": prompt_len + n,
        "prompt_tokens_details": {"cached_tokens": outs[0].cached_tokens},
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
