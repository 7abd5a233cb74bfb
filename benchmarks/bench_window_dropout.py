"""Accumulation with Dropout: the step time of drawing each micro-batch's
rows of the large batch's masks (`window_dropout`, the default) against
drawing masks of its own per micro-batch (what accumulation did before).

In one process, pairs of back-to-back `fit`s of `--steps` steps in
alternating order (`fit_rounds.paired`, tf.data autotuning off); the
median ratio over `--rounds` rounds with a bootstrap 95% CI, and an A/A
row (masks of their own against themselves). Models: a keras-hub
backbone with a per-token head as `bench_recompute.py` builds it (width
256, 4 heads, sequences of 128, dropout 0.1), Adam, float32,
`accumulate_steps=2`, micro-batches of `--batch`.

    python benchmarks/bench_window_dropout.py [--hub bert] [--rounds 8]
"""

import argparse
import os
import sys
import warnings
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hub", default="bert", choices=["bert", "gpt2"])
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size")
    parser.add_argument("--steps", type=int, default=6, help="micro-batches per timed fit")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)

    import tensorflow as tf

    import keras
    from bench_recompute import hub_data
    from bench_recompute import hub_model
    from fit_rounds import paired
    from fit_rounds import ratio
    from fit_rounds import step_ms
    from keras_gradboost import window_dropout

    def build(window_masks):
        model = hub_model(args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the masks-of-their-own warning
            with mock.patch.object(
                window_dropout.WindowDraws, "for_model",
                window_dropout.WindowDraws.for_model if window_masks else lambda model: None,
            ):
                model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True), accumulate_steps=2)
                model._ensure_accumulator()  # makes the WindowDraws (or not) now
        assert (model._gradboost.window_draws is not None) == window_masks
        return model

    x, y = hub_data(args)
    options = tf.data.Options()
    options.autotune.enabled = False
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat().prefetch(2)
    ds = ds.with_options(options)
    own = [build(False), build(False)]
    window = build(True)
    times = paired(
        {"aa": [((own[0], []), (own[1], []))], "window": [((own[0], []), (window, []))]},
        ds, args.steps, args.rounds,
    )
    print(
        f"Accumulation with Dropout: keras-hub {args.hub} (dropout 0.1), accumulate_steps=2, "
        f"micro-batches of {args.batch}, Adam, float32; {args.rounds} paired rounds of "
        f"{args.steps}-step fits. ratio: median of b / a [bootstrap 95% CI]."
    )
    for name, label in (("aa", "A/A: masks of their own / themselves"),
                        ("window", "window's masks / masks of their own")):
        median, (low, high) = ratio(times[name])
        a, b = step_ms(times[name])
        print(f"  {label:40s} {median:.3f}x [95% CI {low:.3f}-{high:.3f}; "
              f"{a:.0f} vs {b:.0f} ms/step]")


if __name__ == "__main__":
    main()
