"""The training step of ``BatchedDynamicEmbeddingTables``: a batch's checks, its lookup in
every group, the output, and the backward with the fused optimizer (``_LookupFunction``)."""

from collections import deque
from typing import Callable, Deque, List, NamedTuple, Optional, Sequence

import torch

from dynamicemb.embedding.buffers import OutputBuffers, Scratch
from dynamicemb.embedding.group import GroupLookup, TableGroup
from dynamicemb.embedding.input_errors import CheckedBatch, InputErrors
from dynamicemb.embedding.streams import StreamOrder
from dynamicemb.ops import for_device
from dynamicemb.ops.interface import BatchPart
from dynamicemb.options import DynamicEmbPoolingMode
from dynamicemb.table.checks import check_batch_types, check_frequencies
from dynamicemb.table.shared_zeros import SharedZeros
from dynamicemb.types import DynamicEmbGradientCheck

__all__ = ["Step"]


class _Batch(NamedTuple):
    """A validated batch and what each group looked up for it."""

    offsets: torch.Tensor  # (F * B + 1,) int64
    weights: Optional[torch.Tensor]  # (N,) float32
    batch_size: int
    num_indices: int  # N
    lookups: List[GroupLookup]
    error: Optional[torch.Tensor] = None  # the check's word, where checked on the device
    check: Optional[CheckedBatch] = None


def _all_finite(t: torch.Tensor) -> bool:
    """Whether a float32 tensor holds no NaN/inf: NaN/inf propagate through a float64 sum,
    which float32 values cannot overflow (cheaper than ``isfinite(t).all()``)."""
    return bool(torch.isfinite(t.sum(dtype=torch.float64)))


def _check_has_data(t: torch.Tensor, name: str) -> None:
    if t.device.type == "meta":
        raise ValueError(f"{name} are on the meta device, which holds no data")


class _Prefetched(NamedTuple):
    indices: torch.Tensor
    offsets: torch.Tensor
    training: bool
    lookups: List[GroupLookup]
    check: Optional[CheckedBatch] = None  # its check on the device, if any


class _LookupFunction(torch.autograd.Function):
    """Autograd node whose backward runs the fused optimizer. The placeholder parameter
    makes autograd reach it; it returns only ``per_sample_weights``' gradient."""

    @staticmethod
    def forward(ctx, placeholder, weights, step, batch):  # noqa: D102
        ctx.step, ctx.batch = step, batch
        ctx.weights_device = None if weights is None else weights.device
        return step._compute_output(batch)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: D102
        grad_weights = ctx.step._apply_gradients(
            ctx.batch, grad_output, want_weight_grad=ctx.needs_input_grad[1])
        if grad_weights is not None:  # autograd wants it where the caller's weights are
            grad_weights = grad_weights.to(ctx.weights_device)
        return None, grad_weights, None, None


class Step:
    """A module's batches between calls: checks, prefetched lookups, output, fused backward.
    ``table_location``: each table's (group index, local table id); ``sync_checks``: raise
    bad offsets in the call that gets them (a GPU sync); ``changed``: called when rows change.
    """

    def __init__(self, groups: List[TableGroup], feature_table_map: Sequence[int],
                 table_location: dict, feature_dims: Sequence[int],
                 pooling: DynamicEmbPoolingMode, device, optimizer,
                 gradient_check: DynamicEmbGradientCheck, sync_checks: bool,
                 changed: Callable[[], None]) -> None:
        self.groups, self.device, self.optimizer = groups, device, optimizer
        self.pooling, self.gradient_check, self.changed = pooling, gradient_check, changed
        self.feature_dims = list(feature_dims)
        self.num_features = len(feature_table_map)
        # On the rows' device: they index per-lookup tensors and go to the kernels.
        self.feature_group = torch.tensor([table_location[t][0] for t in feature_table_map],
                                          dtype=torch.int64, device=device)
        self.feature_local_tid = torch.tensor(
            [table_location[t][1] for t in feature_table_map], dtype=torch.int16, device=device)
        cols = torch.tensor([0] + self.feature_dims, dtype=torch.int64, device=device).cumsum(0)[:-1]
        self.feature_col = [torch.where(self.feature_group == g, cols, torch.full_like(cols, -1))
                            for g in range(len(groups))]
        self.prefetched: Deque[_Prefetched] = deque()
        self.outputs = OutputBuffers()
        self.grad_sums = Scratch()  # the backward's per-row gradient sums (CPU)
        self.stream_order = StreamOrder(device)
        self.zero_tids = SharedZeros(torch.int16, device)  # a one-table module's
        # Checks of a batch's values (finite weights and gradients) where they cost no
        # host sync: on the CPU; on a GPU a step does not wait for them.
        self.check_data = for_device(device).free_host_reads
        # The step checks its offsets into this word, read by the host at the next
        # call; where reading it costs nothing (the CPU), in the call itself.
        self.errors = InputErrors(device, at_once=sync_checks or self.check_data)

    def forward(self, indices, offsets, weights, frequencies, training: bool,
                placeholder: torch.Tensor) -> torch.Tensor:
        """The module's ``forward`` (float32 output)."""
        self._raise_refused()
        check = CheckedBatch()
        indices, offsets, weights, batch_size = self._validate(indices, offsets, weights, check)
        frequencies = self._validate_frequencies(frequencies, indices.numel())
        self.stream_order.before_use()
        error = self.errors.word
        if self.prefetched:
            lookups = self._take_prefetched(indices, offsets, training)
        else:
            lookups = self._lookup(indices, offsets, batch_size, training, frequencies, error)
        batch = _Batch(offsets, None if weights is None else weights.detach(), batch_size,
                       indices.numel(), lookups, error, check)
        if training and torch.is_grad_enabled() and any(g.training for g in self.groups):
            out = _LookupFunction.apply(placeholder, weights, self, batch)
        else:
            out = self._compute_output(batch)
        self.stream_order.used()
        return out

    def prefetch(self, indices, offsets, weights, frequencies, training: bool) -> None:
        """The module's ``prefetch``: the batch's lookup now, into the queue."""
        self.stream_order.before_use()
        self._raise_refused()
        # a prefetched batch checks into a word of its own
        error = torch.zeros(1, dtype=torch.int64, device=self.device)
        check = CheckedBatch()
        indices, offsets, _, batch_size = self._validate(indices, offsets, weights, check,
                                                         word=error)
        frequencies = self._validate_frequencies(frequencies, indices.numel())
        lookups = self._lookup(indices, offsets, batch_size, training, frequencies, error)
        self.prefetched.append(_Prefetched(indices, offsets, training, lookups, check))
        self.stream_order.used()

    def _raise_refused(self) -> None:
        """Raises the error of a batch an earlier call's kernel refused; a refused
        prefetched batch leaves the queue (it changed nothing)."""
        try:
            self.errors.raise_if_refused()
        except ValueError:
            self.prefetched = deque(p for p in self.prefetched
                                     if p.check is None or not p.check.refused)
            raise

    def _validate(self, indices, offsets, weights, check: CheckedBatch,
                  word: Optional[torch.Tensor] = None):
        """The batch on the module's device: types and shapes checked at once, offsets by
        a kernel into the error word (``word``: a prefetch's own)."""
        pooling = self.pooling
        check_batch_types(indices, offsets, weights, "" if pooling == DynamicEmbPoolingMode.SUM
                          else f"this module uses {pooling.name}")
        for name, t in (("indices", indices), ("offsets", offsets)):
            _check_has_data(t, name)
        num_bags = offsets.numel() - 1
        if num_bags < 0 or num_bags % self.num_features:
            raise ValueError(
                f"offsets must have num_features * batch_size + 1 entries "
                f"(num_features={self.num_features}), got {offsets.numel()}")
        # The batch moves to the rows' device (a no-op when it is there already).
        offsets = offsets.to(device=self.device, dtype=torch.int64).contiguous()
        n = indices.numel()
        if weights is not None:
            if weights.shape != (n,):
                raise ValueError(
                    f"per_sample_weights must have shape ({n},) like indices, got {tuple(weights.shape)}")
            _check_has_data(weights, "per_sample_weights")
            weights = weights.to(device=self.device, dtype=torch.float32).contiguous()
            if self.check_data and not _all_finite(weights):
                raise ValueError("per_sample_weights must be finite, got NaN or inf")
        indices = indices.to(device=self.device, dtype=torch.int64).contiguous()
        # last: a batch refused at once has changed nothing
        self.errors.check(check, offsets, n, word)
        return indices, offsets, weights, num_bags // self.num_features

    def _take_prefetched(self, indices, offsets, training: bool) -> List[GroupLookup]:
        head = self.prefetched[0]
        same = (head.indices is indices and head.offsets is offsets) or (  # no read: no sync
            torch.equal(head.indices, indices) and torch.equal(head.offsets, offsets))
        if head.training != training or not same:
            raise ValueError(
                "forward got a batch other than the next prefetched one (or another "
                "train/eval mode); prefetched batches are consumed in order")
        self.prefetched.popleft()
        # made on the prefetch's stream, read on this one until the backward
        self.stream_order.hand_over(head.lookups, vars(head.check) if head.check else None)
        return [g.refresh(found) for g, found in zip(self.groups, head.lookups)]

    def _validate_frequencies(self, frequencies, n: int) -> Optional[torch.Tensor]:
        # their values (>= 1) are read only where that costs no sync, as the weights'
        return check_frequencies(frequencies, n, self.device, like="indices", int32=True,
                                 check_values=self.check_data)

    def _lookup(self, indices, offsets, batch_size, insert: bool,
                frequencies: Optional[torch.Tensor], error: torch.Tensor) -> List[GroupLookup]:
        """Every group's lookup of its part of the batch, atomically: if one group fails
        (a full table in ERROR mode, a failing external store), no table changes."""
        pending = []
        try:
            for group, tids, part in self._split_by_group(indices, offsets, batch_size):
                pending.append(group.begin_lookup(indices, tids, insert, frequencies, error,
                                                  part))
        except BaseException:
            for group, p in reversed(list(zip(self.groups, pending))):
                group.abort_lookup(p)
            raise
        if insert:
            self.changed()
        return [g.finish_lookup(p) for g, p in zip(self.groups, pending)]

    def _split_by_group(self, indices, offsets, batch_size):
        """(group, local table ids, ``BatchPart`` or None) per group: every group
        takes its part of the whole batch (nothing read on the host)."""
        n = indices.numel()
        if len(self.groups) == 1 and len(self.groups[0].table_indices) == 1:
            return [(self.groups[0], self.zero_tids.take(n), None)]
        bounds = offsets[:: max(batch_size, 1)] if batch_size else torch.zeros(
            self.num_features + 1, dtype=torch.int64, device=self.device)
        # each lookup's feature: how many features end at or before it (a search, not
        # a repeat: offsets a kernel has yet to refuse still give features in range).
        # Contiguous bounds: torch 2.13's CPU searchsorted over the strided view erred.
        feature = torch.searchsorted(bounds[1:].contiguous(), torch.arange(n, device=self.device),
                                     right=True).clamp_(max=self.num_features - 1)
        tids = self.feature_local_tid[feature]
        if len(self.groups) == 1:
            return [(self.groups[0], tids, None)]
        groups = self.feature_group[feature]
        return [(group, tids, BatchPart(groups, g)) for g, group in enumerate(self.groups)]

    def _compute_output(self, batch: _Batch) -> torch.Tensor:
        mean = self.pooling == DynamicEmbPoolingMode.MEAN
        # Uninitialized: every feature belongs to one group, whose kernel writes all of
        # its rows (sequence) or columns (pooled, zeros for empty bags).
        if self.pooling == DynamicEmbPoolingMode.NONE:
            shape = (batch.num_indices, self.feature_dims[0])
        else:
            shape = (batch.batch_size, sum(self.feature_dims))
        out = self.outputs.empty(shape, torch.float32, self.device)
        pooled = self.pooling != DynamicEmbPoolingMode.NONE
        for g, (group, found) in enumerate(zip(self.groups, batch.lookups)):
            group.forward(found, batch.offsets if pooled else None, batch.weights,
                          self.feature_col[g], batch.batch_size, mean, out, batch.error)
        return out

    def _apply_gradients(self, batch: _Batch, grad: torch.Tensor,
                         want_weight_grad: bool = False) -> Optional[torch.Tensor]:
        """Backward: gradients of the weights (if wanted, from the rows before the
        update), then the fused optimizer on every group."""
        if batch.check is not None and batch.check.refused:  # raised already: no update
            return None
        self.stream_order.before_use()
        grad = grad.to(torch.float32).contiguous()
        pooled = self.pooling != DynamicEmbPoolingMode.NONE
        mean = self.pooling == DynamicEmbPoolingMode.MEAN
        grads = [group.clip(grad) for group in self.groups]  # gradient clipping
        whole_batch = self.check_data and self.gradient_check == DynamicEmbGradientCheck.BATCH
        sums = self._summed_gradients(batch, grads) if whole_batch else None
        grad_weights = None
        if want_weight_grad:
            grad_weights = torch.zeros(batch.weights.numel(), dtype=torch.float32,
                                       device=self.device)
            for g, (group, found) in enumerate(zip(self.groups, batch.lookups)):
                group.weight_grad(found, grads[g], batch.offsets, self.feature_col[g],
                                  batch.batch_size, grad_weights, batch.error)
        self.changed()
        non_finite = 0
        for g, (group, found) in enumerate(zip(self.groups, batch.lookups)):
            lr = self.optimizer.param_groups[g]["lr"]
            non_finite += group.backward(
                found, grads[g], lr, batch.offsets if pooled else None, batch.weights,
                self.feature_col[g], batch.batch_size, mean, batch.error,
                None if sums is None else sums[g])
        self.stream_order.used()
        if non_finite:
            raise ValueError(
                "the gradient of the embedding output holds NaN or inf: the summed gradients "
                f"of {non_finite} rows are not finite and those rows were not updated (every "
                "other row of this batch was; gradient_check='batch' refuses the whole "
                "batch instead): look for the non-finite loss upstream")
        return grad_weights

    def _summed_gradients(self, batch: _Batch, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        """Every group's summed row gradients (``gradient_check='batch'``), checked before
        any group updates: a NaN/inf in the gradient or a weight reaches the sum of each row
        reading it. Raises ``ValueError`` (no table changed) if any sum is not finite."""
        pooled = self.pooling != DynamicEmbPoolingMode.NONE
        shapes = [(found.starts.numel() - 1 if group.training else 0, group.dim)
                  for group, found in zip(self.groups, batch.lookups)]
        sums = self.grad_sums.views(shapes, self.device)
        non_finite = 0
        for g, (group, found) in enumerate(zip(self.groups, batch.lookups)):
            if group.training:
                non_finite += group.sum_gradients(
                    found, grads[g], batch.offsets if pooled else None, batch.weights,
                    self.feature_col[g], batch.batch_size,
                    self.pooling == DynamicEmbPoolingMode.MEAN, sums[g])
        if non_finite:
            raise ValueError(
                "the gradient of the embedding output holds NaN or inf; this batch's update "
                f"is refused and no table changed (the summed gradients of {non_finite} "
                "rows are not finite: look for the non-finite loss upstream)")
        return sums
