// Python bindings of the CPU kernels. setup.py builds these sources once per
// instruction-set level as dynamicemb._C_<level>; dynamicemb/ops/cpu_kernels.py loads
// the best one this CPU runs.
#include <string>
#include <utility>

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

namespace py = pybind11;

// A BatchPart (Python's NamedTuple, or None: every key) as its fields.
std::pair<c10::optional<at::Tensor>, int64_t> part_fields(const py::object& part) {
  if (part.is_none()) return {c10::nullopt, 0};
  return {part.attr("groups").cast<at::Tensor>(), part.attr("group").cast<int64_t>()};
}

}  // namespace

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
  // The step's verbs take the CUDA backend's arguments (dynamicemb/ops/cuda):
  // a BatchPart or an InitSpec as the Python object.
  m.def(
      "dedup_upsert",
      [](const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
         const at::Tensor& tids, const c10::optional<at::Tensor>& frequencies, int64_t rule,
         at::Tensor& time, int64_t now_index, bool evicts, bool one_table,
         const c10::optional<at::Tensor>& error, at::Tensor& outcomes, at::Tensor& size,
         const py::object& part, const c10::optional<at::Tensor>& table_scores, int64_t ttl) {
        const auto fields = part_fields(part);
        return c::dedup_upsert(meta, bc, keys, tids, frequencies, rule, time, now_index,
                                      evicts, one_table, error, outcomes, size, fields.first,
                                      fields.second, table_scores, ttl);
      },
      "dedup (grouped) padded to n, then one inserting pass over the unique keys",
      py::arg("meta"), py::arg("bc"), py::arg("keys"), py::arg("tids"),
      py::arg("frequencies"), py::arg("rule"), py::arg("time"), py::arg("now_index"),
      py::arg("evicts"), py::arg("one_table"), py::arg("error"), py::arg("outcomes"),
      py::arg("size"), py::arg("part") = py::none(), py::arg("table_scores") = py::none(),
      py::arg("ttl") = 0);
  m.def(
      "dedup",
      [](const at::Tensor& keys, const at::Tensor& tids, const c10::optional<at::Tensor>& error,
         const py::object& part, const c10::optional<at::Tensor>& frequencies, bool group,
         const c10::optional<at::Tensor>& time) {
        const auto fields = part_fields(part);
        return c::dedup(keys, tids, frequencies, group, error, time, fields.first,
                               fields.second);
      },
      "unique (table, key) pairs, padded to n (grouped when asked; a table's time "
      "advanced)", py::arg("keys"),
      py::arg("tids"), py::arg("error"), py::arg("part") = py::none(),
      py::arg("frequencies") = py::none(), py::arg("group") = false,
      py::arg("time") = py::none());
  m.def("upsert", &c::upsert, "one inserting pass (buckets: kNoBucket skips a key)",
        py::arg("meta"), py::arg("bc"), py::arg("keys"), py::arg("tids"), py::arg("scores"),
        py::arg("rule"), py::arg("evicts"), py::arg("one_table"), py::arg("buckets"),
        py::arg("outcomes"),
        py::arg("size"), py::arg("time") = py::none(), py::arg("now_index") = 0,
        py::arg("ttl") = 0);
  m.def("erase_where", &c::erase_where, "erase the keys of a status; count them",
        py::arg("meta"), py::arg("bc"), py::arg("keys"), py::arg("tids"), py::arg("status"),
        py::arg("which"), py::arg("erased"), py::arg("size"));
  m.def(
      "init_rows",
      [](at::Tensor& values, const at::Tensor& slots, const c10::optional<at::Tensor>& status,
         const at::Tensor& keys, const at::Tensor& tids, int64_t dim, const py::object& spec,
         double state_value, const c10::optional<c::RowFormatArg>& row_format) {
        c::init_rows(values, slots, status, keys, tids, dim, spec.attr("ints").cast<at::Tensor>(),
                     spec.attr("floats").cast<at::Tensor>(), state_value, row_format);
      },
      "initial rows of keys (with a status: of the keys an inserting call stored)",
      py::arg("values"), py::arg("slots"), py::arg("status"), py::arg("keys"), py::arg("tids"),
      py::arg("dim"), py::arg("spec"), py::arg("state_value"),
      py::arg("row_format") = py::none());
  m.def("check_offsets", &c::check_offsets,
        "0, or the first problem of an offsets tensor (with error: recorded there, None)",
        py::arg("offsets"), py::arg("num_indices"), py::arg("error") = py::none());
  m.def("undo_upsert", &c::undo_upsert, "revert an inserting call");
  m.def("grow", &c::grow, "rehash into twice the buckets");
  m.def("erase", &c::erase, "erase keys");
  m.def("expire", &c::expire, "TTL sweep: empty slots last accessed before a time");
  // The lookups and the backward take the keywords of a step counted on the device
  // (verbs.h): init (an InitRows), error (the error word), schedule (a DeviceSchedule);
  // and of 16-bit rows: row_format (a RowFormatArg) and, updating, rounding.
  m.def("pooled_forward", &c::pooled_forward, "pooled lookup (sum/mean)", py::arg("tiers"),
        py::arg("transient"), py::arg("row_ref"), py::arg("inverse"), py::arg("offsets"),
        py::arg("weights"), py::arg("feature_col"), py::arg("batch"), py::arg("dim"),
        py::arg("mean"), py::arg("out"), py::arg("init") = py::none(),
        py::arg("error") = py::none(), py::arg("row_format") = py::none());
  m.def("sequence_forward", &c::sequence_forward, "sequence lookup", py::arg("tiers"),
        py::arg("transient"), py::arg("row_ref"), py::arg("inverse"), py::arg("dim"),
        py::arg("out"), py::arg("init") = py::none(), py::arg("error") = py::none(),
        py::arg("row_format") = py::none());
  m.def("sum_gradients", &c::sum_gradients, "each unique row's summed gradient",
        py::arg("starts"), py::arg("rank"), py::arg("offsets"), py::arg("weights"),
        py::arg("feature_col"), py::arg("batch"), py::arg("mean"), py::arg("grad"),
        py::arg("sums"), py::arg("error") = py::none());
  m.def("update_rows", &c::update_rows, "optimizer update of rows from summed gradients",
        py::arg("tiers"), py::arg("row_ref"), py::arg("sums"), OPTIMIZER_ARGS,
        py::arg("error") = py::none(), py::arg("schedule") = py::none(),
        py::arg("row_format") = py::none(), py::arg("rounding") = py::none());
  m.def("sum_and_update_rows", &c::sum_and_update_rows,
        "each unique row's summed gradient applied where finite; returns the rows that were not",
        py::arg("tiers"), py::arg("row_ref"), py::arg("starts"), py::arg("rank"),
        py::arg("offsets"), py::arg("weights"), py::arg("feature_col"), py::arg("batch"),
        py::arg("mean"), py::arg("grad"), py::arg("dim"), OPTIMIZER_ARGS,
        py::arg("error") = py::none(), py::arg("schedule") = py::none(),
        py::arg("row_format") = py::none(), py::arg("rounding") = py::none());
  m.def("per_sample_weight_grad", &c::per_sample_weight_grad, "gradient of weights",
        py::arg("tiers"), py::arg("transient"), py::arg("row_ref"), py::arg("inverse"),
        py::arg("offsets"), py::arg("feature_col"), py::arg("batch"), py::arg("dim"),
        py::arg("grad"), py::arg("out"), py::arg("init") = py::none(),
        py::arg("error") = py::none(), py::arg("row_format") = py::none());
  m.def("occupied_slots", &c::occupied_slots, "occupied slots of a range");
  m.def("promotion_plan", &c::promotion_plan,
        "a padded batch's promotion into a cache: (cache_slots, plan, rank, order)");
  m.def("promotion_order", &c::promotion_order,
        "the cache call's (keys, tids, scores, buckets) in promotion order");
  m.def("promote_rows", &c::promote_rows,
        "victims written back, new rows copied in, row references written");
}
