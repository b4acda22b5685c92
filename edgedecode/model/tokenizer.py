"""Byte-level BPE tokenization built from the GGUF vocabulary, matching llama.cpp's token ids.

Encoding runs through HuggingFace `tokenizers`; decoding maps each token to its bytes (GPT-2
byte-level alphabet) so that streamed output can hold back incomplete UTF-8 sequences.
Chat templates render with jinja2 exactly as HF transformers does; control tokens in a chat prompt
come only from the template's own text, never from the messages (see `Tokenizer.encode_chat`).
"""

from __future__ import annotations

import codecs
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property

from gguf import GGUFReader
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from edgedecode.errors import EdgeDecodeError
from edgedecode.model.gguf_file import field_array, field_value
from edgedecode.model.spec import ModelSpec

SUPPORTED_MODELS = ("gpt2",)
# llama.cpp's "default" pre-tokenizer is NOT plain GPT-2 (it adds punctuation and 3-digit splits),
# so it is deliberately absent: only the ones verified against llama.cpp are listed.
SUPPORTED_PRE = ("smollm", "gpt-2")
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4
# Private-use characters around a placeholder for a control-token literal hidden in a message.
_MASK_OPEN, _MASK_CLOSE = "\ue000", "\ue001"


class TokenizerError(EdgeDecodeError):
    """The tokenizer or chat template in the model file is unsupported or failed."""


def _byte_decoder() -> dict[str, int]:
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


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # llama.cpp: "\p{N}" isolated, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level  # "gpt-2"


class Tokenizer:
    """llama.cpp-compatible tokenizer and chat-template renderer for one model."""

    def __init__(self, spec: ModelSpec, tokens: list[str], types: Sequence[int], merges: list[str]) -> None:
        if spec.tokenizer_model not in SUPPORTED_MODELS or spec.tokenizer_pre not in SUPPORTED_PRE:
            raise TokenizerError(
                f"unsupported tokenizer (tokenizer.ggml.model={spec.tokenizer_model!r}, "
                f"tokenizer.ggml.pre={spec.tokenizer_pre!r}); supported: model {', '.join(SUPPORTED_MODELS)} "
                f"with pre-tokenizer {', '.join(SUPPORTED_PRE)}"
            )
        self.spec = spec
        self.vocab_size = len(tokens)
        self._tokens = tokens
        vocab = {text: i for i, text in enumerate(tokens)}  # duplicates: last id wins, as in llama.cpp
        pairs = []
        for merge in merges:
            cut = merge.find(" ", 1)  # llama.cpp splits at the first space after the first character
            if cut < 0:
                raise TokenizerError(f"malformed merge {merge!r} in tokenizer.ggml.merges")
            pairs.append((merge[:cut], merge[cut + 1 :]))
        try:
            bpe = models.BPE(vocab, pairs)
        except Exception as exc:
            raise TokenizerError(f"cannot build the BPE model from the GGUF vocabulary: {exc}") from exc
        control = [tokens[i] for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)]
        user = [tokens[i] for i, t in enumerate(types) if t == _USER_DEFINED]
        # llama.cpp splits control tokens out only with parse_special, user-defined ones always.
        self._hf_special = self._make_hf(bpe, control, user)
        self._hf_plain = self._make_hf(bpe, [], user)
        self._control_ids = {text: vocab[text] for text in control if text}
        # Longest first, so that the leftmost match is also the longest, as in HF's added-token split;
        # "(?!)" never matches (a vocabulary without control tokens).
        alternatives = "|".join(re.escape(t) for t in sorted(self._control_ids, key=len, reverse=True))
        self._control_re = re.compile(f"({alternatives or '(?!)'})")
        byte_of = _byte_decoder()
        self._special_ids = frozenset(i for i, t in enumerate(types) if t != _NORMAL and t != _USER_DEFINED)
        self._bytes = [
            text.encode()
            if t != _NORMAL
            else b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode() for c in text)
            for text, t in zip(tokens, types)
        ]

    def _make_hf(self, bpe: models.BPE, special: list[str], user: list[str]) -> HFTokenizer:
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = _pre_tokenizer(self.spec.tokenizer_pre)
        hf.decoder = decoders.ByteLevel()
        hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        return hf

    @classmethod
    def from_gguf(cls, reader: GGUFReader, spec: ModelSpec) -> Tokenizer:
        """Build the tokenizer from the GGUF's tokenizer.ggml.* fields; unsupported kinds raise TokenizerError."""
        tokens = field_value(reader, "tokenizer.ggml.tokens")
        if not tokens:
            raise TokenizerError("GGUF metadata lacks tokenizer.ggml.tokens")
        type_array = field_array(reader, "tokenizer.ggml.token_type")
        types: list[int] = [_NORMAL] * len(tokens) if type_array is None else type_array.tolist()
        merges = field_value(reader, "tokenizer.ggml.merges") or []
        return cls(spec, tokens, types, merges)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one id (byte-level form for normal tokens)."""
        return self._tokens[token_id]

    def encode(self, text: str, *, parse_special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; parse_special=False tokenizes control-token strings as plain text."""
        hf = self._hf_special if parse_special else self._hf_plain
        ids = hf.encode(text, add_special_tokens=False).ids if text else []
        return self._bos(add_bos) + ids

    def _bos(self, add_bos: bool | None) -> list[int]:
        """[BOS] if `add_bos` (None: the model's add_bos flag) asks for it, else []."""
        if not (self.spec.add_bos if add_bos is None else add_bos):
            return []
        if self.spec.bos_token_id is None:
            raise TokenizerError("add_bos requested but the model has no BOS token")
        return [self.spec.bos_token_id]

    def token_bytes(self, token_id: int, *, skip_special: bool = True) -> bytes:
        """The raw bytes one token stands for (empty for special tokens when skipped)."""
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        if skip_special and token_id in self._special_ids:
            return b""
        return self._bytes[token_id]

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multibyte character) becomes U+FFFD."""
        data = b"".join(self.token_bytes(int(i), skip_special=skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    @cached_property
    def _template(self):
        if not self.spec.chat_template:
            raise TokenizerError(f"model {self.spec.name!r} has no chat template (tokenizer.chat_template)")

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template error: {message}")

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.spec.chat_template)
        except TemplateError as exc:
            raise TokenizerError(f"cannot compile the chat template: {exc}") from exc

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._tokens[token_id]

    def render_chat(self, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True) -> str:
        """Render `messages` with the model's chat template, the way HF transformers does."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._special_text(self.spec.bos_token_id),
                eos_token=self._special_text(self.spec.eos_token_id),
            )
        except TemplateError as exc:
            raise TokenizerError(f"chat template failed to render: {exc}") from exc

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool = True,
        special_in_content: bool = False,
    ) -> list[int]:
        """Render `messages` with the chat template and encode the prompt; no second BOS if the template emits it.

        Control tokens come only from the template's own text: a message string (content, role, ...)
        that spells one is tokenized as plain text, exactly as `encode(..., parse_special=False)` does,
        so a client cannot forge turns. Each such literal is swapped for a per-call placeholder before
        rendering (so templates that transform content, e.g. `| trim`, still work) and put back as plain
        text afterwards. Prompts without such literals get the same ids as rendering then
        `encode(parse_special=True)`. `special_in_content=True` (opt-in, the servers'
        `allow_special_tokens`) parses control tokens in the messages too.
        """
        if special_in_content:
            text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
            ids = self.encode(text, parse_special=True, add_bos=False)
        else:
            tag = f"{_MASK_OPEN}{secrets.randbits(64)}:"  # user text cannot guess the random part
            masked = [{key: self._mask_controls(value, tag) for key, value in m.items()} for m in messages]
            text = self.render_chat(masked, add_generation_prompt=add_generation_prompt)
            ids = self._encode_masked(text, tag)
        bos = self._special_text(self.spec.bos_token_id)
        return self._bos(False if bos and text.startswith(bos) else None) + ids

    def _mask_controls(self, value: object, tag: str) -> object:
        """`value` with each control-token literal in its strings (nested in lists and dicts too) replaced
        by the placeholder `tag` + its token id + _MASK_CLOSE."""
        if isinstance(value, str):
            return self._control_re.sub(lambda m: f"{tag}{self._control_ids[m[1]]}{_MASK_CLOSE}", value)
        if isinstance(value, list):
            return [self._mask_controls(v, tag) for v in value]
        if isinstance(value, Mapping):
            return {k: self._mask_controls(v, tag) for k, v in value.items()}
        return value

    def _encode_masked(self, text: str, tag: str) -> list[int]:
        """Ids of rendered `text`: its control-token literals (the template's) become control ids, every
        other stretch is tokenized as plain text once the placeholders `tag` made are put back."""
        placeholder = re.compile(re.escape(tag) + f"([0-9]+){_MASK_CLOSE}")
        ids: list[int] = []
        # With its capturing group, split alternates plain stretches (even indices) and control literals.
        for i, part in enumerate(self._control_re.split(text)):
            if i % 2:
                ids.append(self._control_ids[part])
            elif part:
                plain = placeholder.sub(lambda m: self._tokens[int(m[1])], part)
                ids.extend(self._hf_plain.encode(plain, add_special_tokens=False).ids)
        return ids

    def stream_decoder(self) -> StreamDecoder:
        """A decoder that turns tokens fed one at a time into text, never splitting a character."""
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenizer: holds back incomplete UTF-8 sequences, skips special tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        return self._utf8.decode(self._tokenizer.token_bytes(int(token_id)))

    def flush(self) -> str:
        """Return whatever is held back (an incomplete sequence becomes U+FFFD) and reset."""
        return self._utf8.decode(b"", final=True)
