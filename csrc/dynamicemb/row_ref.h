// Row references: where the row of a unique lookup lives, in one int64.
//
//   0 <= r < 2^62      slot r of the device tier's values  [C, width]
//   r >= 2^62          slot (r - 2^62) of the host store's values  [H, width]
//   r < 0              row (-r - 1) of this batch's transient rows  [T, dim]
//                      (initialized, never stored, never updated)
#pragma once

#include "dynamicemb/hash_primitives.h"  // DEMB_HD

namespace dynamicemb {

constexpr int64_t kHostRowBit = int64_t{1} << 62;

DEMB_HD bool is_transient_ref(int64_t r) { return r < 0; }
DEMB_HD bool is_host_ref(int64_t r) { return r >= kHostRowBit; }

// Pointer to a referenced row, given the three row arrays.
DEMB_HD const float* row_of(int64_t r, const float* device, const float* host,
                            int64_t width, const float* transient, int64_t dim) {
  if (r < 0) return transient + (-r - 1) * dim;
  if (r >= kHostRowBit) return host + (r - kHostRowBit) * width;
  return device + r * width;
}

DEMB_HD float* stored_row_of(int64_t r, float* device, float* host, int64_t width) {
  return r >= kHostRowBit ? host + (r - kHostRowBit) * width : device + r * width;
}

}  // namespace dynamicemb
