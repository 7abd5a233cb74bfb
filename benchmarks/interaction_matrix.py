"""The interaction matrix's full product, or a seeded sample of it.

`tests/test_interactions.py` runs a pairwise design (20 cells) of its
factors in CI; this script runs every one of the 60,480 valid cells of the
full product (hours on a 2-core CPU), or a seeded random sample, with the
same checks against the same independent references, and prints one row
per cell and a summary. The factors, references and checks are the test
module's own (imported, not copied), so the two never disagree.

    python benchmarks/interaction_matrix.py [--sample N] [--seed S]
        [--shard I/N] [--failures-only]

`--sample N` runs N cells drawn without replacement (seeded by `--seed`);
`--shard I/N` runs every N-th cell from the I-th (0-based), to split the
full product over several processes or machines. Exit status: 0 when every
cell run equals its reference, 1 when one does not, 2 for a bad argument.
"""

import argparse
import itertools
import os
import random
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests")
sys.path.insert(0, os.path.abspath(TESTS))

import conftest  # noqa: E402,F401  (splits the CPU into two logical devices first)
import test_interactions as matrix  # noqa: E402


def full_product():
    """Every valid cell of the matrix's factors, in a fixed order."""
    names = list(matrix.FACTORS)
    cells = []
    for values in itertools.product(*matrix.FACTORS.values()):
        row = dict(zip(names, values))
        if matrix.allowed(row):
            cells.append(matrix.Cell(**row))
    return cells


def _shard(text):
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N, e.g. 0/4; received {text!r}")
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"expected 0 <= I < N; received {text!r}")
    return index, count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=None, help="run N random cells")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard", type=_shard, default=(0, 1), help="I/N")
    parser.add_argument("--failures-only", action="store_true")
    args = parser.parse_args(argv)
    cells = full_product()
    if args.sample is not None:
        if not 0 < args.sample <= len(cells):
            parser.error(f"--sample must be in 1..{len(cells)}; received {args.sample}")
        cells = random.Random(args.seed).sample(cells, args.sample)
    index, count = args.shard
    cells = cells[index::count]
    print(f"{len(cells)} of the {len(full_product())} cells of "
          + " x ".join(f"{n} {len(v)}" for n, v in matrix.FACTORS.items()), flush=True)
    failed, start = [], time.perf_counter()
    for number, cell in enumerate(cells, 1):
        try:
            found, figures = matrix.check(cell)
            messages = [message for _, message in found]
        except Exception as error:  # a crash is a finding, not the end of the run
            messages, figures = [f"{type(error).__name__}: {error}"], {}
        if messages:
            failed.append(cell.name)
        if messages or not args.failures_only:
            print(f"{number:5d} {'FAIL' if messages else 'ok  '} {cell.name}"
                  f"  rel {figures.get('rel', float('nan')):.1e}"
                  f"  updates {figures.get('updates', '?')}  " + "; ".join(messages),
                  flush=True)
    minutes = (time.perf_counter() - start) / 60
    print(f"{len(cells) - len(failed)} of {len(cells)} cells equal their reference "
          f"({minutes:.1f} min)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
