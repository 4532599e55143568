// Python bindings of the CPU kernels: the module dynamicemb._C, loaded only by
// dynamicemb/_ops.py.
#include "cpu/verbs.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace c = dynamicemb::cpu;
  m.doc() = "dynamicemb CPU kernels";
  m.def("hash_keys", &c::hash_keys, "64-bit hash of (table id, key)");
  m.def("find", &c::find, "slot of each key, -1 if absent");
  m.def("upsert", &c::upsert, "one inserting pass; returns deferred positions");
  m.def("dedup_upsert", &c::dedup_upsert,
        "dedup overlapped with a first inserting pass over the unique keys");
  m.def("check_offsets", &c::check_offsets, "0, or the first problem of an offsets tensor");
  m.def("unpin", &c::unpin, "clear the pinned bit of slots");
  m.def("undo_upsert", &c::undo_upsert, "revert an inserting call");
  m.def("grow", &c::grow, "rehash into twice the buckets");
  m.def("erase", &c::erase, "erase keys");
  m.def("dedup", &c::dedup, "unique (table, key) pairs in first-occurrence order",
        pybind11::arg("keys"), pybind11::arg("tids"), pybind11::arg("frequencies"),
        pybind11::arg("group") = false);
  m.def("init_rows", &c::init_rows, "initialize rows per (table, key, column)");
  m.def("pooled_forward", &c::pooled_forward, "pooled lookup (sum/mean)");
  m.def("sequence_forward", &c::sequence_forward, "sequence lookup");
  m.def("fused_backward", &c::fused_backward, "segmented gradient + optimizer update");
  m.def("per_sample_weight_grad", &c::per_sample_weight_grad, "gradient of weights");
  m.def("occupied_slots", &c::occupied_slots, "occupied slots of a range");
}
