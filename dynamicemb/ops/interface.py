"""The backend contract, re-exported from ``codes`` (shared with ``csrc/dynamicemb``),
``records`` (memory and results) and ``backend`` (``Backend``). Nothing above a
backend knows kernel signatures, status codes or row-reference bits."""

from dynamicemb.ops.backend import Backend
from dynamicemb.ops.codes import (ALL_BITS, COMPOUND_COUNT_SHIFT, COMPOUND_TIME_MASK,
                                  HOST_ROW_BIT, KNO_BUCKET, TRANSIENT_ROW_BIT,
                                  InsertStatus, ScoreRule,
                                  init_mode_code, metadata_bytes_per_slot, num_buckets_for,
                                  offsets_problem, optimizer_code, optimizer_state_dim,
                                  score_rule)
from dynamicemb.ops.records import (BatchPart, Deduplicated, DeviceSchedule, Entries, InitRows,
                                    InitSpec, NewRows, OptimizerUpdate, PromotionPlan, Rounding,
                                    RowFormat, RowSources, TableMemory, Upserted)

__all__ = [
    "ALL_BITS",
    "Backend",
    "BatchPart",
    "COMPOUND_COUNT_SHIFT",
    "COMPOUND_TIME_MASK",
    "Deduplicated",
    "DeviceSchedule",
    "Entries",
    "HOST_ROW_BIT",
    "TRANSIENT_ROW_BIT",
    "InitRows",
    "InitSpec",
    "InsertStatus",
    "KNO_BUCKET",
    "NewRows",
    "OptimizerUpdate",
    "PromotionPlan",
    "Rounding",
    "RowFormat",
    "RowSources",
    "ScoreRule",
    "TableMemory",
    "Upserted",
    "init_mode_code",
    "metadata_bytes_per_slot",
    "num_buckets_for",
    "offsets_problem",
    "optimizer_code",
    "optimizer_state_dim",
    "score_rule",
]
