// A drafter's weights re-quantised to Q4_1 when its model is prepared (utils/models/native_linear.py's
// `requantize_q4_1`): each row of the file's blocks decoded (embedding.h, the bits of gguf_blocks' decoder) and
// quantised again, the bits of that function's torch reference (`q4_1_reference`), which took 8.3 s of the 0.5B
// drafter's first preparation on the Zen 3 of benchmarks/RESULTS.md (its float32 copy, then ~10 tensor passes;
// this: 0.85 s).
//
// Per block of 32 values x: d = half((max - min) / 15), m = half(min), q = round((x - m) / d) clamped to 0..15 with
// round half to even and the division as a multiplication by 1 / d (0 where d is 0), float32 throughout; the block
// is d, m (float16, little-endian) and 16 bytes holding value i in the low nibble of byte i, value i + 16 in the
// high one.
#pragma once

#include "embedding.h"

namespace {

constexpr int64_t Q4_1_BLOCK_BYTES = 20;

inline void quantize_q4_1_row(const float* x, int64_t blocks, uint8_t* out) {
  for (int64_t j = 0; j < blocks; ++j, x += QK, out += Q4_1_BLOCK_BYTES) {
    float low = x[0], high = x[0];
    for (int i = 1; i < QK; ++i) low = std::min(low, x[i]), high = std::max(high, x[i]);
    // float16 rounding to nearest even, as torch's .half(); a minimum of -0 as +0, as the reference (the sign of a
    // zero minimum depends on the order min() meets them)
    const c10::Half d((high - low) / 15.0f), m(low + 0.0f);
    const float inverse = static_cast<float>(d) == 0.0f ? 0.0f : 1.0f / static_cast<float>(d);
    const float minimum = static_cast<float>(m);
    uint8_t q[QK];
    for (int i = 0; i < QK; ++i) {
      const float v = std::nearbyint((x[i] - minimum) * inverse);  // the default rounding: half to even
      q[i] = static_cast<uint8_t>(std::min(std::max(v, 0.0f), 15.0f));
    }
    std::memcpy(out, &d.x, 2);
    std::memcpy(out + 2, &m.x, 2);
    for (int i = 0; i < 16; ++i) out[4 + i] = static_cast<uint8_t>(q[i] | (q[i + 16] << 4));
  }
}

// rows [rows, cols / block * bytes] of `type` -> [rows, cols / 32 * 20] Q4_1 blocks
inline void requantize_rows_q4_1(int64_t type, const uint8_t* table, int64_t row_stride, int64_t rows, int64_t cols,
                                 uint8_t* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> values(cols);  // one decoded row at a time: no float32 copy of the tensor
    for (int64_t r = begin; r < end; ++r) {
      decode_row(type, table + r * row_stride, cols, values.data());
      quantize_q4_1_row(values.data(), cols / QK, out + r * (cols / QK * Q4_1_BLOCK_BYTES));
    }
  });
}

}  // namespace
