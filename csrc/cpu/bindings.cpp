// Python bindings of the CPU kernels: the module dynamicemb._C, loaded only by
// dynamicemb/_ops.py.
#include <torch/extension.h>

#include <tuple>
#include <vector>

namespace dynamicemb {
namespace cpu {

at::Tensor hash_keys(const at::Tensor& keys, const at::Tensor& tids);
at::Tensor find(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
                const at::Tensor& tids, bool single_table);
at::Tensor upsert(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
                  const at::Tensor& tids, const c10::optional<at::Tensor>& given, int64_t rule, int64_t now,
                  bool evicts, bool can_grow, bool one_table, const at::Tensor& pending,
                  at::Tensor& slots, at::Tensor& status,
                  const c10::optional<at::Tensor>& prev_scores, at::Tensor& ev_keys,
                  at::Tensor& ev_tids, at::Tensor& ev_scores, at::Tensor& outcomes);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
dedup_upsert(
    const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
    const at::Tensor& tids, const c10::optional<at::Tensor>& frequencies, int64_t now,
    bool evicts, bool can_grow, bool one_table, at::Tensor& slots, at::Tensor& status,
    const c10::optional<at::Tensor>& prev_scores, at::Tensor& ev_keys, at::Tensor& ev_tids,
    at::Tensor& ev_scores, at::Tensor& outcomes);
int64_t check_offsets(const at::Tensor& offsets, int64_t num_indices);
void unpin(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& slots);
void undo_upsert(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& slots,
                 const at::Tensor& status, const at::Tensor& prev_scores,
                 const at::Tensor& ev_keys, const at::Tensor& ev_tids,
                 const at::Tensor& ev_scores);
at::Tensor grow(const std::vector<at::Tensor>& old_meta,
                const std::vector<at::Tensor>& new_meta, int64_t bc);
at::Tensor erase(const std::vector<at::Tensor>& meta, int64_t bc, const at::Tensor& keys,
                 const at::Tensor& tids);
at::Tensor occupied_slots(const std::vector<at::Tensor>& meta, int64_t bc, int64_t start,
                          int64_t end);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dedup(
    const at::Tensor& keys, const at::Tensor& tids,
    const c10::optional<at::Tensor>& frequencies, bool group);
void init_rows(at::Tensor& out, const at::Tensor& rows, const at::Tensor& keys,
               int64_t table, int64_t dim, int64_t mode, double mean, double std_dev,
               double lower, double upper, double value, int64_t seed);
void pooled_forward(const std::vector<at::Tensor>& tiers, const at::Tensor& transient,
                    const at::Tensor& row_slot, const at::Tensor& inverse,
                    const at::Tensor& offsets, const c10::optional<at::Tensor>& weights,
                    const at::Tensor& feature_col, int64_t batch, int64_t dim, bool mean,
                    at::Tensor& out);
void sequence_forward(const std::vector<at::Tensor>& tiers, const at::Tensor& transient,
                      const at::Tensor& row_slot, const at::Tensor& inverse, int64_t dim,
                      at::Tensor& out);
void fused_backward(const std::vector<at::Tensor>& tiers, const at::Tensor& row_slot,
                    const at::Tensor& starts, const at::Tensor& rank,
                    const at::Tensor& offsets, const c10::optional<at::Tensor>& weights,
                    const at::Tensor& feature_col, int64_t batch, int64_t dim, bool mean,
                    const at::Tensor& grad, int64_t kind, double lr, double eps,
                    double beta1, double beta2, double weight_decay, double step_size,
                    double bias_correction2_sqrt);
void per_sample_weight_grad(const std::vector<at::Tensor>& tiers,
                            const at::Tensor& transient, const at::Tensor& row_slot, const at::Tensor& inverse,
                            const at::Tensor& offsets, const at::Tensor& feature_col,
                            int64_t batch, int64_t dim, const at::Tensor& grad,
                            at::Tensor& out);

}  // namespace cpu
}  // namespace dynamicemb

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
