"""The kernel choices against Keras' own kernels: step time and training
memory. `--setting depthwise=native` (the default): `compile(depthwise=
"native")` against Keras' grouped convolution, on models whose depthwise
convolutions are grouped `Conv2D`s (keras.applications ConvNeXt);
`--setting depthwise=chunked` the same for `compile(depthwise="chunked")`.
`--setting pointwise=matmul`: `compile(pointwise="matmul")` against the
1x1 convolutions (MobileNetV2, EfficientNetB0, ResNet50). `--precision P`
compiles both sides with `precision=P`.

Step time: in one process per model, pairs of back-to-back `fit`s of
`--steps` steps (Keras' path, then native, in alternating order;
`fit_rounds.paired`, tf.data autotuning off), the median ratio over
`--rounds` rounds with a bootstrap 95% CI, and an A/A row (Keras' path
against itself).

Training memory: the allocator peak of `bench_recompute.py`'s worker (no
recompute), one process per configuration, `--memory-rounds` rounds: the
peak of the timed steps above the level before them.

    python benchmarks/bench_depthwise.py [--models ConvNeXtTiny] [--rounds 8]
    python benchmarks/bench_depthwise.py --setting pointwise=matmul \
        --models MobileNetV2,EfficientNetB0

`--splits 97,98,193`: no timing; for each channel count, the splits
"chunked" tries (`depthwise.chunk_splits`) and whether each gives Keras'
values and gradients bit for bit on this machine (`_bitwise_equal`, as
at a layer's first trace; inputs (4, 4, 4, C), a 7x7 kernel).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

HERE = os.path.dirname(os.path.abspath(__file__))


def time_worker(args):
    import numpy as np
    import tensorflow as tf

    import keras
    import keras_gradboost as kgb
    from fit_rounds import paired
    from fit_rounds import ratio

    def build(setting):
        keras.utils.set_random_seed(0)
        shape = (args.pixels, args.pixels, 3)
        built = getattr(keras.applications, args.time_worker)(
            input_shape=shape, weights=None, classes=10)
        model = kgb.boost(built)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy",
                          precision=args.precision, **{option: setting})
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 2, args.pixels, args.pixels, 3)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch * 2,))
    options = tf.data.Options()
    options.autotune.enabled = False
    ds = (tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True)
          .repeat().with_options(options))
    option, value = args.setting.split("=")
    keras_path = build(None)
    label = f'{option}="{value}" / Keras\' path'
    pairs = {
        "A/A: Keras' path / itself": [((keras_path, []), (build(None), []))],
        label: [((keras_path, []), (build(value), []))],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = paired(pairs, ds, args.steps, args.rounds)
    layers = len(getattr(pairs[label][0][1][0].train_plan, f"{option}_layers"))
    for label, pair_times in times.items():
        value, (low, high) = ratio(pair_times)
        a = 1000 * statistics.median(t[0] for t in pair_times)
        b = 1000 * statistics.median(t[1] for t in pair_times)
        print(f"  {label:<36} {value:6.3f}x [95% CI {low:.3f}-{high:.3f}; "
              f"{a:.0f} vs {b:.0f} ms/step]")
    print(f"  layers run by the other kernel: {layers}")


def memory(name, setting, args):
    command = [sys.executable, os.path.join(HERE, "bench_recompute.py"), "--worker", "baseline",
               "--app", name, "--batch", str(args.batch), "--pixels", str(args.pixels),
               "--steps", "2", "--reps", "2"] + (
                   [f"--{args.setting.split('=')[0]}", setting] if setting else []) + (
                   ["--precision", args.precision] if args.precision else [])
    out = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:100]}


def splits(counts):
    import keras

    from keras_gradboost import depthwise

    print('Splits depthwise="chunked" tries, checked bit for bit against Keras\' '
          "grouped convolution on this machine: inputs (4, 4, 4, C), 7x7 kernel, "
          "\"same\" padding.")
    for channels in counts:
        layer = keras.layers.Conv2D(channels, 7, groups=channels, padding="same")
        layer.build((None, 4, 4, channels))
        checked = [
            (sizes, depthwise._bitwise_equal(
                layer.convolution_op, (4, 4, 4, channels), layer.kernel.shape, sizes))
            for sizes in depthwise.chunk_splits(channels)
        ]
        runs = next((sizes for sizes, equal in checked if equal), "Keras' way")
        said = ", ".join(f"{sizes} {'equal' if equal else 'differs'}" for sizes, equal in checked)
        print(f"  {channels:4d}: {said} -> runs {runs}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="ConvNeXtTiny")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--memory-rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--pixels", type=int, default=64)
    parser.add_argument("--setting", default="depthwise=native",
                        choices=["depthwise=native", "depthwise=chunked", "pointwise=matmul"])
    parser.add_argument("--precision", choices=["mixed_bfloat16", "mixed_float16"],
                        help="compile(precision=P) on both sides")
    parser.add_argument("--splits", help="channel counts: check the splits, no timing")
    parser.add_argument("--time-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.splits:
        return splits([int(count) for count in args.splits.split(",")])
    if args.time_worker:
        return time_worker(args)
    mib = 2**20
    option, value = args.setting.split("=")
    print(f"{option}=\"{value}\" against Keras' own kernels: keras.applications, "
          f"weights=None, {args.pixels}x{args.pixels}, batch {args.batch}, Adam, "
          f"{args.precision or 'float32'}, no XLA; {os.cpu_count()} CPUs.")
    for name in args.models.split(","):
        print(f"{name}: step time, {args.rounds} paired rounds of {args.steps}-step fits")
        command = [sys.executable, __file__, "--time-worker", name, "--rounds", str(args.rounds),
                   "--steps", str(args.steps), "--batch", str(args.batch),
                   "--pixels", str(args.pixels), "--setting", args.setting] + (
                       ["--precision", args.precision] if args.precision else [])
        out = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=HERE)
        lines = [line for line in out.stdout.splitlines() if line.startswith("  ")]
        print("\n".join(lines) or f"  fails: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
        if args.memory_rounds < 1:
            continue
        peaks = {None: [], value: []}
        for r in range(args.memory_rounds):
            for setting in ((None, value) if r % 2 == 0 else (value, None)):
                peaks[setting].append(memory(name, setting, args))
        errors = [p["error"] for runs in peaks.values() for p in runs if "error" in p]
        if errors:
            print(f"  memory fails: {errors[0]}")
            continue
        keras_peak = statistics.median(p["train_bytes"] for p in peaks[None])
        other_peak = statistics.median(p["train_bytes"] for p in peaks[value])
        print(f"  training peak ({args.memory_rounds} processes each): Keras' path "
              f"{keras_peak / mib:.0f} MiB, {value} {other_peak / mib:.0f} MiB, "
              f"{other_peak / keras_peak:.2f}x")


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
