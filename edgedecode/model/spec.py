"""The model's architecture and special tokens, read from GGUF metadata (never hard-coded)."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import numpy as np
from gguf import GGUFReader

from edgedecode.model.gguf_file import (
    ModelFileError,
    field_array,
    field_value,
    tensor_table,
)
from edgedecode.model.tokenizer_models import SPM_MODEL


@dataclass(frozen=True)
class ArchitectureTraits:
    """How one GGUF architecture's decoder block differs from plain llama (the one block builder reads these)."""

    qk_rows_permuted: bool = False  # llama.cpp's "norm" RoPE type: Q/K rows interleaved in the file (undone on load)
    qkv_bias: bool = False  # blk.N.attn_{q,k,v}.bias added after the projections
    qk_norm: bool = False  # per-head RMSNorm of queries and keys (attn_{q,k}_norm), before RoPE
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual add
    activation: str = "silu"  # the gate's activation: "silu" or "gelu_tanh"
    embedding_scale: bool = False  # embeddings multiplied by sqrt(hidden)
    sliding_window_pattern: int = 0  # every Nth layer global, the others windowed (llama.cpp's default); 0: none
    rope_local_theta: float | None = None  # RoPE base of the windowed layers (the file's freq_base is the global one)
    float16_residual: bool = True  # False: the residual stream outgrows float16 (float16 graphs keep it in float32)


# What each architecture maps to; llama.cpp's hparams and graph builders are the reference for each.
ARCHITECTURES: dict[str, ArchitectureTraits] = {
    "llama": ArchitectureTraits(qk_rows_permuted=True),
    "qwen2": ArchitectureTraits(qkv_bias=True),
    "qwen3": ArchitectureTraits(qk_norm=True),
    "gemma3": ArchitectureTraits(
        qk_norm=True,
        post_norms=True,
        activation="gelu_tanh",
        embedding_scale=True,
        sliding_window_pattern=6,
        rope_local_theta=10000.0,
        float16_residual=False,  # 270M's passes 65504 at layer 8 (measured on the prose prompt)
    ),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# Metadata that changes the forward pass in ways the graphs do not implement: refused, never ignored.
_REFUSED_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")
# Token texts that end a turn in the chat templates we know; tokens present in the vocab as
# control tokens join eos as stop tokens (llama.cpp's end-of-generation set does the same).
_END_OF_TURN_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_CONTROL_TOKEN_TYPE = 3


@dataclass(frozen=True)
class KVLayout:
    """How the KV cache of one layer is laid out; a producer and a consumer must agree on all of it."""

    axes: str = "kv_heads,seq,head_dim"  # per layer; batch is 1 on the wire
    keys_post_rope: bool = True
    rope_order: str = "rotate_half"  # HF order, i.e. GGUF's interleaved Q/K rows un-permuted

    def describe(self) -> str:
        """Human-readable one-liner, used in errors and `edgedecode info`."""
        rope = "post-RoPE" if self.keys_post_rope else "pre-RoPE"
        return f"[{self.axes}] keys {rope}, {self.rope_order} order"


DECODER_KV_LAYOUT = KVLayout()


@dataclass(frozen=True)
class KVContract:
    """What KV produced by one graph must share with the graph that consumes it.

    The weights and their precision are deliberately absent: KV from a higher-precision prefill of
    the same architecture and tokenizer is a valid (cross-quant) handoff.
    """

    architecture: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    layout: KVLayout
    tokenizer_hash: str
    # Windowed (local) layers and their RoPE base; keys are post-RoPE, so the bases and the frequency
    # factors of the producer must be the receiver's.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    rope_scaling: str = "none"  # "llama3:<digest of the frequency factors>" where the file has rope_freqs

    def mismatches(self, other: KVContract) -> list[str]:
        """Names and values of every field that differs, e.g. ["n_layers: 30 != 24"]."""
        return [
            f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in self.__dataclass_fields__
            if getattr(self, name) != getattr(other, name)
        ]


@dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer half of a model's metadata: enough to tokenize and render chats without the weights.

    Its field names are ModelSpec's own, so either one configures a Tokenizer.
    """

    name: str
    bos_token_id: int | None
    eos_token_id: int
    add_bos: bool
    add_space_prefix: bool  # SentencePiece: "▁" before each stretch of text (llama.cpp's default: yes)
    stop_token_ids: tuple[int, ...]
    chat_template: str | None
    tokenizer_model: str
    tokenizer_pre: str
    tokenizer_hash: str

    @classmethod
    def from_gguf(cls, reader: GGUFReader, name: str) -> TokenizerSpec:
        """Read the tokenizer.* metadata; a missing vocabulary, EOS or tokenizer model is a ModelFileError."""

        def need(key: str):
            value = field_value(reader, key)
            if value is None:
                raise ModelFileError(f"GGUF metadata lacks {key!r}")
            return value

        tokens = need("tokenizer.ggml.tokens")
        token_types = field_array(reader, "tokenizer.ggml.token_type")
        model = str(need("tokenizer.ggml.model"))
        eos = int(need("tokenizer.ggml.eos_token_id"))
        stops = {eos}
        for i, text in enumerate(tokens):
            if text in _END_OF_TURN_TEXTS and (token_types is None or token_types[i] == _CONTROL_TOKEN_TYPE):
                stops.add(i)
        bos = field_value(reader, "tokenizer.ggml.bos_token_id")
        add_bos = field_value(reader, "tokenizer.ggml.add_bos_token")
        add_space_prefix = field_value(reader, "tokenizer.ggml.add_space_prefix")
        space_prefix = bool(model == SPM_MODEL if add_space_prefix is None else add_space_prefix)
        return cls(
            name=name,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=eos,
            add_bos=bool(True if add_bos is None else add_bos),
            add_space_prefix=space_prefix,
            stop_token_ids=tuple(sorted(stops)),
            chat_template=field_value(reader, "tokenizer.chat_template"),
            tokenizer_model=model,
            tokenizer_pre=str(field_value(reader, "tokenizer.ggml.pre") or "default"),
            tokenizer_hash=_tokenizer_hash(reader, tokens, model, space_prefix),
        )


def _tokenizer_hash(reader: GGUFReader, tokens: list[str], model: str, add_space_prefix: bool) -> str:
    """SHA-256 of what decides the token ids: the token texts and merges, and for SentencePiece also the
    scores (they rank its merges), token types and space prefix. GPT-2 BPE vocabularies keep the hash
    they always had, so KV and graphs stored under it stay valid."""
    digest = hashlib.sha256()
    for text in tokens:
        digest.update(text.encode() + b"\0")
    for merge in field_value(reader, "tokenizer.ggml.merges") or []:
        digest.update(merge.encode() + b"\0")
    if model == SPM_MODEL:
        for key, dtype in (("tokenizer.ggml.scores", "<f4"), ("tokenizer.ggml.token_type", "<i4")):
            values = field_array(reader, key)
            digest.update(key.encode() + (b"-" if values is None else values.astype(dtype).tobytes()))
        digest.update(b"add_space_prefix=%d" % add_space_prefix)
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a model that graph building, tokenization and the KV contract need."""

    name: str
    architecture: str
    n_layers: int
    hidden_size: int
    ffn_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_dim: int
    norm_eps: float
    vocab_size: int
    context_length: int
    bos_token_id: int | None
    eos_token_id: int
    add_bos: bool
    add_space_prefix: bool
    stop_token_ids: tuple[int, ...]
    chat_template: str | None
    tokenizer_model: str
    tokenizer_pre: str
    tokenizer_hash: str
    tied_embeddings: bool
    kv_layout: KVLayout = field(default=DECODER_KV_LAYOUT)
    traits: ArchitectureTraits = field(default=ARCHITECTURES["llama"])
    sliding_window: int | None = None  # keys a windowed layer's query sees, itself included
    sliding_layers: tuple[int, ...] = ()  # the windowed layers
    rope_local_theta: float | None = None  # RoPE base of the windowed layers
    rope_freq_factors: tuple[float, ...] | None = None  # llama3 scaling: per-frequency divisors [head_dim / 2]

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ModelFileError(f"head_count {self.n_heads} is not a multiple of head_count_kv {self.n_kv_heads}")
        if self.rope_dim != self.head_dim:
            raise ModelFileError(
                f"partial rotary (rope dim {self.rope_dim} < head_dim {self.head_dim}) is not supported"
            )
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ModelFileError(
                f"rope_freqs has {len(self.rope_freq_factors)} factors, expected head_dim/2 = {self.head_dim // 2}"
            )

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends to a sliding window of recent keys rather than to all of them."""
        return layer in self.sliding_layers

    def rope_theta_of(self, layer: int) -> float:
        """The RoPE base ``layer`` rotates its queries and keys with."""
        if self.is_sliding(layer) and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    def rope_inv_freq(self, layer: int) -> np.ndarray:
        """float64 [head_dim / 2]: the rotation frequencies of ``layer`` (llama3 factors divide them)."""
        inv_freq = self.rope_theta_of(layer) ** (-np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)
        if self.rope_freq_factors is not None:
            inv_freq = inv_freq / np.asarray(self.rope_freq_factors, np.float64)
        return inv_freq

    @property
    def attention_scale(self) -> float:
        """The factor on q·k: 1/sqrt(head_dim) (Gemma 3's query_pre_attn_scalar is head_dim up to 12B)."""
        return float(1.0 / np.sqrt(self.head_dim))

    @property
    def kv_contract(self) -> KVContract:
        """The contract any KV injected into this model's graphs must satisfy."""
        return KVContract(
            self.architecture,
            self.n_layers,
            self.n_kv_heads,
            self.head_dim,
            self.rope_theta,
            self.kv_layout,
            self.tokenizer_hash,
            self.sliding_window,
            self.sliding_layers,
            self.rope_local_theta,
            _rope_scaling_name(self.rope_freq_factors),
        )

    @property
    def kv_bytes_per_token_fp16(self) -> int:
        """FP16 bytes of K and V for one token over all layers."""
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * 2

    @classmethod
    def from_gguf(cls, reader: GGUFReader, name: str) -> ModelSpec:
        """Read the spec from GGUF metadata; a missing key or an unsupported model is a ModelFileError."""
        arch = field_value(reader, "general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelFileError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        traits = ARCHITECTURES[arch]
        for key in _REFUSED_KEYS:
            if field_value(reader, f"{arch}.{key}") is not None:
                raise ModelFileError(f"{arch}.{key} is set: logit soft-capping is not supported")

        def need(key: str):
            value = field_value(reader, f"{arch}.{key}")
            if value is None:
                raise ModelFileError(f"GGUF metadata lacks {key!r}")
            return value

        tensors = tensor_table(reader)
        scaling = field_value(reader, f"{arch}.rope.scaling.type")
        if scaling not in (None, "none", "llama3"):
            raise ModelFileError(
                f"{arch}.rope.scaling.type {scaling!r} is not supported (llama3 frequency factors are)"
            )
        factors = tensors.get("rope_freqs.weight")
        if scaling == "llama3" and factors is None:
            raise ModelFileError(f"{arch}.rope.scaling.type is 'llama3' but the file has no rope_freqs.weight tensor")
        n_layers = int(need("block_count"))
        window = field_value(reader, f"{arch}.attention.sliding_window") if traits.sliding_window_pattern else None
        hidden = int(need("embedding_length"))
        n_heads = int(need("attention.head_count"))
        head_dim = int(field_value(reader, f"{arch}.attention.key_length") or hidden // n_heads)
        tokenizer = TokenizerSpec.from_gguf(reader, name)
        n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data)
        return cls(
            architecture=arch,
            n_layers=n_layers,
            hidden_size=hidden,
            ffn_size=int(need("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(field_value(reader, f"{arch}.attention.head_count_kv") or n_heads),
            head_dim=head_dim,
            rope_theta=float(field_value(reader, f"{arch}.rope.freq_base") or 10000.0),
            rope_dim=int(field_value(reader, f"{arch}.rope.dimension_count") or head_dim),
            norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            vocab_size=int(field_value(reader, f"{arch}.vocab_size") or n_tokens),
            context_length=int(need("context_length")),
            tied_embeddings="output.weight" not in tensors,
            **asdict(tokenizer),
            traits=traits,
            sliding_window=None if not window else int(window),
            sliding_layers=_sliding_layers(reader, arch, traits, n_layers) if window else (),
            rope_local_theta=traits.rope_local_theta if window else None,
            rope_freq_factors=None if factors is None else tuple(float(f) for f in np.asarray(factors.data).ravel()),
        )


def _sliding_layers(reader: GGUFReader, arch: str, traits: ArchitectureTraits, n_layers: int) -> tuple[int, ...]:
    """The windowed layers: from ``{arch}.attention.sliding_window_pattern`` (a period, or one flag a layer)
    where the file has it, else the architecture's period (llama.cpp: layer i is global iff (i+1) % N == 0)."""
    pattern = field_value(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ModelFileError(
                f"{arch}.attention.sliding_window_pattern has {len(pattern)} flags for {n_layers} layers"
            )
        return tuple(i for i, flag in enumerate(pattern) if flag)
    period = int(pattern) if pattern is not None else traits.sliding_window_pattern
    if period < 1:
        raise ModelFileError(f"{arch}.attention.sliding_window_pattern must be positive, not {period}")
    return tuple(i for i in range(n_layers) if i % period < period - 1)


def _rope_scaling_name(factors: tuple[float, ...] | None) -> str:
    """The contract's name for the RoPE frequency factors: "none", or "llama3:" and a digest of their values."""
    if factors is None:
        return "none"
    return "llama3:" + hashlib.sha256(np.asarray(factors, np.float32).tobytes()).hexdigest()[:16]
