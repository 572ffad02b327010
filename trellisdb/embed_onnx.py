"""MiniLM as an ONNX graph, built in memory from the shipped weights, run by onnxruntime.

The fast backend of :class:`trellisdb.embed.MiniLM` (the ``fast-embed`` extra:
``pip install 'trellisdb[fast-embed]'``). Nothing is downloaded and nothing is
written to disk: :func:`build_model` turns the same ``model.safetensors`` the
numpy path reads into an ``onnx.ModelProto`` of standard ops (opset 17, where
``LayerNormalization`` is one), and :func:`session` keeps one onnxruntime
session per model folder per process, built on first use (about a second, most
of it importing ``onnx``).

The graph computes what ``MiniLM._forward`` does, op for op: BERT's embeddings,
six encoder layers (the query, key and value projections fused into one
``MatMul``, padded keys masked out of the softmax, exact erf GELU), mean pooling
over the real tokens and L2 normalization, so it returns the sentence vectors
themselves. Inputs ``input_ids``, ``token_type_ids`` and ``attention_mask`` are
int32 ``(batch, sequence)`` with both axes dynamic; the output
``sentence_embedding`` is float32 ``(batch, hidden)``.

onnxruntime's fused transformer kernels (``Attention``, ``SkipLayerNormalization``,
``BiasGelu`` of the ``com.microsoft`` domain, what its transformer optimizer
rewrites a BERT into) were measured against this graph and gave nothing at
these sizes: the time is in the matrix products, which both run in the same
kernels. Standard ops keep the graph checkable by ``onnx.checker``.

>>> sess = session(minilm_dir(), load_safetensors)      # doctest: +SKIP
>>> sess.run(None, {"input_ids": ids, "token_type_ids": types, "attention_mask": mask})[0].shape  # doctest: +SKIP
(2, 384)
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

OPSET = 17  # the first with LayerNormalization
INSTALL = "pip install 'trellisdb[fast-embed]'"
INPUTS = ("input_ids", "token_type_ids", "attention_mask")


def missing() -> str | None:
    """The first package of the ``fast-embed`` extra that cannot be imported, or None."""
    import importlib.util

    for name in ("onnx", "onnxruntime"):
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


class _Graph:
    """The nodes and initializers of a graph being built; each method returns its output's name."""

    def __init__(self) -> None:
        from onnx import helper, numpy_helper

        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []

    def const(self, name: str, a: Any, dtype: Any = np.float32) -> str:
        self.inits.append(self.numpy_helper.from_array(np.array(a, dtype, order="C"), name))  # 0-d stays 0-d
        return name

    def ints(self, name: str, a: Any) -> str:
        return self.const(name, a, np.int64)

    def op(self, op: str, ins: list[str], out: str, **attrs: Any) -> str:
        self.nodes.append(self.helper.make_node(op, ins, [out], name=out, **attrs))
        return out


def build_model(w: Mapping[str, np.ndarray], cfg: Mapping[str, Any]) -> Any:
    """The ONNX model (an ``onnx.ModelProto``) of BERT weights ``w`` (named as in the
    safetensors file) and config ``cfg``, its vectors mean-pooled and L2-normalized."""
    from onnx import TensorProto, helper

    layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    hidden, eps = int(cfg["hidden_size"]), float(cfg["layer_norm_eps"])
    hd = hidden // heads
    g = _Graph()

    def weight(name: str, transpose: bool = False) -> str:
        return g.const(name, w[name].T if transpose else w[name])

    e = "embeddings."
    length = g.op("Gather", [g.op("Shape", ["input_ids"], "shape"), g.ints("one", 1)], "length", axis=0)
    pos = g.op("Slice", [weight(e + "position_embeddings.weight"), g.ints("zero", [0]),
                         g.op("Unsqueeze", [length, g.ints("axis0", [0])], "length1")], "positions")
    words = g.op("Gather", [weight(e + "word_embeddings.weight"), "input_ids"], "words")
    types = g.op("Gather", [weight(e + "token_type_embeddings.weight"), "token_type_ids"], "types")
    x = g.op("Add", [g.op("Add", [words, pos], "words_positions"), types], "embedding_sum")
    x = g.op("LayerNormalization", [x, weight(e + "LayerNorm.weight"), weight(e + "LayerNorm.bias")],
             "embedded", axis=-1, epsilon=eps)
    keep = g.op("Cast", ["attention_mask"], "keep", to=TensorProto.FLOAT)  # 1 real token, 0 padding
    pad = g.op("Mul", [g.op("Sub", [g.const("one_f", 1.0), keep], "padding"), g.const("very_negative", -1e4)],
               "pad_bias")  # exp(-1e4) is 0 in float32: padded keys get no attention
    pad = g.op("Unsqueeze", [pad, g.ints("axes12", [1, 2])], "pad_bias4")  # (batch, 1, 1, keys)

    scale = np.float32(1.0 / math.sqrt(hd))  # the scores' 1/sqrt(head_dim), folded into the query projection
    for i in range(layers):
        p = f"encoder.layer.{i}."
        qkv_w = [w[p + f"attention.self.{n}.weight"].T for n in ("query", "key", "value")]
        qkv_b = [w[p + f"attention.self.{n}.bias"] for n in ("query", "key", "value")]
        qkv = g.op("MatMul", [x, g.const(p + "qkv.w", np.concatenate([qkv_w[0] * scale, *qkv_w[1:]], axis=1))],
                   p + "qkv_mm")
        qkv = g.op("Add", [qkv, g.const(p + "qkv.b", np.concatenate([qkv_b[0] * scale, *qkv_b[1:]]))], p + "qkv")
        qkv = g.op("Reshape", [qkv, g.ints(p + "qkv_shape", [0, 0, 3, heads, hd])], p + "qkv5")
        qkv = g.op("Transpose", [qkv], p + "qkv_t", perm=[2, 0, 3, 1, 4])  # (3, batch, heads, seq, head_dim)
        q, k, v = (g.op("Gather", [qkv, g.ints(p + f"i{j}", j)], p + n, axis=0) for j, n in enumerate("qkv"))
        scores = g.op("MatMul", [q, g.op("Transpose", [k], p + "kt", perm=[0, 1, 3, 2])], p + "qk")
        probs = g.op("Softmax", [g.op("Add", [scores, pad], p + "scores")], p + "probs", axis=-1)
        ctx = g.op("Transpose", [g.op("MatMul", [probs, v], p + "pv")], p + "ctx_t", perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, g.ints(p + "ctx_shape", [0, 0, hidden])], p + "ctx")
        x = _add_norm(g, w, ctx, x, p + "attention.output", eps)
        h = g.op("MatMul", [x, weight(p + "intermediate.dense.weight", transpose=True)], p + "inter_mm")
        h = g.op("Add", [h, weight(p + "intermediate.dense.bias")], p + "inter")
        erf = g.op("Erf", [g.op("Mul", [h, g.const(p + "rsqrt2", 1 / math.sqrt(2))], p + "h_rsqrt2")], p + "erf")
        phi = g.op("Add", [g.const(p + "half", 0.5), g.op("Mul", [erf, g.const(p + "half_", 0.5)], p + "erf2")],
                   p + "phi")  # BERT's exact GELU: h * Phi(h)
        x = _add_norm(g, w, g.op("Mul", [h, phi], p + "gelu"), x, p + "output", eps)

    # mean pooling over the real tokens, then L2 normalization (the model's modules 1 and 2)
    keep3 = g.op("Unsqueeze", [keep, g.ints("axis_last", [-1])], "keep3")
    total = g.op("ReduceSum", [g.op("Mul", [x, keep3], "kept"), g.ints("axis1", [1])], "total", keepdims=0)
    count = g.op("ReduceSum", [keep3, g.ints("axis1_", [1])], "count0", keepdims=0)
    pooled = g.op("Div", [total, g.op("Max", [count, g.const("tiny", 1e-9)], "count")], "pooled")
    norm = g.op("ReduceL2", [pooled], "norm0", axes=[-1], keepdims=1)  # axes an attribute until opset 18
    g.op("Div", [pooled, g.op("Max", [norm, g.const("tiny_", 1e-12)], "norm")], "sentence_embedding")
    graph = helper.make_graph(
        g.nodes, "all-MiniLM-L6-v2",
        [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", "sequence"]) for n in INPUTS],
        [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", hidden])], g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="trellisdb")


def _add_norm(g: _Graph, w: Mapping[str, np.ndarray], h: str, residual: str, p: str, eps: float) -> str:
    """BERT's output block ``LayerNorm(residual + h @ W + b)``, its weights under ``p``."""
    mm = g.op("MatMul", [h, g.const(p + ".dense.wt", w[p + ".dense.weight"].T)], p + "_mm")
    dense = g.op("Add", [mm, g.const(p + ".dense.bias", w[p + ".dense.bias"])], p + "_dense")
    s = g.op("Add", [dense, residual], p + "_sum")
    gamma, beta = g.const(p + ".LayerNorm.weight", w[p + ".LayerNorm.weight"]), p + ".LayerNorm.bias"
    return g.op("LayerNormalization", [s, gamma, g.const(beta, w[beta])], p + "_out", axis=-1, epsilon=eps)


_SESSIONS: dict[str, Any] = {}
_LOCK = threading.Lock()


def threads() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it, else all)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def session(model_dir: str, read: Callable[[str], Mapping[str, np.ndarray]]) -> Any:
    """The onnxruntime session of the MiniLM in ``model_dir``, its weights read from
    ``model.safetensors`` by ``read`` (``trellisdb.embed.load_safetensors``): built on the
    first call in this process, then shared by every caller (its ``run`` is thread-safe)."""
    key = os.path.realpath(model_dir)
    with _LOCK:
        sess = _SESSIONS.get(key)
        if sess is None:
            import onnxruntime as ort

            ort.disable_telemetry_events()  # a library's embedder reports nothing anywhere

            with open(os.path.join(model_dir, "config.json")) as fh:
                cfg = json.load(fh)
            model = build_model(read(os.path.join(model_dir, "model.safetensors")), cfg)
            opts = ort.SessionOptions()
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL  # one chain of kernels, each parallel inside
            opts.intra_op_num_threads = threads()
            opts.inter_op_num_threads = 1
            opts.log_severity_level = 3  # errors only
            sess = _SESSIONS[key] = ort.InferenceSession(model.SerializeToString(), opts,
                                                         providers=["CPUExecutionProvider"])
        return sess
