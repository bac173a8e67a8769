"""The text the tiny model's tokenizer is trained on.

The tokenizer must come out byte-identical on every machine and Python version, so the
corpus is generated here from a fixed seed with our own integer PRNG (SplitMix64)
instead of `random` (whose helpers have changed between versions) or stdlib source
files (whose text differs between versions). It mixes the things a serving system sees:
prose-like sentences over a Zipf-distributed pseudo-word lexicon, numbers, code, chat
markup and non-ASCII scripts and emoji, so the merges cover all of them and the
vocabulary fills up to any size `make_tiny` asks for.
"""

from __future__ import annotations

from collections.abc import Iterator

_MASK64 = (1 << 64) - 1

_ONSETS = (
    "b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr kn pl pr qu sc "
    "sh sk sl sm sn sp st str sw th tr tw wh wr"
).split()
_VOWELS = "a e i o u y ai au ea ee ei ie io oa oo ou".split()
_CODAS = "- - - b ck d ff g l ll m n nd ng nt p r rd rn s ss st t th x".split()

_FUNCTION_WORDS = (
    "the of and to a in is it that was for on are as with his they at be this from "
    "have or by one had not but what all were when we there can an your which their "
    "said if do will each about how up out them then she many some so these would "
    "other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very "
    "after words called just where most know"
).split()

_FOREIGN_WORDS = (
    "café naïve résumé façade Zürich São Paulo señor niño Ålesund smørrebrød "
    "straße Grüße déjà vu crème brûlée "
    "Привет мир спасибо данные модель "
    "Γειά σου κόσμε λόγος "
    "日本語 東京 こんにちは ありがとう 世界 "
    "中文 你好 数据 模型 服务器 "
    "한국어 안녕하세요 "
    "مرحبا بالعالم שלום עולם नमस्ते दुनिया "
    "😀 🚀 🎉 👍 🔥 ✨ 🌍 🤖 ❤️ 👩‍💻 🇯🇵 ½ π ∑ → ≤ ≥ ∞ € £ ¥ ©"
).split()

_CODE_LINES = (
    "def forward(self, x):",
    "    return self.proj(x) + x",
    "for i in range(n):",
    "    total += values[i] * 2",
    "if (ptr != NULL) { free(ptr); }",
    "import torch.nn.functional as F",
    "x = torch.zeros(4, 8, dtype=torch.float32)",
    '{"role": "user", "content": "hello"}',
    "SELECT id, name FROM users WHERE age > 30;",
    'fn main() { println!("{}", 42); }',
    '<div class="box"><span>ok</span></div>',
    "$ curl -s http://localhost:8000/v1/models | jq .",
)

_CHAT_ROLES = ("system", "user", "assistant")


class SplitMix64:
    """A tiny integer PRNG whose output is fixed by its specification, not by Python."""

    def __init__(self, seed: int) -> None:
        self._state = seed & _MASK64

    def next_u64(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """Uniform integer in [0, n); the tiny modulo bias is irrelevant for text."""
        return self.next_u64() % n

    def pick(self, items: tuple[str, ...] | list[str]) -> str:
        return items[self.below(len(items))]

    def zipf_index(self, n: int) -> int:
        """An index in [0, n) skewed towards 0, so some words are common and most rare."""
        u = (self.next_u64() >> 11) / float(1 << 53)
        return min(n - 1, int(n**u) - 1)


def _lexicon(rng: SplitMix64, size: int) -> list[str]:
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < size:
        syllables = 1 + rng.below(3)
        word = "".join(rng.pick(_ONSETS) + rng.pick(_VOWELS) + rng.pick(_CODAS).strip("-") for _ in range(syllables))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def _sentence(rng: SplitMix64, lexicon: list[str]) -> str:
    words: list[str] = []
    for _ in range(4 + rng.below(14)):
        roll = rng.below(100)
        if roll < 40:
            words.append(rng.pick(_FUNCTION_WORDS))
        elif roll < 90:
            words.append(lexicon[rng.zipf_index(len(lexicon))])
        elif roll < 95:
            words.append(str(rng.below(10 ** (1 + rng.below(5)))))
        else:
            words.append(rng.pick(_FOREIGN_WORDS))
    words[0] = words[0].capitalize()
    if rng.below(5) == 0:
        words[rng.below(len(words))] += ","
    return " ".join(words) + rng.pick((".", ".", ".", "?", "!", ":"))


def _paragraph(rng: SplitMix64, lexicon: list[str]) -> str:
    kind = rng.below(10)
    if kind == 0:
        return "\n".join(rng.pick(_CODE_LINES) for _ in range(2 + rng.below(4)))
    if kind == 1:
        turns = (
            f"<|im_start|>{rng.pick(_CHAT_ROLES)}\n{_sentence(rng, lexicon)}<|im_end|>" for _ in range(1 + rng.below(3))
        )
        return "\n".join(turns)
    return " ".join(_sentence(rng, lexicon) for _ in range(1 + rng.below(6)))


def corpus(seed: int = 0x5EED, paragraphs: int = 6000, lexicon_size: int = 12000) -> Iterator[str]:
    """Yield the training paragraphs; the same arguments always yield the same text."""
    rng = SplitMix64(seed)
    lexicon = _lexicon(rng, lexicon_size)
    for _ in range(paragraphs):
        yield _paragraph(rng, lexicon)
