"""Build a MiniLM-sized cross-encoder for the rerank phase of ``inferd bench``, with nothing downloaded.

No cross-encoder ships in this project's packages, and nothing may be fetched at run time. The rerank phase
measures cost, not ranking quality, so this script takes the packaged all-MiniLM-L6-v2 encoder (the same
architecture as cross-encoder/ms-marco-MiniLM-L-6-v2: 6 layers, hidden 384, 12 heads) and adds a one-label
classification head with a fixed seed. Its pairs/s is what a real MiniLM cross-encoder costs; its scores
mean nothing.

    python bench/minilm_cross_encoder.py /tmp/minilm-ce
    inferd bench --phases rerank --rerank-model /tmp/minilm-ce
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inferd.bench.cross_encoder import build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder to write (created)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"{args.out} exists and is not empty", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    print(build(args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
