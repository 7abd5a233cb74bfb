"""The budget's search: the plans `{"budget_mb": N}` chooses among, and the
choice.

A plan is a layout (the candidate blocks, each a run of one or more of the
estimated blocks) and the blocks of it that are recomputed. For a flat
functional graph the estimated blocks are the segments between every two
cut points, and the layouts are coarser segmentations of them (about
2..n segments, "auto"'s ~sqrt(n) among them): the figures of a coarse
segment are merged from the fine ones, so one traced estimate serves every
layout. For nested blocks there is one layout, the blocks themselves.

Per layout the candidates are: nothing recomputed, each prefix of the
blocks ranked by saving per recompute cost, every block,
and every block but the one the backward meets first (whose rebuild would
come while everything else is still kept: the same peak, less recompute);
for nested blocks also every plan of them (up to `EVERY_PLAN_BLOCKS`
blocks; more, up to `WALK_BLOCKS`: the plans `_walk` finds between every
block and none), as a nested block and its parent, ranked each alone,
miss the plans between.
The candidates do not depend on the budget, and the choice is the cheapest
in recompute cost among those whose estimated training peak (activations
and the gradients alive with them) fits (else the lowest estimate), so a
smaller budget never gets a larger estimate, a budget at or below "auto"'s
estimate gets a plan estimated no higher than "auto"'s (when none fits,
the lowest, which "auto"'s is within its slack of), and no plan estimated
above no recompute is ever chosen (recomputing nothing is a candidate).
"""

import dataclasses
import itertools

from keras_gradboost.recompute.estimates import plan_bytes
from keras_gradboost.recompute.estimates import plan_layout
from keras_gradboost.recompute.estimates import without_working_buffers


# Nested blocks up to this many: every plan of them is a candidate (12
# blocks: 4095 plans, estimated in 0.23 s on a 2-core AMD EPYC); more, up
# to WALK_BLOCKS: `_walk`'s (36 blocks: 700 plans, 0.15 s; ~n(n+1) plans
# of ~n figures each, so 150 blocks took 10 s); more: the ranking's alone.
EVERY_PLAN_BLOCKS = 12
WALK_BLOCKS = 48


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan the budget can choose.

    Attributes:
        layout: index of its layout in the list given to `candidates`.
        chosen: indices of the layout's blocks that are recomputed.
        bytes: its estimated peak activation bytes (`plan_bytes`).
        flops: the estimated cost of recomputing its blocks.
        peak: its estimated training peak, activations and the gradients
            alive with them (`plan_bytes` with the gradients), or None.
    """

    layout: int
    chosen: tuple
    bytes: int
    flops: float
    peak: object = None


def groups_of(all_cuts, cuts):
    """The fine segments (indices, one per gap between `all_cuts` and one
    after the last) that each segment of the coarser cut set `cuts` spans."""
    kept = set(cuts)
    groups, current = [], []
    for index, cut in enumerate(all_cuts):
        current.append(index)
        if cut in kept:
            groups.append(tuple(current))
            current = []
    groups.append(tuple(current) + (len(all_cuts),))
    return groups


def merge(per_block, sizes, groups):
    """The figures (as in `estimate`'s `per_block`) of blocks that each run
    the fine blocks of one group in order: inside a merged block is what is
    inside its parts and the tensors passed between them, and outside
    every block is what was outside every fine block but those (the same
    figures, plan by plan, as a step traced with the merged blocks:
    test_budget.py).

    Returns:
        A dict: group index -> figures.
    """
    merged = {}
    fine_inside = set().union(*(figures["inside"] for figures in per_block.values()))
    promoted = set()  # outside every fine block, inside a merged one so far
    for index, group in enumerate(groups):
        inside, flops, weights = set(), 0.0, {}
        for position, key in enumerate(group):
            inside |= per_block[key]["inside"]
            flops += per_block[key]["flops"]
            weights.update(per_block[key].get("weights", {}))
            if key != group[-1]:  # read between two of its parts: inside it
                weights.update(per_block[key].get("after", {}))
            if position:
                inside |= {n for n in per_block[key]["input_roots"] if n in sizes}
        promoted |= inside - fine_inside
        first = per_block[group[0]]
        merged[index] = {
            "cached": sum(sizes[n] for n in inside),
            "inputs": first["inputs"],
            "flops": flops,
            "inside": inside,
            "input_roots": dict(first["input_roots"]),
            "weights": weights,
            "largest": max(per_block[key].get("largest", 0) for key in group),
            "normalized": max(per_block[key].get("normalized", 0) for key in group),
            "after": dict(per_block[group[-1]].get("after", {})),
            "before": dict(first.get("before", {})),
            # Working buffers of a backward between two of its parts: inside it.
            "workspace": max(
                [per_block[key].get("workspace", 0) for key in group]
                + [per_block[key].get("after_workspace", 0) for key in group[:-1]]
            ),
            "after_workspace": per_block[group[-1]].get("after_workspace", 0),
            "before_workspace": first.get("before_workspace", 0),
            "forward_working": first.get("forward_working", 0),
            "gradients_pile_up": first.get("gradients_pile_up"),
            "update_buffers": first.get("update_buffers", 0),
            "update_buffers_alone": first.get(
                "update_buffers_alone", first.get("update_buffers", 0)
            ),
            "update_bytes": first.get("update_bytes", 0),
            "update_bytes_in_turn": first.get("update_bytes_in_turn", 0),
        }
        last = per_block[group[-1]]
        if "outside_before" in last:
            # Made outside every block until the group's end: the fine
            # blocks' figure, less what the groups up to it hold inside
            # (the tensors passed between their parts, made before its end).
            merged[index]["outside_before"] = last["outside_before"] - sum(
                sizes[n] for n in promoted
            )
    return merged


def candidates(total, layouts, sizes, gradient_bytes=None):
    """Every plan of every layout the budget chooses among.

    Args:
        total: estimated activation bytes without recompute.
        layouts: per layout, `(figures, keys)`: the blocks' figures (as in
            `estimate`) and the keys of those that may be recomputed.
        sizes: the size of every cached tensor by name.
        gradient_bytes: bytes of all the gradients, to estimate each plan's
            training peak too (`Candidate.peak`); None: not estimated.

    Returns:
        A list of `Candidate`s, recomputing nothing first.
    """

    # Per layout, what its plans' estimates share (`plan_layout`), found once.
    bare = [plan_layout(figures) for figures, _ in layouts]
    if gradient_bytes is not None:
        trained = [plan_layout(figures, gradient_bytes) for figures, _ in layouts]

    peaks = {}  # (`_walk` weighs plans that become candidates: estimated once)

    def peak(layout, chosen):
        if gradient_bytes is None:
            return None
        key = (layout, frozenset(chosen))
        if key not in peaks:
            figures = layouts[layout][0]
            peaks[key] = plan_bytes(total, figures, sizes, chosen, gradient_bytes, trained[layout])
        return peaks[key]

    def estimate(layout, chosen):  # what a budget compares (`estimated_peak`)
        found = peak(layout, chosen)
        if found is None:
            found = plan_bytes(total, layouts[layout][0], sizes, chosen, layout=bare[layout])
        return found

    # Recomputing nothing: its training peak from the finest layout (the
    # gradients alive at a moment are counted per block, so a coarse
    # layout's reads higher).
    nothing = [peak(layout, ()) for layout in range(len(layouts))]
    found = [Candidate(0, (), total, 0.0, min(nothing) if gradient_bytes is not None else None)]
    for layout, (figures, keys) in enumerate(layouts):
        ranked = sorted(
            keys,
            key=lambda k: -(figures[k]["cached"] - figures[k]["inputs"])
            / max(figures[k]["flops"], 1.0),
        )
        prefixes = []
        chosen = []
        for key in ranked:
            if figures[key]["cached"] <= figures[key]["inputs"]:
                continue  # recomputing it alone would not save anything
            chosen.append(key)
            prefixes.append(tuple(chosen))
        prefixes.append(tuple(keys))  # every block
        # Every block but the one the backward meets first: its rebuild
        # would come while everything else is still kept, so the same peak
        # for less recompute. (Blocks inside it still pay: recomputed at the
        # top, they free their insides until their own replay.)
        top = [k for k in keys if figures[k].get("parent") is None]
        last = max(top, key=list(figures).index, default=None)
        prefixes.append(tuple(k for k in keys if k != last))
        if len(top) < len(keys):  # nested blocks: what the ranking misses
            if len(keys) <= EVERY_PLAN_BLOCKS:
                prefixes += [
                    c for n in range(1, len(keys)) for c in itertools.combinations(keys, n)
                ]
            elif len(keys) <= WALK_BLOCKS:
                prefixes += _walk(figures, keys, lambda chosen: estimate(layout, chosen))
        for prefix in dict.fromkeys(tuple(sorted(p)) for p in prefixes):
            if not prefix:
                continue
            found.append(
                Candidate(
                    layout,
                    prefix,
                    plan_bytes(total, figures, sizes, prefix, layout=bare[layout]),
                    sum(figures[k]["flops"] for k in prefix),
                    peak(layout, prefix),
                )
            )
    return found


def _walk(figures, keys, estimate):
    """Plans between recomputing every block of a nested layout and none.

    Ranked each alone, a nested block and its parent miss the plans in
    between: a keras-hub GPT-2 backbone of 2 layers (width 256, sequences
    of 128, batch 16) had none between 61.6 MiB at 8.46 GFLOP of
    recompute and 78.8 at 5.74, where 67.6 at 7.36 and 69.6 at 6.27 are
    two. Two walks from every block down to none, each step dropping one
    block: the one that adds the fewest bytes to the estimate
    (`estimate(chosen)`; small steps, from the lowest peak on), and the
    one that costs the most recompute per byte it adds (large steps),
    the free ones first in both. Returns every plan a step weighed (each
    one block off a plan of the walks; theirs among them): at most n(n+1)
    for n blocks.
    """
    known = {}

    def estimated(chosen):
        if chosen not in known:
            known[chosen] = estimate(chosen)
        return known[chosen]

    for per_flop in (False, True):
        chosen = tuple(keys)
        while chosen:
            now = estimated(chosen)
            best = None
            for key in chosen:
                rest = tuple(k for k in chosen if k != key)
                added = max(estimated(rest) - now, 0)
                saved = max(figures[key]["flops"], 1.0)
                rank = (added / saved if per_flop else added, -saved)
                if best is None or rank < best[0]:
                    best = (rank, rest)
            chosen = best[1]
    return list(known)


def peaks_without_buffers(found, layouts, gradient_bytes):
    """Per plan of `found` (`Candidate`s, whose `layout` indexes `layouts`:
    per layout `(total, figures, sizes)`), its training peak estimated
    without the backward's working buffers
    (`estimates.without_working_buffers`): where the convolutions allocate
    none. Recomputing nothing, at its lowest over the layouts, as
    `candidates` estimates it with them. A list of ints, bytes (re-estimating
    MobileNetV2's 1609 plans at 64x64: 0.28 s)."""
    unbuffered = {}

    def peak(index, chosen):
        if index not in unbuffered:
            total, figures, sizes = layouts[index]
            free = without_working_buffers(figures)
            unbuffered[index] = total, free, sizes, plan_layout(free, gradient_bytes)
        total, free, sizes, layout = unbuffered[index]
        return plan_bytes(total, free, sizes, chosen, gradient_bytes, layout)

    nothing = None
    found_peaks = []
    for c in found:
        if not c.chosen:
            if nothing is None:
                nothing = min(peak(index, ()) for index in range(len(layouts)))
            found_peaks.append(nothing)
        else:
            found_peaks.append(peak(c.layout, c.chosen))
    return found_peaks


def estimated_peak(candidate):
    """What a budget and "auto" compare: the candidate's estimated training
    peak, or its activations where it has none."""
    return candidate.bytes if candidate.peak is None else candidate.peak


def budget_choice(budget_bytes, found):
    """The plan for a budget: the cheapest to recompute (then the lowest
    estimate, then the fewest blocks) of the `found` candidates whose
    estimated training peak (`estimated_peak`) fits `budget_bytes`, or,
    when none fits, the lowest estimate (recomputing nothing when nothing
    saves; estimated no higher than "auto"'s plan).

    Returns:
        `(candidate, fits)`.
    """
    fitting = [c for c in found if estimated_peak(c) <= budget_bytes]
    if fitting:
        return min(fitting, key=lambda c: (c.flops, estimated_peak(c), len(c.chosen))), True
    return min(found, key=lambda c: (estimated_peak(c), c.flops, len(c.chosen))), False


def auto_choice(total, found, min_saving=0.1, slack=0.0):
    """The plan "auto" takes: of the `found` candidates that recompute
    something, save at least `min_saving` of the activation memory `total`
    and lower the training peak, the cheapest to recompute (equal costs up
    to rounding: the lower estimate, then the fewer blocks) whose
    estimated training peak (`estimated_peak`) is at most `slack` times
    `total` above the lowest of them, and at least that much below no
    recompute's (`found[0]`; the lowest itself always qualifies);
    recomputing nothing when none saves. With `slack=0`, the lowest
    estimated training peak.

    The training peak counts the gradients alive with the activations, so
    where a model's last blocks hold large weights (ResNet50's last stage),
    "auto" prefers plans whose last segments are short. (The gate and the
    slack are shares of the activations. A term every plan's peak shares
    (every gradient held to the end of the backward) leaves the choice as
    it is, and where the plans' peaks otherwise scale with the batch, the
    choice at the global batch is the one at a replica's share of it.
    Gradients alive at different moments in different plans, and bytes
    that do not scale with the batch, can still change it.)
    """
    saving = [
        c
        for c in found
        if c.chosen
        and c.bytes <= (1.0 - min_saving) * total
        and estimated_peak(c) < estimated_peak(found[0])
    ]
    if not saving:
        return found[0]
    lowest = min(estimated_peak(c) for c in saving)
    # Never recompute for a saving smaller than the slack.
    near = min(lowest + slack * total, max(lowest, estimated_peak(found[0]) - slack * total))
    window = [c for c in saving if estimated_peak(c) <= near]
    # Plans of the same blocks in other layouts sum their costs in another
    # order: equal up to rounding, the lower estimate.
    cheapest = min(c.flops for c in window) * (1 + 1e-9)
    return min(
        (c for c in window if c.flops <= cheapest),
        key=lambda c: (estimated_peak(c), len(c.chosen)),
    )
