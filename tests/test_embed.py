"""The offline MiniLM embedder matches the reference sentence-transformers model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trellisdb.embed import Embedder, EmbedderError, MiniLM, check_vectors

REF = json.loads((Path(__file__).parent / "fixtures" / "minilm_reference.json").read_text())


@pytest.fixture(scope="module")
def minilm() -> MiniLM:
    return MiniLM()


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
