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

namespace py = pybind11;

// The optimizer arguments of the backward verbs (optimizer_params' order).
#define OPTIMIZER_ARGS                                                                    \
  py::arg("kind"), py::arg("lr"), py::arg("eps"), py::arg("beta1"), py::arg("beta2"),     \
      py::arg("weight_decay"), py::arg("step_size"), py::arg("bias_correction2_sqrt"), \
      py::arg("decay_scale")

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
  m.def("check_offsets", &c::check_offsets,
        "0, or the first problem of an offsets tensor (with error: recorded there, None)",
        py::arg("offsets"), py::arg("num_indices"), py::arg("error") = py::none());
  m.def("unpin", &c::unpin, "clear the pinned bit of slots");
  m.def("undo_upsert", &c::undo_upsert, "revert an inserting call");
  m.def("grow", &c::grow, "rehash into twice the buckets");
  m.def("erase", &c::erase, "erase keys");
  m.def("expire", &c::expire, "TTL sweep: empty slots last accessed before a time");
  m.def("dedup", &c::dedup, "unique (table, key) pairs in first-occurrence order",
        py::arg("keys"), py::arg("tids"), py::arg("frequencies"),
        py::arg("group") = false);
  m.def("init_rows", &c::init_rows, "initialize rows per (table, key, column)");
  // The lookups and the backward take the keywords of a step counted on the device
  // (verbs.h): init (an InitRows), error (the error word), schedule (a DeviceSchedule).
  m.def("pooled_forward", &c::pooled_forward, "pooled lookup (sum/mean)", py::arg("tiers"),
        py::arg("transient"), py::arg("row_slot"), py::arg("inverse"), py::arg("offsets"),
        py::arg("weights"), py::arg("feature_col"), py::arg("batch"), py::arg("dim"),
        py::arg("mean"), py::arg("out"), py::arg("init") = py::none(),
        py::arg("error") = py::none());
  m.def("sequence_forward", &c::sequence_forward, "sequence lookup", py::arg("tiers"),
        py::arg("transient"), py::arg("row_slot"), py::arg("inverse"), py::arg("dim"),
        py::arg("out"), py::arg("init") = py::none(), py::arg("error") = py::none());
  m.def("sum_gradients", &c::sum_gradients, "each unique row's summed gradient",
        py::arg("starts"), py::arg("rank"), py::arg("offsets"), py::arg("weights"),
        py::arg("feature_col"), py::arg("batch"), py::arg("mean"), py::arg("grad"),
        py::arg("sums"), py::arg("error") = py::none());
  m.def("update_rows", &c::update_rows, "optimizer update of rows from summed gradients",
        py::arg("tiers"), py::arg("row_slot"), py::arg("sums"), OPTIMIZER_ARGS,
        py::arg("error") = py::none(), py::arg("schedule") = py::none());
  m.def("sum_and_update_rows", &c::sum_and_update_rows,
        "each unique row's summed gradient applied where finite; returns the rows that were not",
        py::arg("tiers"), py::arg("row_slot"), py::arg("starts"), py::arg("rank"),
        py::arg("offsets"), py::arg("weights"), py::arg("feature_col"), py::arg("batch"),
        py::arg("mean"), py::arg("grad"), py::arg("dim"), OPTIMIZER_ARGS,
        py::arg("error") = py::none(), py::arg("schedule") = py::none());
  m.def("per_sample_weight_grad", &c::per_sample_weight_grad, "gradient of weights",
        py::arg("tiers"), py::arg("transient"), py::arg("row_slot"), py::arg("inverse"),
        py::arg("offsets"), py::arg("feature_col"), py::arg("batch"), py::arg("dim"),
        py::arg("grad"), py::arg("out"), py::arg("init") = py::none(),
        py::arg("error") = py::none());
  m.def("occupied_slots", &c::occupied_slots, "occupied slots of a range");
}
