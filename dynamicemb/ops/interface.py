"""The backend contract: what every kernel backend offers, and every code it shares.

A backend (``dynamicemb.ops.cpu``, ``dynamicemb.ops.cuda``) implements ``Backend``
over tensors of one device type. Everything above it (table, storage, module) calls
these verbs by keyword and reads their NamedTuple results; nothing above it knows
kernel signatures, status codes or row-reference bits.

The contract lives in three modules, re-exported here: ``codes`` (the codes shared
with the headers of ``csrc/dynamicemb``), ``records`` (the table's memory and the
verbs' results) and ``backend`` (the ``Backend`` class).
"""

from dynamicemb.ops.backend import Backend
from dynamicemb.ops.codes import (ALL_BITS, COMPOUND_COUNT_SHIFT, COMPOUND_TIME_MASK,
                                  HOST_ROW_BIT, KNO_BUCKET, TRANSIENT_ROW_BIT,
                                  InsertStatus, ScoreRule,
                                  init_mode_code, metadata_bytes_per_slot, num_buckets_for,
                                  offsets_problem, optimizer_code, optimizer_state_dim,
                                  score_rule)
from dynamicemb.ops.records import (BatchPart, Deduplicated, DeviceSchedule, Entries, InitRows,
                                    InitSpec, NewRows, OptimizerUpdate, PromotionPlan, RowSources,
                                    TableMemory, Upserted)

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
