"""Embedder throughput: trellisdb's numpy MiniLM vs the reference sentence-transformers model.

    .venv/bin/python benchmarks/bench_embed.py [--texts 512] [--smoke]
    .venv/bin/python benchmarks/bench_embed.py --reference-python /tmp/ref/bin/python

The reference runs in another interpreter that has sentence-transformers
(and torch), since trellisdb's own environment has neither; without one the
figure is reported alone. Texts are OpenEvolve-like summaries and code
snippets of mixed lengths. Also checks both agree (cosine) on those texts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from trellisdb.embed import MiniLM, minilm_dir  # noqa: E402

REFERENCE = """
import json, sys, time
from sentence_transformers import SentenceTransformer
texts = json.load(open(sys.argv[2]))
m = SentenceTransformer(sys.argv[1], device="cpu")
m.encode(texts[:8])
t0 = time.perf_counter(); v = m.encode(texts, batch_size=32, normalize_embeddings=True); dt = time.perf_counter() - t0
json.dump({"seconds": dt, "vectors": v.tolist()}, open(sys.argv[3], "w"))
"""


def texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    words = ["circle", "packing", "radius", "greedy", "lattice", "hexagonal", "optimize", "scipy", "minimize", "border", "overlap", "penalty", "evaluator", "timeout", "crossover", "mutation", "parent", "child", "score", "improve", "constraint", "square"]
    out = []
    for i in range(n):
        k = int(rng.integers(4, 120))
        body = " ".join(rng.choice(words, k))
        out.append(f"def step_{i}():  # {body}" if i % 3 == 0 else body.capitalize() + ".")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--texts", type=int, default=None, help="texts to embed (default 512; smoke 32)")
    ap.add_argument("--reference-python", default=None, help="an interpreter with sentence-transformers")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    n = args.texts or (32 if args.smoke else 512)
    xs = texts(n)
    e = MiniLM()
    e.embed(xs[:8])  # load the weights
    t0 = time.perf_counter()
    mine = e.embed(xs)
    dt = time.perf_counter() - t0
    print(f"trellisdb MiniLM (numpy): {n / dt:8.1f} texts/s ({n} texts, {os.cpu_count()} CPUs)")
    if args.reference_python:
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = os.path.join(tmp, "in.json"), os.path.join(tmp, "out.json")
            with open(src, "w") as fh:
                json.dump(xs, fh)
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            subprocess.run([args.reference_python, "-c", REFERENCE, minilm_dir(), src, dst], check=True, env=env)
            with open(dst) as fh:
                ref = json.load(fh)
        ref_v = np.array(ref["vectors"], np.float32)
        cos = (mine * ref_v).sum(1)
        print(f"sentence-transformers (torch):  {n / ref['seconds']:8.1f} texts/s")
        print(f"ratio: {(n / dt) / (n / ref['seconds']):.2f}x the reference's throughput; cosine min {cos.min():.5f}")
    else:
        print("reference: not measured (pass --reference-python with an interpreter that has sentence-transformers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
