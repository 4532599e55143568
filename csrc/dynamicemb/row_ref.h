// Row references: where the row of a unique lookup lives, in one int64.
//
//   0 <= r < 2^61      slot r of the device tier's values  [C, width]
//   2^61 <= r < 2^62   row (r - 2^61) of this batch's transient rows  [T, dim]
//                      (read, never stored, never updated)
//   r >= 2^62          slot (r - 2^62) of the host store's values  [H, width]
//   r < 0              no row: the key's table's initializer computes it where it
//                      is read (InitRows); never stored, never updated
#pragma once

#include "dynamicemb/hash_primitives.h"  // DEMB_HD

namespace dynamicemb {

constexpr int64_t kTransientRowBit = int64_t{1} << 61;
constexpr int64_t kHostRowBit = int64_t{1} << 62;

// A row the table stores (a slot of either tier), which an update may write.
DEMB_HD bool is_stored_ref(int64_t r) {
  return r >= 0 && (r < kTransientRowBit || r >= kHostRowBit);
}

// Pointer to a referenced row that is not computed (r >= 0), given the row arrays.
DEMB_HD const float* row_of(int64_t r, const float* device, const float* host,
                            int64_t width, const float* transient, int64_t dim) {
  if (r >= kHostRowBit) return host + (r - kHostRowBit) * width;
  if (r >= kTransientRowBit) return transient + (r - kTransientRowBit) * dim;
  return device + r * width;
}

DEMB_HD float* stored_row_of(int64_t r, float* device, float* host, int64_t width) {
  return r >= kHostRowBit ? host + (r - kHostRowBit) * width : device + r * width;
}

}  // namespace dynamicemb
