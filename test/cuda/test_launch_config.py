"""How the CUDA backend launches and loads its kernels, checked without a GPU: the
fused update's shared memory at every dim up to the backend's maximum, the refusal
beyond it, and the device a kernel module is compiled and loaded on."""


import pytest
import torch

from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbOptimType, DynamicEmbTableOptions
from dynamicemb.ops import cuda as cuda_backend
from dynamicemb.embedding.streams import StreamOrder
from dynamicemb.ops.cuda import MAX_DIM, CudaKernels
from dynamicemb_testing.cuda_emulation import emulated_cuda
from dynamicemb_testing.streams import StreamRecorder

SHARED_WITHOUT_OPT_IN = 48 * 1024


def _train_step(dim: int, kernels) -> None:
    module = BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=dim, max_capacity=64)],
        optimizer=DynamicEmbOptimType.ADAM, learning_rate=0.1)
    ids = torch.tensor([3, 5, 3, 9])
    module(ids, torch.tensor([0, 2, 4])).sum().backward()


@pytest.mark.parametrize("dim", [8, 128, 1536, 1537, 4096, MAX_DIM])
def test_fused_update_fits_shared_memory_at_every_dim(dim):
    with emulated_cuda() as kernels:
        _train_step(dim, kernels)
    updates = [c for c in kernels.configs if c[0] == "demb_fused_update"]
    assert updates, "the step ran no fused update"
    for _, threads, block, shared in updates:
        assert block % 32 == 0 and 32 <= block <= 256
        assert shared == (block // 32) * dim * 4 <= SHARED_WITHOUT_OPT_IN


def test_dim_above_the_maximum_is_refused_at_construction():
    with emulated_cuda():
        with pytest.raises(ValueError, match=f"at most {MAX_DIM}"):
            BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=MAX_DIM + 1,
                                                                  max_capacity=64)])
    # the CPU kernels have no such limit
    BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(dim=MAX_DIM + 1, max_capacity=16)])


class _DeviceRecorder:
    """Stands in for the two parts of CuPy that ``CudaKernels`` uses to load code
    (``cuda.Device`` as a context, ``RawModule``): it records which device is
    current when a module is created and when a function is taken from it, which is
    when CuPy compiles and loads the module."""

    def __init__(self) -> None:
        self.current = 0
        self.events = []
        recorder = self

        class Device:
            def __init__(self, index):
                self.index = index

            def __enter__(self):
                self.saved, recorder.current = recorder.current, self.index

            def __exit__(self, *exc):
                recorder.current = self.saved

        class RawModule:
            def __init__(self, code, options):
                recorder.events.append(("module", recorder.current))

            def get_function(self, name):
                recorder.events.append(("load " + name, recorder.current))
                return name

        self.cuda = type("cuda", (), {"Device": Device})
        self.RawModule = RawModule


def test_kernels_compile_and_load_on_the_tables_device():
    kernels = CudaKernels.__new__(CudaKernels)
    recorder = _DeviceRecorder()
    kernels._cupy, kernels._root = recorder, cuda_backend.cuda_source_root()
    kernels._digest, kernels._modules, kernels._functions = "d", {}, {}
    assert kernels._function(1, "demb_find") == "demb_find"
    assert recorder.events == [("module", 1), ("load demb_find", 1)]
    assert recorder.current == 0  # the caller's device is current again


def test_each_use_waits_for_the_stream_that_last_used_the_tables():
    """TorchRec's order: forward(i) on the training stream, then prefetch(i + 1) on
    its own stream, then backward(i) on the training stream. The prefetch must wait
    for forward(i) (it reuses slots), backward(i) for the prefetch (it looks rows up
    again and updates them), the next forward for both."""
    module = BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=4, max_capacity=64, local_hbm_for_values=4 * 4 * 16,
                                caching=True)], learning_rate=0.1)
    streams = StreamRecorder()
    module._step.stream_order = StreamOrder(module.device, streams)
    batches = [(torch.tensor([1, 2, 3, 4]) + 10 * i, torch.tensor([0, 2, 4])) for i in range(3)]
    streams.current = "prefetch"
    module.prefetch(*batches[0])
    assert streams.waits == []  # nothing used the tables before
    streams.current = "train"
    module(*batches[0]).sum().backward()  # the forward waits for the prefetch
    train_waits = [("train", "prefetch")]
    assert streams.waits == train_waits
    streams.current = "prefetch"
    module.prefetch(*batches[1])
    module.prefetch(*batches[2])  # the same stream used them last: no second wait
    assert streams.waits == train_waits + [("prefetch", "train")]
    streams.current = "train"
    out = module(*batches[1])
    streams.current = "prefetch"
    module.prefetch(torch.tensor([7, 8]), torch.tensor([0, 1, 2]))
    streams.current = "train"
    out.sum().backward()  # backward(1) after prefetch(3): waits for it
    module(*batches[2])  # forward(2) after backward(1): same stream, no wait
    assert streams.waits == train_waits + [("prefetch", "train"), ("train", "prefetch"),
                                           ("prefetch", "train"), ("train", "prefetch")]
