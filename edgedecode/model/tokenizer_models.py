"""The model part of a tokenizer: how a GGUF vocabulary becomes a HuggingFace `tokenizers` model.

Two kinds, chosen by `tokenizer.ggml.model`, both matching llama.cpp's ids:
- "gpt2": byte-level BPE from `tokenizer.ggml.merges`, split first by the regexes of `tokenizer.ggml.pre`;
- "llama": SentencePiece (llama.cpp's SPM tokenizer): spaces become "▁", then the adjacent pair whose
  concatenation is the highest-scoring vocabulary entry merges first; characters outside the vocabulary
  fall back to `<0xXX>` byte tokens. `tokenizers` runs this as a BPE whose merges are every split of
  every entry into two entries, ranked by the entry's score.
Special-token splitting, BOS and decoding live in `Tokenizer`, the same for both kinds.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass

from gguf import GGUFReader
from tokenizers import Regex, models, normalizers, pre_tokenizers

from edgedecode.errors import EdgeDecodeError
from edgedecode.model.gguf_file import field_array, field_value

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPM_SPACE = "\u2581"  # "▁", SentencePiece's stand-in for a space
SPM_MODEL = "llama"  # tokenizer.ggml.model of SentencePiece vocabularies (Llama 2, Gemma)

# The pre-tokenizer regexes of llama.cpp's llm_tokenizer_bpe, per tokenizer.ggml.pre, applied in turn.
# llama.cpp's "default" is not plain GPT-2 (it adds punctuation and 3-digit splits), so it is absent.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS_ANY_CASE = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS_ANY_CASE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS_ANY_CASE + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "gpt-2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "llama-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
}


# SentencePiece BPE models by vocabulary digest: one per distinct vocabulary a process loads (a handful).
_SPM_BPE_CACHE: dict[str, models.BPE] = {}


class TokenizerError(EdgeDecodeError):
    """The tokenizer or chat template in the model file is unsupported or failed."""


@dataclass(frozen=True)
class Vocabulary:
    """A GGUF's tokenizer.ggml.* arrays, index = token id."""

    tokens: list[str]
    types: list[int]
    scores: list[float]  # SentencePiece merge priorities; zeros when the file has none
    merges: list[str]  # BPE merges, "left right"; empty for SentencePiece

    @classmethod
    def from_gguf(cls, reader: GGUFReader) -> Vocabulary:
        """Read the vocabulary arrays; missing types mean all NORMAL, missing scores all zero."""
        tokens = field_value(reader, "tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("GGUF metadata lacks tokenizer.ggml.tokens")
        types = field_array(reader, "tokenizer.ggml.token_type")
        scores = field_array(reader, "tokenizer.ggml.scores")
        return cls(
            tokens,
            [NORMAL] * len(tokens) if types is None else types.tolist(),
            [0.0] * len(tokens) if scores is None else scores.tolist(),
            field_value(reader, "tokenizer.ggml.merges") or [],
        )

    def ids(self) -> dict[str, int]:
        """Text -> id; with duplicate texts the last id wins, as in llama.cpp."""
        return {text: i for i, text in enumerate(self.tokens)}


class VocabModel(ABC):
    """The pluggable part of a Tokenizer: the `tokenizers` model and what runs before it."""

    @abstractmethod
    def hf_model(self, vocab: Vocabulary) -> models.Model:
        """The `tokenizers` model over `vocab`."""

    @abstractmethod
    def normalizer(self) -> normalizers.Normalizer | None:
        """What rewrites each stretch of plain text before the model sees it."""

    @abstractmethod
    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer | None:
        """What splits a normalized stretch into words before the model sees it."""

    @abstractmethod
    def normal_bytes(self, text: str) -> bytes:
        """The raw bytes a NORMAL token with vocabulary text `text` stands for."""


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's map from the printable unicode stand-ins back to raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class ByteLevelBpe(VocabModel):
    """GPT-2 byte-level BPE (tokenizer.ggml.model "gpt2") with the regexes of one tokenizer.ggml.pre."""

    def __init__(self, pre: str) -> None:
        self._regexes = PRE_TOKENIZER_REGEXES[pre]
        self._byte_of = _gpt2_byte_decoder()

    def hf_model(self, vocab: Vocabulary) -> models.BPE:
        pairs = []
        for merge in vocab.merges:
            cut = merge.find(" ", 1)  # llama.cpp splits at the first space after the first character
            if cut < 0:
                raise TokenizerError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
            pairs.append((merge[:cut], merge[cut + 1 :]))
        try:
            return models.BPE(vocab.ids(), pairs)
        except Exception as exc:
            raise TokenizerError(f"cannot build the BPE model from the GGUF vocabulary: {exc}") from exc

    def normalizer(self) -> None:
        return None

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in self._regexes]
        return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    def normal_bytes(self, text: str) -> bytes:
        return b"".join(bytes([self._byte_of[c]]) if c in self._byte_of else c.encode() for c in text)


class SentencePiece(VocabModel):
    """llama.cpp's SPM tokenizer (tokenizer.ggml.model "llama"): score-ranked merges with byte fallback."""

    def __init__(self, add_space_prefix: bool) -> None:
        self._add_space_prefix = add_space_prefix

    def hf_model(self, vocab: Vocabulary) -> models.BPE:
        digest = hashlib.sha256("\0".join(vocab.tokens).encode())
        digest.update(array("d", vocab.scores).tobytes())
        key = digest.hexdigest()
        if key not in _SPM_BPE_CACHE:
            _SPM_BPE_CACHE[key] = _spm_bpe(vocab)
        return _SPM_BPE_CACHE[key]

    def normalizer(self) -> normalizers.Normalizer:
        escape = normalizers.Replace(" ", SPM_SPACE)
        if not self._add_space_prefix:
            return escape
        # llama.cpp prefixes every stretch between special tokens, as tokenizers normalizes each one
        return normalizers.Sequence([normalizers.Prepend(SPM_SPACE), escape])

    def pre_tokenizer(self) -> None:
        return None  # llama.cpp merges over the whole stretch

    def normal_bytes(self, text: str) -> bytes:
        return text.replace(SPM_SPACE, " ").encode()


def _spm_bpe(vocab: Vocabulary) -> models.BPE:
    """The BPE equivalent of SentencePiece over `vocab`.

    llama.cpp merges the adjacent pair whose concatenation has the highest score; a BPE whose merges are
    all (left, right) splits of each entry, ranked by the entry's score, makes the same choices. Where
    they can differ: two different entries with equal scores (llama.cpp takes the leftmost pair, this
    the lower id), and a character outside the vocabulary joining a neighbour into an entry (here it
    has already become byte tokens). Neither occurs in llama.cpp's Gemma 3 vectors.
    """
    ids = vocab.ids()
    by_score = sorted(range(len(vocab.tokens)), key=lambda i: (-vocab.scores[i], i))  # ties: lower id first
    merges = [
        (text[:cut], text[cut:])
        for text in (vocab.tokens[i] for i in by_score)
        for cut in range(1, len(text))
        if text[:cut] in ids and text[cut:] in ids
    ]
    return models.BPE(ids, merges, byte_fallback=True)


def vocab_model(model: str, pre: str, add_space_prefix: bool) -> VocabModel:
    """The model part for GGUF's tokenizer.ggml.model and tokenizer.ggml.pre.

    Raises:
        TokenizerError: a tokenizer model or (for "gpt2") a pre-tokenizer that is not supported, named.
    """
    if model == SPM_MODEL:  # llama.cpp ignores tokenizer.ggml.pre for SentencePiece
        return SentencePiece(add_space_prefix)
    if model == "gpt2" and pre in PRE_TOKENIZER_REGEXES:
        return ByteLevelBpe(pre)
    raise TokenizerError(
        f"unsupported tokenizer (tokenizer.ggml.model={model!r}, tokenizer.ggml.pre={pre!r}); supported: "
        f"model llama (SentencePiece), or model gpt2 with pre-tokenizer {', '.join(PRE_TOKENIZER_REGEXES)}"
    )
