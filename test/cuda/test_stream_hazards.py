"""What a GPU's streams and caching allocator would break, checked on a CPU with a
stand-in for the stream API (``dynamicemb_testing.streams``).

- A prefetch's lookups are made on its side stream and read by the training stream
  until the backward: each tensor is ``record_stream``-ed on the training stream when
  the forward takes it, else the allocator could hand its memory to the side stream's
  next allocation while the backward still reads it.
- A table grown on some stream lets go of its old arrays while that stream's copies
  still read them: they are recorded on it.
- A host read or write of a counter that kernels advance (a clock, a step, a size,
  the outcome totals) first waits for every stream whose kernels were handed it, not
  only for the current stream.
"""

import torch

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbTableOptions
from dynamicemb.embedding.streams import StreamOrder, tensors_in
from dynamicemb.table import ScoredHashTable
from dynamicemb.table.device_counts import DeviceCounters, DeviceTotals
from dynamicemb_testing.cuda_emulation import emulated_cuda
from dynamicemb_testing.streams import StreamRecorder


def _held(tensors, recorded) -> bool:
    ids = {id(t) for t in recorded}
    return all(id(t) in ids for t in tensors)


def test_a_prefetched_lookup_is_recorded_on_the_stream_that_reads_it():
    with emulated_cuda():
        module = BatchedDynamicEmbeddingTables(
            [DynamicEmbTableOptions(dim=4, max_capacity=256, caching=True,
                                    local_hbm_for_values=4 * 4 * 64)], learning_rate=0.1)
        streams = StreamRecorder("prefetch")
        module._step.stream_order = StreamOrder(module.device, streams)
        ids, offsets = torch.tensor([1, 5, 5, 9, 1]), torch.tensor([0, 2, 5])
        module.prefetch(ids, offsets)
        made = list(tensors_in(module._step.prefetched[0].lookups))
        assert len(made) > 5 and not streams.records
        streams.current = "train"
        module(ids, offsets).sum().backward()
    assert _held(made, streams.recorded_on("train"))
    assert not streams.recorded_on("prefetch")


def test_a_grown_tables_old_arrays_are_recorded_on_the_growing_stream():
    with emulated_cuda() as kernels:
        kernels.stream_api = StreamRecorder("prefetch")
        table = ScoredHashTable(capacity=32, bucket_capacity=16, max_capacity=256, value_dim=4)
        old = [*table._memory.meta, table._memory.values]
        table.find_or_insert(torch.arange(200))
        assert table.capacity() > 32
    assert _held(old, kernels.stream_api.recorded_on("prefetch"))


def test_counters_are_read_and_written_after_every_stream_that_advanced_them():
    streams = StreamRecorder("prefetch")
    counters = DeviceCounters([0, 0], torch.device("cpu"), streams)
    counters.on_device().add_(1)  # a prefetch's kernels
    streams.current = "train"
    assert counters.values() == [1, 1] and streams.waits == [("train", "prefetch")]
    counters.on_device()
    streams.current = "prefetch"
    counters.on_device()
    streams.current = "host"
    counters.set(0, 7)  # read (after both), then written by the next on_device
    assert streams.waits[1:] == [("host", "train"), ("host", "prefetch")]
    streams.current = "train"
    assert counters.on_device().tolist() == [7, 1]
    assert streams.waits[3:] == []  # nothing advanced it since the host's read


def test_totals_are_taken_after_every_stream_that_added_to_them():
    streams = StreamRecorder("prefetch")
    totals = DeviceTotals(3, torch.device("cpu"), streams)
    totals.tensor[1] += 2
    streams.current = "train"
    totals.tensor[0] += 1
    streams.current = "host"
    assert totals.take("table") == [1, 2, 0]
    assert streams.waits == [("host", "prefetch"), ("host", "train")]
    assert totals.take("table") == [0, 0, 0] and len(streams.waits) == 2
