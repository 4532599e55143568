"""The launches of ``csrc/cuda/embedding.cu``: offsets check, initializers, forward, backward."""

from typing import Optional

import numpy as np
import torch

from dynamicemb.ops.codes import offsets_problem
from dynamicemb.ops.cuda.launch import (PIECE_ENTRIES, KernelLauncher, _error_arg, _expect,
                                        _expect_batch, _expect_init_spec, _i64, _ptr,
                                        _row_args, _row_format_args, _warps_per_update_block)

__all__ = ["EmbeddingKernels"]


def _check_rounding(rounding, num_unique: int) -> None:
    """A 16-bit update's ``Rounding`` (as a tuple): keys (>= U,) int64, table_ids int16,
    spec (T, 2) int64, step (1,) int64, stochastic."""
    if rounding is None:
        raise ValueError("an update of 16-bit rows needs its rounding")
    keys, tids, spec, step, _ = rounding
    _expect(keys, torch.int64, "rounding keys")
    _expect(tids, torch.int16, "rounding table_ids")
    _expect(spec, torch.int64, "rounding spec")
    _expect(step, torch.int64, "rounding step")
    if keys.numel() < num_unique or tids.numel() != keys.numel():
        raise ValueError("rounding keys and table_ids need an entry per unique row")
    if spec.dim() != 2 or spec.size(1) != 2:
        raise ValueError("rounding spec is (T, 2): stream, seed")
    if step.numel() != 1:
        raise ValueError("rounding step is (1,) int64")


def _rounding_args(rounding) -> list:
    """``round_keys, round_tids, round_spec, round_step, stochastic`` of
    ``demb_fused_update`` (float32 rows: None, nulls)."""
    if rounding is None:
        return [_ptr(None)] * 4 + [np.bool_(False)]
    keys, tids, spec, step, stochastic = rounding
    return [_ptr(keys), _ptr(tids), _ptr(spec), _ptr(step), np.bool_(stochastic)]


class EmbeddingKernels(KernelLauncher):
    """The embedding verbs of ``CudaKernels``."""

    def check_offsets(self, offsets: torch.Tensor, num_indices: int,
                      error: Optional[torch.Tensor] = None) -> Optional[int]:
        """``Backend.check_offsets``."""
        if offsets.dtype != torch.int64:
            raise TypeError(f"offsets has dtype {offsets.dtype}, expected torch.int64")
        if offsets.numel() < 1:
            raise ValueError("offsets must have at least one entry")
        _expect(offsets, torch.int64, "offsets")
        word = torch.zeros(1, dtype=torch.int64, device=offsets.device) if error is None else error
        self._launch("demb_check_offsets", offsets.device, offsets.numel(), [
            _ptr(offsets), _i64(offsets.numel() - 1), _i64(num_indices), _error_arg(word)])
        if error is not None:
            return None
        return offsets_problem(int(word))  # a bad batch raises before any change: a sync

    def init_rows(self, values, slots, status, keys, tids, dim, spec, state_value,
                  row_format=None) -> None:
        """``Backend.init_rows`` (one warp per key); ``row_format``: the rows'
        ``(code, state_offset)`` (None: float32)."""
        _expect(values, torch.float32, "values")
        _expect(slots, torch.int64, "slots")
        if status is not None:
            _expect(status, torch.int8, "status")
        _expect_batch(keys, tids)
        _expect_init_spec(spec)
        n = slots.numel()
        if (status is not None and status.numel() != n) or keys.numel() != n or values.dim() != 2:
            raise ValueError("slots, status and keys need one length; values [C, width]")
        if dim < 0:
            raise ValueError(f"dim must not be negative, got {dim}")
        row_format_args = _row_format_args(values, dim, row_format)
        self._launch("demb_init_rows", values.device, 32 * n, [  # a warp per key
            _ptr(values), np.int64(values.size(1)), *row_format_args,
            _ptr(slots), _ptr(status), _ptr(keys), _ptr(tids), _i64(n), _i64(dim),
            _ptr(spec.ints), _ptr(spec.floats), np.float32(state_value)])

    def pooled_forward(self, tiers, transient, row_ref, inverse, offsets, weights,
                       feature_col, batch, dim, mean, out, init=None, error=None,
                       row_format=None) -> None:
        rows = _row_args(tiers, transient, row_ref, dim, init, row_format)
        num_bags = offsets.numel() - 1
        if num_bags != feature_col.numel() * batch:
            raise ValueError("offsets must have num_features * batch + 1 entries")
        self._launch("demb_pooled_forward", out.device, 32 * num_bags, rows + [
            _ptr(inverse), _ptr(offsets), _ptr(weights), _ptr(feature_col), _i64(batch),
            _i64(num_bags), np.bool_(mean), _ptr(out), np.int64(out.size(1)),
            _error_arg(error)])

    def sequence_forward(self, tiers, transient, row_ref, inverse, dim, out, init=None,
                         error=None, row_format=None) -> None:
        rows = _row_args(tiers, transient, row_ref, dim, init, row_format)
        n = inverse.numel()
        self._launch("demb_sequence_forward", out.device, 32 * n,  # a warp per lookup
                     rows + [_ptr(inverse), _i64(n), _ptr(out), _error_arg(error)])

    def fused_backward(self, tiers, row_ref, starts, rank, offsets, weights, feature_col,
                       batch, dim, mean, grad, kind, lr, eps, beta1, beta2, weight_decay,
                       step_size, bias_correction2_sqrt, decay_scale, error=None,
                       schedule=None, row_format=None, rounding=None) -> None:
        """``Backend.fused_backward``: ``row_format`` the rows' ``(code, state_offset)``
        (None: float32); 16-bit rows need ``rounding`` (a ``Rounding`` as a tuple)."""
        _expect(grad, torch.float32, "grad")
        _expect(starts, torch.int64, "starts")
        _expect(rank, torch.int64, "rank")
        device_rows, host_rows = tiers
        _row_args(tiers, device_rows[:0], row_ref, dim, row_format=row_format)  # checks only
        row_dtype, state_offset = _row_format_args(device_rows, dim, row_format)
        if row_dtype:
            _check_rounding(rounding, row_ref.numel())
        num_unique = row_ref.numel()
        if starts.numel() != num_unique + 1:
            raise ValueError("starts must have one entry per unique row + 1")
        pooled = offsets.numel() > 0
        n = rank.numel()
        # starts[-1] (the group's lookups) is at most n, the batch's lookups: the
        # per-entry arrays are sized by that bound rather than read (a sync).
        entries = n
        dev = grad.device
        # every entry the update reads (below starts[-1]) is placed: no zeroing
        pos = torch.empty(entries, dtype=torch.int64, device=dev)
        scale = torch.empty(entries, dtype=torch.float32, device=dev)
        num_bags = offsets.numel() - 1 if pooled else 0
        advance = schedule is not None and schedule.advance
        if schedule is not None:
            _expect(schedule.lr, torch.float64, "lr")
            _expect(schedule.step, torch.int64, "step")
        # the launch that advances the step count has a thread even for no bag
        threads = num_bags if pooled else n
        self._launch("demb_place_grads", dev, max(threads, 1) if advance else threads, [
            _ptr(rank), _i64(n), _i64(entries), _ptr(offsets if pooled else None),
            _ptr(weights), _ptr(feature_col), _i64(batch), _i64(num_bags), np.bool_(mean),
            np.int64(grad.size(1)), _ptr(pos), _ptr(scale), _ptr(None), _error_arg(error),
            _ptr(schedule.step if advance else None)])
        # Ranks outside [0, entries) are skipped, not counted: rank comes from the
        # group's own dedup, and a count would cost a sync or a launch.
        first_piece, partial = self._piece_sums(starts, pos, scale, grad, dim, entries)
        warps = _warps_per_update_block(dim)
        self._launch("demb_fused_update", dev, 32 * num_unique, [
            _ptr(device_rows), _ptr(host_rows), np.int64(device_rows.size(1)), row_dtype,
            state_offset, _i64(dim), _ptr(row_ref), _i64(num_unique), _ptr(starts), _ptr(pos),
            _ptr(scale), _ptr(grad), _ptr(first_piece), _ptr(partial), np.int32(kind),
            np.float32(lr), np.float32(eps), np.float32(beta1),
            np.float32(beta2), np.float32(weight_decay), np.float32(1.0 - beta1),
            np.float32(1.0 - beta2), np.float32(step_size),
            np.float32(bias_correction2_sqrt), np.float32(decay_scale),
            _ptr(None if schedule is None else schedule.lr),
            _ptr(None if schedule is None else schedule.step),
            np.float64(beta1 if schedule is None else schedule.beta1),
            np.float64(beta2 if schedule is None else schedule.beta2),
            np.float64(0.0 if schedule is None else schedule.decoupled_decay),
            *_rounding_args(rounding if row_dtype else None)],
            shared_mem=warps * int(dim) * 4, block=32 * warps)

    def _piece_sums(self, starts, pos, scale, grad, dim, entries: int):
        """Partial sums of the hot rows' pieces: (first_piece (U + 1,), partial (bound, dim)),
        or (None, None) when no row can be hot. A row of L > PIECE_ENTRIES entries has
        fewer than 2 L / PIECE_ENTRIES pieces, so the grid uses that bound (no sync)."""
        bound = 2 * entries // PIECE_ENTRIES
        if bound == 0:
            return None, None
        num_unique = starts.numel() - 1
        pieces = torch.empty(num_unique, dtype=torch.int64, device=grad.device)
        first_piece = torch.empty_like(starts)
        self._launch("demb_piece_counts", grad.device, max(num_unique, 1), [
            _ptr(starts), _i64(num_unique), _i64(PIECE_ENTRIES), _ptr(pieces),
            _ptr(first_piece)])
        torch.cumsum(pieces, 0, out=first_piece[1:])
        partial = torch.empty(bound, int(dim), dtype=torch.float32, device=grad.device)
        self._launch("demb_piece_sums", grad.device, 32 * bound, [
            _ptr(starts), _ptr(first_piece), _i64(num_unique), _i64(PIECE_ENTRIES),
            _i64(bound), _ptr(pos), _ptr(scale), _ptr(grad), _i64(dim), _ptr(partial)])
        return first_piece, partial

    def per_sample_weight_grad(self, tiers, transient, row_ref, inverse, offsets,
                               feature_col, batch, dim, grad, out, init=None,
                               error=None, row_format=None) -> None:
        rows = _row_args(tiers, transient, row_ref, dim, init, row_format)
        num_bags = offsets.numel() - 1
        self._launch("demb_per_sample_weight_grad", out.device, 32 * num_bags, rows + [
            _ptr(inverse), _ptr(offsets), _ptr(feature_col), _i64(batch), _i64(num_bags),
            _ptr(grad), np.int64(grad.size(1)), _ptr(out), _error_arg(error)])
