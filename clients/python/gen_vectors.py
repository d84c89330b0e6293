"""Writes balancer-common/hint-vectors.json from this (independent) Python implementation.

Run from the repository root: python3 clients/python/gen_vectors.py
"""
import json
import pathlib

from balancer_hint import bucket, fnv1a64, ports

PREAMBLE = "You are a careful assistant. Answer in the language of the question. " * 30
CASES = [
    ("", 16384, 16384, 256),
    ("a", 16384, 16384, 256),
    ("foobar", 16384, 16384, 256),
    ("You are a helpful assistant.", 16384, 16384, 256),
    ("Résumé: 日本語のテキスト ✓\n", 16384, 16384, 256),
    (PREAMBLE, 16384, 16384, 256),
    ("You are a helpful assistant.", 20000, 1000, 300),
    ("system: summarise the document below", 16384, 16384, 64),
]

vectors = []
for prefix, start, span, buckets in CASES:
    vectors.append({
        "prefix": prefix,
        "fnv1a64": f"{fnv1a64(prefix.encode('utf-8')):016x}",
        "start": start,
        "span": span,
        "buckets": buckets,
        "bucket": bucket(prefix, buckets),
        "first_ports": list(ports(prefix, start, span, buckets))[:3],
    })
root = pathlib.Path(__file__).resolve().parents[2]
out = root / "balancer-common" / "hint-vectors.json"
out.write_text(json.dumps({"scheme": "fnv1a64-mod-buckets-v1", "vectors": vectors},
                          ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
print(f"wrote {len(vectors)} vectors to {out}")
