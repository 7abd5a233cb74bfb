"""The peak of the bytes a run's allocations requested, from the TensorFlow
profiler's memory events.

The allocator's own peak (`tf.config.experimental.get_memory_info`) counts
whole chunks: TensorFlow's BFC allocator gives a request over half of a free
chunk the whole chunk unless 128 MiB would be left, so one buffer can read
as nearly twice its size. This replays the allocations and deallocations the
profiler records during the run, in order, each with the bytes it requested
(a deallocation carries its allocation's), and keeps the largest total above
the level at the start: what the run adds at once. A buffer from before the
run that the run frees counts as freed: an optimizer's update that copies a
variable still being read (copy-on-write) allocates the new buffer and frees
the old one, no net growth.
"""

import glob
import tempfile

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2


def requested_peak(run):
    """Runs `run()` under the profiler; returns the peak of the requested
    bytes allocated during it above the level at its start (an int). Every
    allocator's events are summed (on a GPU, host and device together).

    Raises:
        RuntimeError: the profiler recorded no memory events, or an event
            without its size.
    """
    events = memory_events(run)
    return _peak([(t, allocation, s.get("addr"), s.get("requested_bytes"))
                  for t, allocation, s in events])


def alive_at_peak(run):
    """Runs `run()` under the profiler; returns `(peak, alive)`:
    `requested_peak`'s peak, and the allocations made during the run that
    are alive at it, as `(requested bytes, tf_op)` pairs, largest first. A
    copy that replaced a buffer from before the run (an optimizer's
    copy-on-write) is among them, its old buffer's free counted in the
    peak; `tf_op` is None for an allocation outside any op."""
    return _alive_at_peak(memory_events(run))


def _alive_at_peak(events):
    """`alive_at_peak` of `memory_events`' events."""
    return _peak(
        [(t, allocation, s.get("addr"), s.get("requested_bytes"), s.get("tf_op"))
         for t, allocation, s in events],
        contents=True,
    )


def memory_events(run):
    """Runs `run()` under the profiler; returns `(time, is_allocation,
    stats)` per allocation and deallocation, in time order, `stats` by name
    (`addr`, `requested_bytes`, `tf_op`, `region_type`, ...)."""
    with tempfile.TemporaryDirectory(prefix="requested_peak_") as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            run()
        finally:
            tf.profiler.experimental.stop()
        (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        event_names = {k: v.name for k, v in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                kind = event_names.get(event.metadata_id)
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {stat_names.get(s.metadata_id): _value(s, stat_names) for s in event.stats}
                time_ps = line.timestamp_ns * 1000 + event.offset_ps
                events.append((time_ps, kind == "MemoryAllocation", stats))
    events.sort(key=lambda e: e[0])
    return events


def _value(stat, names):
    if stat.HasField("ref_value"):  # a string kept once in the plane
        return names.get(stat.ref_value)
    if stat.HasField("str_value"):
        return stat.str_value
    return stat.uint64_value if stat.HasField("uint64_value") else stat.int64_value


def _peak(events, contents=False):
    """The peak level of `(time, is_allocation, address, requested bytes)`
    memory events (`memory_events`) above the start. A buffer
    allocated during the run is freed by its own size; one from before it
    by the size its deallocation event carries. With `contents`, events
    carry their op too, and the result is `(peak, the buffers allocated
    during the run alive at it as (bytes, op) pairs, largest first)`."""
    if not events:
        raise RuntimeError(
            "The profiler recorded no memory events: the allocator keeps no "
            "statistics (on a CPU set TF_CPU_ALLOCATOR_USE_BFC=true) or the "
            "run allocated nothing."
        )
    alive, level, peak, at = {}, 0, 0, {}
    for _, allocation, address, size, *op in events:
        if allocation:
            alive[address] = (size, op[0] if op else None)
        else:
            size = alive.pop(address, (size,))[0]
        if size is None:
            raise RuntimeError(
                "A profiler memory event has no requested_bytes: this "
                "TensorFlow's profiler cannot give the requested peak."
            )
        level += size if allocation else -size
        if level > peak:
            peak = level
            if contents:
                at = dict(alive)
    if contents:
        return peak, sorted(at.values(), key=lambda pair: -pair[0])
    return peak
