"""Plan one RheoSampling draft tree with a synthetic draft and look at it.

The draft is a fixed random bigram model over a 24-word vocabulary (its next-token
logits depend on the last token only), so no model download is needed. The script
prints the text IR after every pass (``PrintAfterAll``) and draws the final tree.

    python examples/plan_synthetic.py            # writes tree.png
    python examples/plan_synthetic.py out.png --seed 3 --depth 4
"""

from __future__ import annotations

import argparse

import torch

from rheoplan import SamplingConfig, TreeConfig, plan_tree
from rheoplan.dump import draw_png
from rheoplan.ir_text import to_text
from rheoplan.pipeline import PassTiming, PrintAfterAll

WORDS = ("the cat dog sat on a mat and ran to far away . it was very happy when sun "
         "rose over hill <eos>").split()


class WordTokenizer:
    """A toy tokenizer: token id i is WORDS[i]."""

    def decode(self, ids: list[int]) -> str:
        return " ".join(WORDS[i] for i in ids)


def bigram_draft(seed: int, sharpness: float = 2.5):
    """``draft(tree, nodes) -> logits [B, n, V]``: row ``token[node]`` of a random table."""
    table = torch.randn(len(WORDS), len(WORDS), generator=torch.Generator().manual_seed(seed)) * sharpness

    def draft(tree, nodes):
        last = torch.gather(tree.token, 1, nodes.clamp(min=0))
        return table[last]

    return draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("png", nargs="?", default="tree.png", help="where to write the picture (default tree.png)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--frontier", type=int, default=2)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--rheostat", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--quiet", action="store_true", help="print only the final IR")
    args = ap.parse_args()

    cfg = TreeConfig(depth=args.depth, frontier=args.frontier, slots=args.slots, budget=args.budget,
                     rheostat=args.rheostat, support=len(WORDS))
    sampling = SamplingConfig(temperature=args.temperature)
    tok = WordTokenizer()
    print(f"# {cfg}\n# {sampling}\n# root token: {WORDS[0]!r}, seed {args.seed}\n")
    timing = PassTiming()
    instruments = [timing] if args.quiet else [PrintAfterAll(tokenizer=tok), timing]
    tree = plan_tree(bigram_draft(args.seed), [0], tree=cfg, sampling=sampling, seed=args.seed,
                     instruments=instruments)
    if args.quiet:
        print(to_text(tree, tokenizer=tok))
    print()
    print(timing.summary())
    lin = tree.linear
    n = int(lin.n[0])
    print(f"\nverify input ({n} tokens, linear order): "
          + " ".join(f"{WORDS[int(t)]}@{int(p)}" for t, p in zip(lin.token[0, :n], lin.position[0, :n])))
    draw_png(tree, args.png, tokenizer=tok, b=0)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
