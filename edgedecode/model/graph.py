"""The decoder (llama, qwen2, qwen3, gemma3: ``spec.traits``) as an onnxruntime graph, built from small
per-block functions.

Two variants share every block but the linear layers, the embedding and the head:

* ``decode``: the INT4 edge graph. With ``kernels="gguf"`` every quantized matrix is one of edgedecode's own
  MatMulGGUF ops over the GGUF's blocks as stored, the embedding a GatherGGUF over its rows, and a tied
  LM head reads the very same initializer (edgedecode/kernels; nothing below applies to them); on CUDA
  (float16) each layer's linears, norms and residual adds fuse into four FusedMatMulGGUF nodes where the
  architecture allows (graph_fused.py); on a CPU with its SIMD paths the KV is float16 and attention is
  edgedecode's DecodeAttention. With the stock ops, linear layers are MatMulNBits without zero points (the
  fast path), 4-bit where the GGUF type is 4-bit and 8-bit for the 5-, 6- and 8-bit types (weights.py), plus,
  for the asymmetric types (Q4_1, Q4_K, Q5_1, Q5_K), a per-block correction ``blocksum(x) @ C``
  computed once per distinct input (or, per ``GraphOptions.q4_1``, float zero points ``−m/d``, a
  K-doubled "stacked" form, or, the CUDA default, zero points for small models and the correction
  for large ones); GatherBlockQuantized and a tied LM head read the
  block embedding table's codes as two initializers, stored once in the side file.
* ``prefill``: the higher-precision graph over dequantized weights (plain MatMul / Gemm).

Both use GroupQueryAttention with RoPE fused (rotate-half order, post-RoPE keys written to the
present) and take past/present KV as ``[batch, kv_heads, max_context, head_dim]`` buffers that the
runtime binds as both input and output; a float32 decode graph with a float16 KV
(``GraphOptions.kv_dtype``) runs edgedecode's DecodeAttention instead, which computes the same over
half the bytes. I/O names follow onnxruntime-genai, with ``position_ids`` (int64 [B, S]: the true
positions of the new tokens, which RoPE uses; they run ahead of the cache slots once dropped tokens
were compacted away) always present, and one addition:
``logits_positions`` (int64 [K], negative values count from the end): the sequence positions whose
logits are computed, so a prompt pass pays for one LM-head row instead of S.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import groupby

import numpy as np
import onnx

from edgedecode.errors import EdgeDecodeError
from edgedecode.model.graph_fused import fused_decoder_layers, unfused_reason
from edgedecode.model.onnx_builder import (
    INT32,
    INT64,
    KERNEL_DOMAIN,
    MS_DOMAIN,
    GraphBuilder,
    onnx_dtype,
)
from edgedecode.model.requant import (
    NATIVE,
    WeightFormat,
    WeightFormatError,
    parse_weight_format,
    requantize_layers,
)
from edgedecode.model.spec import ModelSpec
from edgedecode.model.weights import BlockQuantized, GGUFMatrix, ModelTensors, n_blocks, stack_rows

logger = logging.getLogger(__name__)
GRAPH_KINDS = ("decode", "prefill")
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
# How the decode graph applies per-block offsets (Q4_1's m, asymmetric re-quantization):
# "correction": MatMulNBits without zero points plus blocksum(x) @ C (exact; the fast kernel on CPU and CUDA);
# "zero_point": one MatMulNBits with a float zero point per block, −m/d (exact up to its rounding to
#   the graph's dtype; no extra nodes, but onnxruntime 1.31's GEMV takes uint8 zero points only, so on
#   CUDA it dequantizes the weight and runs a cuBLAS GEMM: two kernels a linear);
# "stacked": one MatMulNBits over [x, x] with K doubled, the second half's codes 2^(bits−1)+1 scaled by C
#   (exact like "correction"; one Concat per distinct input instead of ReduceSum, MatMul and Add per matmul).
# "by_size": "zero_point" for a model whose layers hold fewer than BY_SIZE_CORRECTION_ELEMENTS weights with
#   offsets each (on average), "correction" for a larger one.
Q4_1_MODES = ("correction", "zero_point", "stacked", "by_size")
# On CUDA, onnxruntime 1.31 dequantizes a float-zero-point weight into a scratch buffer at every step,
# a cost that grows with the weights, while the correction costs a few small kernels a matmul, a cost
# that does not. Measured (docs/performance.md, "Choosing the offset form by size"): zero points decode
# SmolLM2 (3.5 M offset weights a layer; H100) 1.4x and the 0.5B shape (15 M; H200) 1.3x faster than the
# correction, the 1B (61 M) and 3B (101 M) shapes 1.18-1.75x slower (H200). Mixing the forms matmul by matmul
# measured slower than the correction alone on the 3B shape, so the choice is per graph; 30 M lies
# between the measured sizes, the break-even itself was not measured.
BY_SIZE_CORRECTION_ELEMENTS = 30_000_000
# The form each device's decode graph ships with. CUDA: by size (above). CPU: the correction, since
# onnxruntime's CPU kernel takes a ~20x slower path with float zero points.
DEVICE_Q4_1 = {"cpu": "correction", "cuda": "by_size"}
# Which ops read the quantized weights: "stock" = onnxruntime's MatMulNBits and GatherBlockQuantized over the
# weights re-laid in their form (above); "gguf" = edgedecode's own MatMulGGUF and GatherGGUF (edgedecode/kernels),
# which read the GGUF's blocks as stored. The runtime picks "gguf" where its kernel library loads.
KERNEL_FORMS = ("stock", "gguf")
# The KV dtypes a graph may keep (GraphOptions.kv_dtype). A float16 KV in a float32 graph takes edgedecode's
# DecodeAttention (onnxruntime's GroupQueryAttention ties the cache's dtype to the graph's), so the "gguf" form only.
KV_DTYPES = ("float32", "float16")
# The widths onnxruntime 1.31's CPU MatMulNBits takes float zero points at ("Only 2b and 4b quantization
# is supported for unpacked compute"); 8-bit weights with offsets (Q5_1, Q5_K) keep the correction in every mode.
FLOAT_ZERO_POINT_BITS = (2, 4)


class GraphOptionsError(EdgeDecodeError, ValueError):
    """Graph options that no graph can be built for."""


@dataclass(frozen=True)
class GraphOptions:
    """What distinguishes one built graph from another (part of the build-cache key)."""

    kind: str = "decode"
    dtype: str = "float32"  # float16 for the CUDA execution provider
    # MatMulNBits: 4 = int8 activations (fast; llama.cpp does the same), 0 = exact fp32 arithmetic,
    # for verification only: onnxruntime's 8-bit LM head has no fast acc-0 kernel on CPU.
    accuracy_level: int = 4
    # Also output each layer's pre-RoPE queries at logits_positions (``queries.{i}``), from which the
    # prefill side scores token importance (kv/importance.py). Default: on for prefill, off for decode.
    emit_queries: bool | None = None
    # The decode graph's layer matrices: "native" (the GGUF's blocks) or re-quantized, "q<bits>b<block_size>".
    weights: str = NATIVE
    # How the decode graph applies the blocks' offsets (Q4_1's m): one of Q4_1_MODES.
    q4_1: str = "correction"
    # Which ops read the decode graph's quantized weights: one of KERNEL_FORMS.
    kernels: str = "stock"
    # The KV's dtype (past_key_values.* / present.*): None = the graph's dtype; "float16" in a float32 decode
    # graph of the "gguf" form (DecodeAttention).
    kv_dtype: str | None = None

    @classmethod
    def for_device(
        cls, kind: str, device: str, accuracy_level: int = 4, kernels: str = "stock", kv_dtype: str | None = None
    ) -> GraphOptions:
        """The ``kind`` graph as it ships for ``device``: float16 on CUDA, float32 elsewhere; the decode
        graph at ``accuracy_level`` with ``kernels``, its KV in ``kv_dtype`` (None: the graph's dtype) and, for
        the stock ops, the device's Q4_1 form (DEVICE_Q4_1; "correction" for others). The prefill graph has
        dense weights, so it takes none of them."""
        dtype = "float16" if device == "cuda" else "float32"
        if kind == "decode":
            q4_1 = DEVICE_Q4_1.get(device, "correction") if kernels == "stock" else "correction"
            return cls(kind, dtype, accuracy_level, q4_1=q4_1, kernels=kernels, kv_dtype=kv_dtype)
        return cls(kind, dtype)

    def __post_init__(self) -> None:
        if self.kind not in GRAPH_KINDS:
            raise GraphOptionsError(f"graph kind must be one of {GRAPH_KINDS}, not {self.kind!r}")
        if self.dtype not in ("float32", "float16"):
            raise GraphOptionsError(f"dtype must be float32 or float16, not {self.dtype!r}")
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise GraphOptionsError(f"accuracy_level must be one of {ACCURACY_LEVELS}, not {self.accuracy_level}")
        try:
            fmt = parse_weight_format(self.weights)
        except WeightFormatError as exc:
            raise GraphOptionsError(str(exc)) from exc
        if fmt is not None and self.kind != "decode":
            raise GraphOptionsError(
                f"weights={self.weights!r} applies to the decode graph only; "
                f"the {self.kind} graph uses dense float weights"
            )
        if self.q4_1 not in Q4_1_MODES:
            raise GraphOptionsError(f"q4_1 must be one of {Q4_1_MODES}, not {self.q4_1!r}")
        if self.q4_1 != "correction" and self.kind != "decode":
            raise GraphOptionsError(
                f"q4_1={self.q4_1!r} applies to the decode graph only; the {self.kind} graph uses dense float weights"
            )
        if self.kernels not in KERNEL_FORMS:
            raise GraphOptionsError(f"kernels must be one of {KERNEL_FORMS}, not {self.kernels!r}")
        if self.kernels != "stock" and self.kind != "decode":
            raise GraphOptionsError(
                f"kernels={self.kernels!r} applies to the decode graph only; the {self.kind} graph uses dense weights"
            )
        if self.kv_dtype is None:
            object.__setattr__(self, "kv_dtype", self.dtype)
        if self.kv_dtype not in KV_DTYPES:
            raise GraphOptionsError(f"kv_dtype must be one of {KV_DTYPES}, not {self.kv_dtype!r}")
        if self.kv_dtype != self.dtype and (self.kind, self.dtype, self.kernels) != ("decode", "float32", "gguf"):
            raise GraphOptionsError(
                f"kv_dtype={self.kv_dtype!r} in a {self.dtype} graph needs the float32 decode graph with "
                "kernels='gguf' (edgedecode's DecodeAttention); other graphs keep the KV in their own dtype"
            )
        if self.kind == "prefill":  # no MatMulNBits in it: one prefill graph serves every accuracy level
            object.__setattr__(self, "accuracy_level", 0)
        if self.kernels == "gguf" and self.dtype == "float16":  # the CUDA ops take float activations only
            object.__setattr__(self, "accuracy_level", 0)
        if self.emit_queries is None:
            object.__setattr__(self, "emit_queries", self.kind == "prefill")

    @property
    def weight_format(self) -> WeightFormat | None:
        """The re-quantization of the layer matrices; None for the GGUF's own blocks."""
        return parse_weight_format(self.weights)

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def kv_np_dtype(self) -> np.dtype:
        """The KV buffers' dtype (the runtime allocates them in it)."""
        return np.dtype(self.kv_dtype)

    @property
    def own_attention(self) -> bool:
        """Whether attention is edgedecode's DecodeAttention (a float16 KV in a float32 graph), not GQA."""
        return self.kv_dtype != self.dtype


def input_names(spec: ModelSpec) -> list[str]:
    """Graph input names in order (genai naming plus logits_positions)."""
    kv = [f"past_key_values.{i}.{kind}" for i in range(spec.n_layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", "logits_positions", *kv]


def present_names(spec: ModelSpec) -> list[str]:
    return [f"present.{i}.{kind}" for i in range(spec.n_layers) for kind in ("key", "value")]


class _Emitter:
    """Emits the blocks of one graph; holds the builder, the spec and the options."""

    def __init__(self, spec: ModelSpec, options: GraphOptions) -> None:
        self.g = GraphBuilder(f"{spec.name}-{options.kind}")
        self.spec = spec
        self.opt = options
        self.dt = options.np_dtype
        self._blocksums: dict[tuple[str, int], str] = {}
        self._doubled: dict[str, str] = {}
        self._shared: dict[str, str] = {}
        self._rope: dict[str, tuple[str, str]] = {}
        # The residual stream's dtype: float32 inside a float16 graph where the architecture's outgrows float16.
        self.residual_dt = np.dtype(np.float32) if not spec.traits.float16_residual else self.dt
        self.embed: BlockQuantized | None = None  # the block embedding table, whose codes a tied head shares
        self.embed_codes: np.ndarray | None = None  # its packed codes, which a tied head reads too
        self.embed_rows: str | None = None  # a GGUF embedding table's initializer, which a tied head reads too

    def const(self, name: str, array: np.ndarray) -> str:
        return self.g.initializer(name, np.asarray(array))

    def shared(self, name: str, values: list[int] | int) -> str:
        """An int64 constant used by many nodes: added once, then reused by name."""
        if name not in self._shared:
            self._shared[name] = self.const(name, np.array(values, np.int64))
        return self._shared[name]

    def weight(self, name: str, array: np.ndarray) -> str:
        return self.const(name, np.asarray(array, dtype=self.dt))

    # ---- linear layers ---------------------------------------------------------------------
    def linear(self, x: str, weight, name: str, output: str | None = None) -> str:
        """y = x @ W.T for a weight [N, K]: dense, or (decode graph) BlockQuantized or GGUFMatrix;
        ``output`` names the result (else generated)."""
        if isinstance(weight, GGUFMatrix):
            return self._linear_gguf(x, self.const(f"{name}.rows", weight.rows), weight, name, output)
        if isinstance(weight, BlockQuantized):
            return self._linear_nbits(x, weight, name, output)
        outputs = None if output is None else [output]
        return self.g.op1("MatMul", [x, self.weight(f"{name}.weight_t", weight.T)], name=name, outputs=outputs)

    def _linear_gguf(self, x: str, rows: str, w: GGUFMatrix, name: str, output: str | None) -> str:
        """edgedecode's MatMulGGUF over the initializer ``rows`` (the GGUF's blocks of ``w``)."""
        n, k = w.shape
        return self.g.op1(
            "MatMulGGUF",
            [x, rows],
            name=name,
            domain=KERNEL_DOMAIN,
            outputs=None if output is None else [output],
            K=k,
            N=n,
            ggml_type=int(w.kind),
            accuracy_level=self.opt.accuracy_level,
        )

    def linear_fused(self, x: str, weights: list, name: str) -> str:
        """Weights stacked along N (QKV, gate+up): one matmul per run of neighbours in the same form.

        A GGUF may store them in different types (Q4_K_M: Q4_K q/k, Q6_K v), and a matmul reads one
        type (MatMulGGUF) or one bit width and block size (MatMulNBits), so each run gets its own
        matmul and a Concat joins them.
        """
        runs = [list(run) for _, run in groupby(weights, key=_weight_form)]
        if len(runs) == 1:
            return self.linear(x, stack_rows(weights), name)
        parts = [self.linear(x, stack_rows(run), f"{name}.{i}") for i, run in enumerate(runs)]
        return self.g.op1("Concat", parts, name=f"{name}.concat", axis=-1)

    def _linear_nbits(self, x: str, w: BlockQuantized, name: str, output: str | None = None) -> str:
        """MatMulNBits plus the offsets in the options' q4_1 mode; ``output`` names the result (else generated)."""
        n, k = w.shape
        outputs = None if output is None else [output]
        mode = self.opt.q4_1 if w.offsets is not None else None
        if mode == "zero_point" and w.bits not in FLOAT_ZERO_POINT_BITS:
            mode = "correction"
        if mode == "zero_point":
            w, zero_points = w.zero_point_form()
        elif mode == "stacked" and k % w.block_size == 0:
            return self._linear_stacked(x, w, name, outputs)
        inputs = [x, self._qweight(name, w), self.weight(f"{name}.scales", w.scales.reshape(-1))]
        if mode == "zero_point":
            inputs.append(self.weight(f"{name}.zero_points", zero_points))
        y = self.g.op1(
            "MatMulNBits",
            inputs,
            name=name,
            domain=MS_DOMAIN,
            outputs=outputs if w.offsets is None else None,
            K=k,
            N=n,
            bits=w.bits,
            block_size=w.block_size,
            accuracy_level=self.opt.accuracy_level,
        )
        if w.offsets is None:
            return y
        blocksum = self._blocksum(x, k, w.block_size)
        correction = self.g.op1(
            "MatMul", [blocksum, self.weight(f"{name}.correction", w.offsets.T)], name=f"{name}.correction"
        )
        return self.g.op1("Add", [y, correction], name=f"{name}.corrected", outputs=outputs)

    def _qweight(self, name: str, w: BlockQuantized) -> str:
        """The packed codes' initializer; the embedding's codes again when ``w`` has its very codes (a tied LM head).

        A tied head gets an initializer of its own, which the side file stores once with the embedding's
        (loader.write_graph): onnxruntime then maps the two apart, prepacks the head's and releases it,
        and the gather's mapping holds only the rows it reads (0.5B shape: ~100 MiB less RSS).
        """
        shared = self.embed
        same = shared is not None and w.codes is shared.codes and _weight_form(w) == _weight_form(shared)
        codes = self.embed_codes if same and self.embed_codes is not None else w.packed()
        return self.const(f"{name}.qweight", codes)

    def _linear_stacked(self, x: str, w: BlockQuantized, name: str, outputs: list[str] | None) -> str:
        """``[x, x] @ [d·(q − z) | C·1]``: the offsets as a second K half of constant codes z + 1 scaled by C."""
        n, k = w.shape
        ones = np.full_like(w.codes, (1 << (w.bits - 1)) + 1)
        stacked = BlockQuantized(
            np.concatenate([w.codes, ones], axis=1),
            np.concatenate([w.scales, w.offsets], axis=1),
            None,
            w.bits,
            w.block_size,
        )
        if x not in self._doubled:
            self._doubled[x] = self.g.op1("Concat", [x, x], name="doubled", axis=-1)
        inputs = [
            self._doubled[x],
            self.const(f"{name}.qweight", stacked.packed()),
            self.weight(f"{name}.scales", stacked.scales.reshape(-1)),
        ]
        return self.g.op1(
            "MatMulNBits",
            inputs,
            name=name,
            domain=MS_DOMAIN,
            outputs=outputs,
            K=2 * k,
            N=n,
            bits=w.bits,
            block_size=w.block_size,
            accuracy_level=self.opt.accuracy_level,
        )

    def _blocksum(self, x: str, k: int, block_size: int) -> str:
        """Sum of x over each block of K: [B, S, blocks]; shared by all matmuls reading x in that block size."""
        key = (x, block_size)
        if key not in self._blocksums:
            blocks = n_blocks(k, block_size)
            if blocks * block_size != k:  # a short last block: zero-pad x to whole blocks
                pads = self.const("blocksum_pads", np.array([0, 0, 0, 0, 0, blocks * block_size - k], np.int64))
                x = self.g.op1("Pad", [x, pads], name="blocksum.pad")
            shape = self.const("blocksum_shape", np.array([0, 0, blocks, block_size], np.int64))
            grouped = self.g.op1("Reshape", [x, shape], name="blocksum.reshape")
            axes = self.const("blocksum_axes", np.array([-1], np.int64))
            self._blocksums[key] = self.g.op1("ReduceSum", [grouped, axes], name="blocksum", keepdims=0)
        return self._blocksums[key]

    # ---- blocks ----------------------------------------------------------------------------
    def embedding(self, ids: str, table) -> str:
        """The rows of ``ids``: Gather over a dense table, GatherGGUF over a GGUF one, GatherBlockQuantized
        (plus offsets) over a block one.

        A table's quantized bytes (GGUF rows, or packed codes [V, blocks, block_size·bits/8] in
        MatMulNBits' layout) are kept for a tied LM head; a block table's offsets, where the type has
        them, are gathered and added per block.
        """
        if isinstance(table, GGUFMatrix):
            self.embed_rows = self.const("embed.rows", table.rows)
            return self.g.op1(
                "GatherGGUF",
                [self.embed_rows, ids],
                name="embed",
                domain=KERNEL_DOMAIN,
                K=table.shape[1],
                ggml_type=int(table.kind),
                dtype=onnx_dtype(self.dt),
            )
        if not isinstance(table, BlockQuantized):
            return self.g.op1("Gather", [self.weight("embed.weight", table), ids], name="embed", axis=0)
        hidden = table.shape[1]
        self.embed = table
        self.embed_codes = table.packed()
        data = self.const("embed.qweight", self.embed_codes)
        scales = self.weight("embed.scales", table.scales[..., None])
        blocks = self.g.op1(
            "GatherBlockQuantized",
            [data, ids, scales],
            name="embed",
            domain=MS_DOMAIN,
            gather_axis=0,
            quantize_axis=2,
            block_size=table.block_size,
            bits=table.bits,
        )
        if table.offsets is not None:
            offsets = self.weight("embed.offsets", table.offsets[..., None])
            gathered = self.g.op1("Gather", [offsets, ids], name="embed.offsets", axis=0)
            blocks = self.g.op1("Add", [blocks, gathered], name="embed.offset")
        shape = self.const("embed_shape", np.array([0, 0, hidden], np.int64))
        return self.g.op1("Reshape", [blocks, shape], name="embed.reshape")

    def lm_head(self, h: str, tensors: ModelTensors) -> str:
        table = tensors.embedding if tensors.lm_head is None else tensors.lm_head
        if isinstance(table, GGUFMatrix):
            tied_rows = self.embed_rows if tensors.lm_head is None else None  # a tied head reads the table's bytes
            rows = tied_rows if tied_rows is not None else self.const("lm_head.rows", table.rows)
            return self._linear_gguf(h, rows, table, "lm_head", output="logits")
        if isinstance(table, BlockQuantized):
            return self._linear_nbits(h, table, "lm_head", output="logits")
        weight = self.weight("lm_head.weight", table)  # tied: the embedding's bytes, stored once (see _qweight)
        flat = self.g.op1("Reshape", [h, self.const("head_flat", np.array([-1, self.spec.hidden_size], np.int64))])
        logits = self.g.op1("Gemm", [flat, weight], name="lm_head", transB=1)
        batch_seq = self.g.op1("Slice", [self.g.op1("Shape", [h]), self.shared("zero", [0]), self.shared("two", [2])])
        shape = self.g.op1("Concat", [batch_seq, self.const("vocab", np.array([-1], np.int64))], axis=0)
        return self.g.op1("Reshape", [logits, shape], outputs=["logits"])

    def attention(self, h: str, layer: int, weights, seqlens: str, total: str) -> str:
        """The fused QKV projection (plus biases), attention over it (``attend``) and the output projection."""
        name = f"layers.{layer}.attn"
        qkv = self.linear_fused(h, weights.qkv, f"{name}.qkv")
        if weights.qkv_bias is not None:
            qkv = self.g.op1("Add", [qkv, self.weight(f"{name}.qkv.bias", weights.qkv_bias)], name=f"{name}.qkv.bias")
        return self.linear(self.attend(qkv, layer, weights, seqlens, total), weights.o, f"{name}.o")

    def attend(self, qkv: str, layer: int, weights, seqlens: str, total: str) -> str:
        """GroupQueryAttention over the projected ``qkv`` [B, S, (heads + 2 kv_heads) * head_dim], RoPE fused
        into it, or with a float16 KV in a float32 graph (``own_attention``) edgedecode's DecodeAttention, which takes
        the same inputs but ``total`` and computes the same; returns its output [B, S, heads * head_dim].

        With QK-norm the queries and keys are normed per head first and go to GQA unpacked, so RoPE
        still runs after the norm. A windowed layer sees its last ``sliding_window`` keys (itself included).
        """
        s = self.spec
        name = f"layers.{layer}.attn"
        qkv_inputs = [qkv, "", ""]
        if weights.q_norm is not None:
            q_width, kv_width = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
            split = self.shared("split_qkv", [q_width, kv_width, kv_width])
            q, k, v = self.g.op("Split", [qkv, split], 3, name=f"{name}.split", axis=-1)
            q = self.head_norm(q, weights.q_norm, s.n_heads, f"{name}.q_norm")
            k = self.head_norm(k, weights.k_norm, s.n_kv_heads, f"{name}.k_norm")
            qkv_inputs = [q, k, v]
        if self.opt.emit_queries:
            self.emit_queries(qkv_inputs[0], layer)
        cos, sin = self.rope_cache(layer)
        # local_window_size counts the keys a query sees, itself included (checked against the reference)
        window = s.sliding_window if s.is_sliding(layer) and s.sliding_window else -1
        past = [f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"]
        own = self.opt.own_attention
        out = self.g.op(
            "DecodeAttention" if own else "GroupQueryAttention",
            [*qkv_inputs, *past, seqlens, *([] if own else [total]), cos, sin, "position_ids"],
            3,
            name=name,
            domain=KERNEL_DOMAIN if own else MS_DOMAIN,
            outputs=[f"{name}/out", f"present.{layer}.key", f"present.{layer}.value"],
            num_heads=s.n_heads,
            kv_num_heads=s.n_kv_heads,
            local_window_size=window,
            scale=s.attention_scale,
            **({} if own else {"do_rotary": 1, "rotary_interleaved": 0}),
        )[0]
        return out

    def head_norm(self, x: str, gamma: np.ndarray, heads: int, name: str) -> str:
        """RMSNorm of each head of x [B, S, heads * head_dim] (QK-norm)."""
        shape = self.shared(f"heads_{heads}", [0, 0, heads, self.spec.head_dim])
        split = self.g.op1("Reshape", [x, shape], name=f"{name}.heads")
        normed = self.rms_norm(split, gamma, name)
        return self.g.op1("Reshape", [normed, self.shared("merge_heads", [0, 0, -1])], name=f"{name}.merge")

    def rms_norm(self, x: str, gamma: np.ndarray, name: str, dtype: np.dtype | None = None) -> str:
        """RMSNorm over the last axis of x (of ``dtype``, default the graph's)."""
        return self.g.op1(
            "SimplifiedLayerNormalization",
            [x, self.const(f"{name}.weight", gamma.astype(dtype or self.dt))],
            name=name,
            axis=-1,
            epsilon=self.spec.norm_eps,
            stash_type=1,
        )

    def post_norm(self, x: str, gamma: np.ndarray | None, name: str) -> str:
        """RMSNorm of a block's output before its residual add, where the architecture has one."""
        return x if gamma is None else self.rms_norm(x, gamma, name)

    def emit_queries(self, queries: str, layer: int) -> None:
        """Output ``queries.{layer}`` [B, K, heads*head_dim]: the pre-RoPE query rows at logits_positions
        (``queries`` is the fused QKV or the normed queries; the queries lead either)."""
        width = self.spec.n_heads * self.spec.head_dim
        rows = self.g.op1("Gather", [queries, "logits_positions"], name=f"layers.{layer}.queries.rows", axis=1)
        self.g.op1(
            "Slice",
            [rows, self.shared("zero", [0]), self.shared("q_width", [width]), self.shared("last_axis", [-1])],
            name=f"layers.{layer}.queries",
            outputs=[f"queries.{layer}"],
        )

    def mlp(self, h: str, layer: int, weights) -> str:
        gate_up = self.linear_fused(h, weights.gate_up, f"layers.{layer}.mlp.gate_up")
        return self.linear(self.gated(gate_up, layer), weights.down, f"layers.{layer}.mlp.down")

    def gated(self, gate_up: str, layer: int) -> str:
        """act(gate) · up of the stacked projection ``gate_up`` [B, S, 2 * ffn]."""
        f = self.spec.ffn_size
        split = self.shared("split_ffn", [f, f])
        gate, up = self.g.op("Split", [gate_up, split], 2, name=f"layers.{layer}.mlp.split", axis=-1)
        return self.g.op1("Mul", [self.activation(gate, f"layers.{layer}.mlp"), up], name=f"layers.{layer}.mlp.act")

    def activation(self, gate: str, name: str) -> str:
        """The architecture's gate activation: SiLU, or GELU with the tanh approximation (FastGelu)."""
        if self.spec.traits.activation == "gelu_tanh":
            return self.g.op1("FastGelu", [gate], name=f"{name}.gelu", domain=MS_DOMAIN)
        return self.g.op1("Mul", [gate, self.g.op1("Sigmoid", [gate])], name=f"{name}.silu")

    def skip_norm(self, x: str, residual: str, gamma: np.ndarray, name: str) -> tuple[str, str]:
        """(RMSNorm(x + residual), x + residual); the sum stays in the residual stream's dtype."""
        out, _, _, summed = self.g.op(
            "SkipSimplifiedLayerNormalization",
            [self.to_residual(x, name), residual, self.const(f"{name}.weight", gamma.astype(self.residual_dt))],
            4,
            name=name,
            domain=MS_DOMAIN,
            epsilon=self.spec.norm_eps,
        )
        return self.from_residual(out, name), summed

    def to_residual(self, x: str, name: str) -> str:
        """x in the residual stream's dtype (a Cast where it differs from the graph's)."""
        if self.residual_dt == self.dt:
            return x
        return self.g.op1("Cast", [x], name=f"{name}.to_residual", to=onnx_dtype(self.residual_dt))

    def from_residual(self, x: str, name: str) -> str:
        """x, from the residual stream's dtype, in the graph's."""
        if self.residual_dt == self.dt:
            return x
        return self.g.op1("Cast", [x], name=f"{name}.from_residual", to=onnx_dtype(self.dt))

    def rope_cache(self, layer: int) -> tuple[str, str]:
        """GQA's (cos, sin) caches [context, head_dim / 2] for ``layer``'s RoPE: one pair per distinct base."""
        s = self.spec
        key = "rope.local" if s.is_sliding(layer) and s.rope_local_theta is not None else "rope"
        if key not in self._rope:
            angles = np.arange(s.context_length, dtype=np.float64)[:, None] * s.rope_inv_freq(layer)[None, :]
            self._rope[key] = (self.weight(f"{key}.cos", np.cos(angles)), self.weight(f"{key}.sin", np.sin(angles)))
        return self._rope[key]

    def mask_lengths(self, mask: str) -> tuple[str, str]:
        """GQA's seqlens_k (tokens before the last, per row) and total_sequence_length from attention_mask
        (DecodeAttention takes no total: "" then)."""
        axes = self.const("mask_axes", np.array([1], np.int64))
        summed = self.g.op1("ReduceSum", [mask, axes], name="mask.sum", keepdims=0)
        last = self.g.op1("Sub", [summed, self.const("one", np.array(1, np.int64))], name="mask.last")
        seqlens = self.g.op1("Cast", [last], name="seqlens_k", to=INT32)
        if self.opt.own_attention:
            return seqlens, ""
        width = self.g.op1(
            "Gather", [self.g.op1("Shape", [mask]), self.const("one_idx", np.array(1, np.int64))], axis=0
        )
        total = self.g.op1("Cast", [width], name="total_seq_len", to=INT32)
        return seqlens, total


def _weight_form(weight) -> tuple[int, int] | int | None:
    """What a matmul over the weight needs to share with others it is fused with: the GGUF type (GGUFMatrix),
    (bits, block size) (BlockQuantized); None: dense."""
    if isinstance(weight, GGUFMatrix):
        return int(weight.kind)
    return (weight.bits, weight.block_size) if isinstance(weight, BlockQuantized) else None


def offset_form_by_size(tensors: ModelTensors) -> str:
    """The Q4_1 mode "by_size" stands for with these weights: "correction" where the layers' matrices
    with offsets hold BY_SIZE_CORRECTION_ELEMENTS weights or more a layer on average, else "zero_point"."""
    with_offsets = sum(
        w.shape[0] * w.shape[1]
        for layer in tensors.layers
        for w in (*layer.qkv, layer.o, *layer.gate_up, layer.down)
        if isinstance(w, BlockQuantized) and w.offsets is not None
    )
    return "correction" if with_offsets >= BY_SIZE_CORRECTION_ELEMENTS * len(tensors.layers) else "zero_point"


def build_graph(
    spec: ModelSpec, tensors: ModelTensors, options: GraphOptions, advance: Callable[[int], None] | None = None
) -> onnx.ModelProto:
    """Assemble the full decoder graph from the model's tensors (re-quantized first if the options say so);
    ``advance(1)`` is called as each layer is emitted."""
    tensors = requantize_layers(tensors, options.weight_format)
    if options.q4_1 == "by_size":
        options = replace(options, q4_1=offset_form_by_size(tensors))
    e = _Emitter(spec, options)
    g = e.g
    dt = onnx_dtype(options.np_dtype)
    kv_dt = onnx_dtype(options.kv_np_dtype)
    kv_shape = ["batch", spec.n_kv_heads, "past_sequence_length", spec.head_dim]
    ids = g.input("input_ids", INT64, ["batch", "sequence_length"])
    mask = g.input("attention_mask", INT64, ["batch", "total_sequence_length"])
    g.input("position_ids", INT64, ["batch", "sequence_length"])
    g.input("logits_positions", INT64, ["logits_count"])
    for name in input_names(spec)[4:]:
        g.input(name, kv_dt, kv_shape)

    seqlens, total = e.mask_lengths(mask)
    x = e.embedding(ids, tensors.embedding)
    if spec.traits.embedding_scale:
        x = g.op1("Mul", [x, e.weight("embed.scale", np.array(np.sqrt(spec.hidden_size)))], name="embed.scale")
    # The own ops' CUDA form (float16) fuses each layer into four FusedMatMulGGUF nodes where the architecture
    # allows it (graph_fused.unfused_reason says why not); the CPU has no fused op and keeps MatMulGGUF and the norms.
    own_cuda = options.kernels == "gguf" and options.dtype == "float16"
    unfused = unfused_reason(spec, tensors) if own_cuda else ""
    if own_cuda and not unfused:
        fused_decoder_layers(e, tensors, x, seqlens, total, advance)
    else:
        if unfused:
            logger.info("the CUDA decode graph of %s keeps its linear layers unfused: %s", spec.name, unfused)
        decoder_layers(e, tensors, x, seqlens, total, advance)
    g.output("logits", dt, ["batch", "logits_count", spec.vocab_size])
    for name in present_names(spec):
        g.output(name, kv_dt, kv_shape)
    if options.emit_queries:
        for i in range(spec.n_layers):
            g.output(f"queries.{i}", dt, ["batch", "logits_count", spec.n_heads * spec.head_dim])
    return g.model()


def decoder_layers(
    e: _Emitter, tensors: ModelTensors, x: str, seqlens: str, total: str, advance: Callable[[int], None] | None
) -> None:
    """The layers after the embedding ``x``, the final norm and the LM head (``logits``), with the stock norms and
    residual adds around the linear layers; ``advance(1)`` as each layer is emitted."""
    g, spec = e.g, e.spec
    residual = e.to_residual(x, "embed")
    first_norm = e.rms_norm(residual, tensors.layers[0].attn_norm, "layers.0.attn_norm", e.residual_dt)
    h = e.from_residual(first_norm, "layers.0.attn_norm")
    for i, layer in enumerate(tensors.layers):
        attn = e.post_norm(e.attention(h, i, layer, seqlens, total), layer.post_attn_norm, f"layers.{i}.post_attn_norm")
        h, residual = e.skip_norm(attn, residual, layer.ffn_norm, f"layers.{i}.ffn_norm")
        mlp = e.post_norm(e.mlp(h, i, layer), layer.post_ffn_norm, f"layers.{i}.post_ffn_norm")
        if i + 1 < spec.n_layers:
            h, residual = e.skip_norm(mlp, residual, tensors.layers[i + 1].attn_norm, f"layers.{i + 1}.attn_norm")
        if advance is not None:
            advance(1)
    # Only the requested positions go through the final norm and the LM head.
    mlp_sel = g.op1("Gather", [mlp, "logits_positions"], name="select.mlp", axis=1)
    res_sel = g.op1("Gather", [residual, "logits_positions"], name="select.residual", axis=1)
    final, _ = e.skip_norm(mlp_sel, res_sel, tensors.output_norm, "final_norm")
    e.lm_head(final, tensors)
