// Python bindings of the CPU kernels. setup.py builds these sources once per
// instruction-set level as dynamicemb._C_<level>; dynamicemb/ops/cpu_kernels.py loads
// the best one this CPU runs.
#include <string>

#include <torch/python.h>

#include "cpu/verbs.h"

#ifndef DYNAMICEMB_ISA
#define DYNAMICEMB_ISA unknown
#endif
#define DYNAMICEMB_STRING_(x) #x
#define DYNAMICEMB_STRING(x) DYNAMICEMB_STRING_(x)

namespace {

// Whether this CPU, and the operating system's saved register state, run code built
// with -march=<level> (x86-64, x86-64-v2/v3/v4). Called on the baseline copy only, so
// that the check itself needs nothing the CPU may lack.
bool cpu_runs(const std::string& level) {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool v2 = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("popcnt") &&
                  __builtin_cpu_supports("ssse3");
  const bool v3 = v2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") &&
                  __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512cd") &&
                  __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (level == "x86-64") return true;
  if (level == "x86-64-v2") return v2;
  if (level == "x86-64-v3") return v3;
  if (level == "x86-64-v4") return v4;
  return false;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace c = dynamicemb::cpu;
  m.doc() = "dynamicemb CPU kernels";
  // The -march target this copy was built for (underscores for dashes).
  m.attr("isa") = DYNAMICEMB_STRING(DYNAMICEMB_ISA);
  m.def("cpu_runs", &cpu_runs, "whether this CPU runs code built for -march=<level>");
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
  m.def("expire", &c::expire, "TTL sweep: empty slots last accessed before a time");
  m.def("dedup", &c::dedup, "unique (table, key) pairs in first-occurrence order",
        pybind11::arg("keys"), pybind11::arg("tids"), pybind11::arg("frequencies"),
        pybind11::arg("group") = false);
  m.def("init_rows", &c::init_rows, "initialize rows per (table, key, column)");
  m.def("pooled_forward", &c::pooled_forward, "pooled lookup (sum/mean)");
  m.def("sequence_forward", &c::sequence_forward, "sequence lookup");
  m.def("sum_gradients", &c::sum_gradients, "each unique row's summed gradient");
  m.def("update_rows", &c::update_rows, "optimizer update of rows from summed gradients");
  m.def("sum_and_update_rows", &c::sum_and_update_rows,
        "each unique row's summed gradient applied where finite; returns the rows that were not");
  m.def("per_sample_weight_grad", &c::per_sample_weight_grad, "gradient of weights");
  m.def("occupied_slots", &c::occupied_slots, "occupied slots of a range");
  m.def("promotion_plan", &c::promotion_plan,
        "a padded batch's promotion into a cache: (cache_slots, plan, rank)");
  m.def("promotion_order", &c::promotion_order,
        "the cache call's (keys, tids, scores, buckets) in promotion order");
  m.def("promote_rows", &c::promote_rows,
        "victims written back, new rows copied in, row references written");
}
