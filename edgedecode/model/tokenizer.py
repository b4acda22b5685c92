"""Tokenization built from the GGUF vocabulary, matching llama.cpp's token ids.

Encoding runs through HuggingFace `tokenizers` with a model part chosen by tokenizer.ggml.model
(GPT-2 byte-level BPE or SentencePiece, see tokenizer_models); special-token splitting, BOS, chat
prompts and decoding are the same for both. Decoding maps each token to its bytes so that streamed
output can hold back incomplete UTF-8 sequences. Control tokens in a chat prompt come only from the
template's own text, never from the messages (see `Tokenizer.encode_chat`).
"""

from __future__ import annotations

import codecs
import re
import secrets
from collections.abc import Mapping, Sequence
from functools import cached_property, lru_cache

from gguf import GGUFReader
from jinja2 import Template, TemplateError
from tokenizers import AddedToken, models
from tokenizers import Tokenizer as HFTokenizer

from edgedecode.model.chat_template import builtin_template, compile_template
from edgedecode.model.spec import ModelSpec, TokenizerSpec
from edgedecode.model.tokenizer_models import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    TokenizerError,
    VocabModel,
    Vocabulary,
    vocab_model,
)

__all__ = ["StreamDecoder", "Tokenizer", "TokenizerError", "Vocabulary"]

# Private-use characters around a placeholder for a control-token literal hidden in a message.
_MASK_OPEN, _MASK_CLOSE = "\ue000", "\ue001"


class Tokenizer:
    """llama.cpp-compatible tokenizer and chat-template renderer for one model."""

    def __init__(self, spec: ModelSpec | TokenizerSpec, vocab: Vocabulary) -> None:
        model = vocab_model(spec.tokenizer_model, spec.tokenizer_pre, spec.add_space_prefix)
        self.spec = spec
        self.vocab_size = len(vocab.tokens)
        self._tokens = vocab.tokens
        ids = vocab.ids()
        hf_model = model.hf_model(vocab)
        control = [text for text, t in zip(vocab.tokens, vocab.types) if t in (CONTROL, UNKNOWN)]
        user = [text for text, t in zip(vocab.tokens, vocab.types) if t == USER_DEFINED]
        # llama.cpp splits control tokens out only with parse_special, user-defined ones always.
        self._hf_special = self._make_hf(hf_model, model, control, user)
        self._hf_plain = self._make_hf(hf_model, model, [], user)
        self._control_ids = {text: ids[text] for text in control if text}
        self._special_ids = frozenset(i for i, t in enumerate(vocab.types) if t not in (NORMAL, USER_DEFINED, BYTE))
        self._bytes = [_token_bytes(model, text, t) for text, t in zip(vocab.tokens, vocab.types)]

    @staticmethod
    def _make_hf(hf_model: models.Model, model: VocabModel, special: list[str], user: list[str]) -> HFTokenizer:
        hf = HFTokenizer(hf_model)
        if (normalizer := model.normalizer()) is not None:
            hf.normalizer = normalizer
        if (pre_tokenizer := model.pre_tokenizer()) is not None:
            hf.pre_tokenizer = pre_tokenizer
        hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        return hf

    @classmethod
    def from_gguf(cls, reader: GGUFReader, spec: ModelSpec | TokenizerSpec) -> Tokenizer:
        """Build the tokenizer from the GGUF's tokenizer.ggml.* fields; unsupported kinds raise TokenizerError."""
        return cls(spec, Vocabulary.from_gguf(reader))

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

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of the special tokens (control, unknown, unused): those ``token_bytes`` skips."""
        return self._special_ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 (e.g. a cut multibyte character) becomes U+FFFD."""
        data = b"".join(self.token_bytes(int(i), skip_special=skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    @cached_property
    def chat_template(self) -> str:
        """The source of the model's chat template, else the built-in one of its family (by its control tokens)."""
        source = self.spec.chat_template or builtin_template(self._control_ids)
        if not source:
            raise TokenizerError(f"model {self.spec.name!r} has no chat template (tokenizer.chat_template)")
        return source

    @cached_property
    def _template(self) -> Template:
        return compile_template(self.chat_template)

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self._tokens[token_id]

    def render_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> str:
        """Render `messages` with the model's chat template, the way HF transformers does (``tools``: the
        OpenAI tool objects, for a template that renders them)."""
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
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
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> list[int]:
        """Render `messages` with the chat template and encode the prompt; no second BOS if the template emits it.

        Control tokens come only from the template's own text: a message string (content, role, ...)
        that spells one is tokenized as plain text, exactly as `encode(..., parse_special=False)` does,
        so a client cannot forge turns. Each such literal is swapped for a per-call placeholder before
        rendering (so templates that transform content, e.g. `| trim`, still work) and put back as plain
        text afterwards. Prompts without such literals get the same ids as rendering then
        `encode(parse_special=True)`. `special_in_content=True` (opt-in, the servers'
        `allow_special_tokens`) parses control tokens in the messages too. ``tools`` go to the template
        (masked like the messages).
        """
        if special_in_content:
            text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)
            ids = self.encode(text, parse_special=True, add_bos=False)
        else:
            tag = f"{_MASK_OPEN}{secrets.randbits(64)}:"  # user text cannot guess the random part
            masked = [{key: self._mask_controls(value, tag) for key, value in m.items()} for m in messages]
            masked_tools = None if tools is None else [self._mask_controls(t, tag) for t in tools]
            text = self.render_chat(masked, add_generation_prompt=add_generation_prompt, tools=masked_tools)  # type: ignore[arg-type]
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

    @cached_property
    def _control_re(self) -> re.Pattern[str]:
        """Matches the control-token literals, leftmost then longest (HF's added-token split); compiled on
        first use, since only chat prompts need it."""
        return _literals_regex(frozenset(self._control_ids))

    def stream_decoder(self) -> StreamDecoder:
        """A decoder that turns tokens fed one at a time into text, never splitting a character."""
        return StreamDecoder(self)


@lru_cache(maxsize=4)
def _literals_regex(literals: frozenset[str]) -> re.Pattern[str]:
    """A regex with one group that matches any of `literals`, the longest at the leftmost position.

    Written as a trie, so that a match attempt costs a literal's length rather than the number of
    literals (Gemma has 6,000 control tokens); "(?!)" never matches (no literals). Cached per process:
    compiling thousands of literals takes about a second.
    """
    trie: dict = {}
    for literal in literals:
        node = trie
        for char in literal:
            node = node.setdefault(char, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer literal is tried first

    return re.compile(f"({pattern(trie) or '(?!)'})")


def _token_bytes(model: VocabModel, text: str, token_type: int) -> bytes:
    """The bytes a token stands for, as llama.cpp's token_to_piece gives them (special ones unskipped)."""
    if token_type == NORMAL:
        return model.normal_bytes(text)
    if token_type == BYTE:  # "<0xXX>"
        return bytes([int(text[3:5], 16)])
    return text.encode()


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

    @property
    def held(self) -> int:
        """Bytes held back: the start of a character the tokens fed so far have not completed."""
        return len(self._utf8.getstate()[0])
