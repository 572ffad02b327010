"""The offline MiniLM embedder matches the reference sentence-transformers model, on both
backends (numpy; onnxruntime, the fast-embed extra), and db.embed shows its progress."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import trellisdb
from trellisdb import embed_onnx
from trellisdb.embed import Embedder, EmbedderError, MiniLM, check_vectors, load_safetensors

REF = json.loads((Path(__file__).parent / "fixtures" / "minilm_reference.json").read_text())
needs_onnx = pytest.mark.skipif(embed_onnx.missing() is not None, reason="the fast-embed extra is not installed")

# the reference sentences hold "", unicode and a text past 256 tokens; these add more of each
VARIED = [
    *REF["sentences"],
    " ",
    "naïve café — 東京の円充填 🙂 ∑ r_i → max",
    "def pack(n):\n    return [(i % 5, i // 5) for i in range(n)]  # grid start",
    "circle " * 300 + "the tail past token 256 that truncation drops",
    "x",
]


@pytest.fixture(scope="module")
def minilm() -> MiniLM:
    return MiniLM(backend="numpy")


@pytest.fixture(scope="module")
def fast() -> MiniLM:
    if embed_onnx.missing() is not None:
        pytest.skip("the fast-embed extra is not installed")
    return MiniLM(backend="onnx")


def test_matches_the_reference_model(minilm: MiniLM) -> None:
    got = minilm.embed(REF["sentences"])
    want = np.array(REF["vectors"], np.float32)
    want /= np.linalg.norm(want, axis=1, keepdims=True)  # the reference encodes without normalizing
    cos = (got * want).sum(1)
    assert cos.min() >= 0.999, dict(zip(REF["sentences"], cos.round(5).tolist(), strict=True))
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_batching_and_order_do_not_change_vectors(minilm: MiniLM) -> None:
    texts = REF["sentences"]
    one_by_one = np.stack([minilm.embed([t])[0] for t in texts[:5]])
    together = minilm.embed(texts[:5])
    assert np.allclose(one_by_one, together, atol=1e-5)
    assert minilm.embed([]).shape == (0, 384)


def test_is_an_embedder_and_rejects_bad_input(minilm: MiniLM) -> None:
    assert isinstance(minilm, Embedder)
    with pytest.raises(EmbedderError, match="list of texts"):
        minilm.embed("one string")  # type: ignore[arg-type]
    with pytest.raises(EmbedderError, match="not a string"):
        minilm.embed(["ok", 3])  # type: ignore[list-item]


def test_missing_weights_say_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(EmbedderError, match="cannot load MiniLM"):
        MiniLM(str(tmp_path)).embed(["x"])


def test_check_vectors_names_the_embedder() -> None:
    class Bad:
        name = "bad"
        dim = 3

        def embed(self, texts: list[str]) -> np.ndarray:
            return np.zeros((len(texts), 2))

    with pytest.raises(EmbedderError, match=r"'bad' returned shape \(1, 2\).*expected \(1, 3\)"):
        check_vectors(Bad(), ["x"], Bad().embed(["x"]))
    with pytest.raises(EmbedderError, match="NaN"):
        check_vectors(Bad(), ["x"], [[np.nan, 0, 0]])


# ---------------------------------------------------------------- the onnxruntime backend
def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out: np.ndarray = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return out


@needs_onnx
def test_onnx_matches_numpy_and_the_reference(minilm: MiniLM, fast: MiniLM) -> None:
    assert fast.backend == "onnx" and minilm.backend == "numpy"
    got, want = fast.embed(VARIED), minilm.embed(VARIED)
    cos = cosines(got, want)
    assert cos.min() >= 0.999, dict(zip(VARIED, cos.round(6).tolist(), strict=True))
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    ref = cosines(got[: len(REF["sentences"])], np.array(REF["vectors"], np.float32))
    assert ref.min() >= 0.999, ref.round(5).tolist()


@needs_onnx
def test_both_backends_truncate_at_256_tokens_alike(minilm: MiniLM, fast: MiniLM) -> None:
    head = "circle packing " * 200  # 400 tokens: both keep the first 256 (with [CLS] and [SEP])
    for e in (minilm, fast):
        a, b, short = e.embed([head + "alpha", head + "omega " * 50, "circle packing " * 10])
        assert float(a @ b) > 0.99999, e.backend  # what follows token 256 changes nothing
        assert float(a @ short) < 0.999, e.backend  # but the first 256 do count
    long_tail = [head + "omega"]
    assert float(cosines(fast.embed(long_tail), minilm.embed(long_tail))[0]) >= 0.999


@needs_onnx
def test_onnx_batches_and_shares_one_session(fast: MiniLM) -> None:
    texts = VARIED[:9]
    one_by_one = np.stack([fast.embed([t])[0] for t in texts])
    assert np.allclose(one_by_one, fast.embed(texts), atol=1e-5)  # padding to the batch's longest changes nothing
    assert np.allclose(one_by_one, MiniLM(backend="onnx", batch_size=3).embed(texts), atol=1e-5)
    assert fast.embed([]).shape == (0, 384)
    assert embed_onnx.session(fast.model_dir, load_safetensors) is fast._session  # built once per process, whoever asks


@needs_onnx
def test_the_graph_is_standard_onnx(fast: MiniLM) -> None:
    import onnx

    cfg = json.loads((Path(fast.model_dir) / "config.json").read_text())
    model = embed_onnx.build_model(load_safetensors(str(Path(fast.model_dir) / "model.safetensors")), cfg)
    onnx.checker.check_model(model, full_check=True)  # standard ops, shapes consistent, opset 17
    assert [i.name for i in model.graph.input] == list(embed_onnx.INPUTS)
    dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input]
    assert dims == [["batch", "sequence"]] * 3  # both axes dynamic


def test_backend_selection_is_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    if embed_onnx.missing() is None:
        assert MiniLM().backend == "onnx"  # auto: onnx when importable
    assert MiniLM(backend="numpy").backend == "numpy"
    assert MiniLM(backend="numpy").name == MiniLM.name == "all-MiniLM-L6-v2"  # one space for both
    with pytest.raises(EmbedderError, match="backend must be one of 'auto', 'onnx', 'numpy', got 'torch'"):
        MiniLM(backend="torch")
    for package in ("onnxruntime", "onnx"):
        with monkeypatch.context() as m:
            m.setitem(sys.modules, package, None)  # as if not installed: `import` raises ImportError
            assert embed_onnx.missing() == package
            assert MiniLM().backend == "numpy"  # auto falls back
            with pytest.raises(EmbedderError, match=rf"needs the fast-embed extra \({package} is not installed\).*"
                                                    r"pip install 'trellisdb\[fast-embed\]'"):
                MiniLM(backend="onnx")


def test_a_broken_onnxruntime_falls_back_under_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(model_dir: str, read: object) -> None:
        raise ImportError("libonnxruntime.so: cannot open shared object file", name="onnxruntime")

    monkeypatch.setattr(embed_onnx, "missing", lambda: None)  # found, but its import fails
    monkeypatch.setattr(embed_onnx, "session", broken)
    auto = MiniLM()
    assert auto.embed(["a circle"]).shape == (1, 384) and auto.backend == "numpy"
    with pytest.raises(EmbedderError, match=r"cannot import onnxruntime.*pip install 'trellisdb\[fast-embed\]'"):
        MiniLM(backend="onnx").embed(["a circle"])


# ---------------------------------------------------------------- db.embed progress
class Letters:
    """A cheap deterministic embedder: letter counts of a..d."""

    name = "letters"
    dim = 4

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return np.array([[t.count(c) + 1.0 for c in "abcd"] for t in texts], np.float32)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def summaries(db: trellisdb.Database) -> trellisdb.Database:
    with db.session(task="t", agent="a") as s:
        for i in range(7):
            s.add_node(id=f"n{i}", summary=f"attempt {i}: pack circles " + "abcd"[i % 4] * i)
    return db


def test_embed_shows_a_bar_on_a_terminal_and_can_be_silenced(summaries: trellisdb.Database,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    db = summaries
    for name in ("tty", "off", "on", "pipe", "calls"):
        db.create_space(name, embedder=Letters())
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert db.embed("tty", batch_size=3) == 7  # the default: a bar, as stderr is a terminal
    assert "embed tty:" in err.getvalue() and "/7 " in err.getvalue()
    err.seek(0), err.truncate()
    assert db.embed("off", batch_size=3, progress=False) == 7
    assert err.getvalue() == ""
    calls: list[tuple[int, int]] = []
    assert db.embed("calls", batch_size=3, progress=lambda done, total: calls.append((done, total))) == 7
    assert calls == [(3, 7), (6, 7), (7, 7)] and err.getvalue() == ""  # a callable replaces the bar
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    assert db.embed("pipe") == 7 and pipe.getvalue() == ""  # not a terminal: quiet by default
    assert db.embed("on", progress=True) == 7 and "embed on" in pipe.getvalue()  # True: shown anyway
    assert db.embed("on", progress=True) == 0  # nothing left to do


@needs_onnx
def test_a_space_embedded_by_numpy_is_searched_with_onnx(tmp_path: Path, minilm: MiniLM) -> None:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    assert isinstance(db, trellisdb.Database)
    texts = {"p1": "pack circles greedily into the unit square", "p2": "sort the list with a merge sort",
             "p3": "place circles on a hexagonal lattice"}
    with db.session(task="t", agent="a") as s:
        for i, t in texts.items():
            s.add_node(id=i, summary=t)
    db.create_space("minilm", embedder=minilm)
    assert db.embed("minilm", progress=False) == 3
    db.close()
    db = trellisdb.connect(tmp_path / "db")  # a new handle finds the space's embedder itself: MiniLM(), auto
    assert isinstance(db, trellisdb.Database)
    try:
        assert [s["model"] for s in db.spaces() if s["name"] == "minilm"] == [MiniLM.name]
        out = [r["id"] for r in db.query("RETRIEVE 2 SIMILAR TO 'circle packing' IN minilm").to_pylist()]
        assert sorted(out) == ["p1", "p3"]
        found = db._vectors._embedders[("nodes", "minilm")]
        assert isinstance(found, MiniLM) and found.backend == "onnx"
    finally:
        db.close()
