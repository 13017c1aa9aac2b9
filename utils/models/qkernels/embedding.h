// Token embeddings kept as the file's blocks: the rows a pass looks up, decoded to float32.
//
// The values are those of utils/models/gguf_blocks.py's `decode` + `dequantize` (and so of the `gguf` package),
// bit for bit: the same float operations in the same order, one rounding each (the file is compiled with
// -ffp-contract=off): w = scale * q for Q8_0, Q5_0 and Q6_K (Q6_K's scale d * sc), w = scale * q - minimum for
// Q4_0 (minimum d * 8), Q4_1 (minimum -m) and Q4_K (scale d * sc, minimum dmin * m). Why: that decode is ~15 small
// torch calls, 0.3-0.4 ms a one-token pass of the 0.5B drafter (~2% of its step) where this takes microseconds.
#pragma once

#include "common.h"

namespace {

inline bool has_row_decoder(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q8_0 || type == Q4_K || type == Q6_K;
}

// Blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0) -> 32 values each.
inline void decode_legacy_row(int64_t type, const uint8_t* p, int64_t blocks, float* out) {
  const int64_t bytes = block_bytes(type);
  for (int64_t j = 0; j < blocks; ++j, p += bytes, out += QK) {
    const float d = f16(p);
    if (type == Q8_0) {
      for (int i = 0; i < QK; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(p[2 + i]));
      continue;
    }
    const uint8_t* qs = p + (type == Q4_0 ? 2 : type == Q4_1 ? 4 : 6);
    if (type == Q5_0) {  // value i: low nibble of byte i (i < 16) or high nibble of byte i - 16, bit i of qh as bit 4
      uint32_t qh;
      std::memcpy(&qh, p + 2, 4);
      for (int i = 0; i < 16; ++i) {
        const int low = (qs[i] & 0xF) | (((qh >> i) & 1) << 4), high = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        out[i] = d * static_cast<float>(low - 16);
        out[i + 16] = d * static_cast<float>(high - 16);
      }
      continue;
    }
    const float minimum = type == Q4_0 ? d * 8.0f : -f16(p + 2);
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>(qs[i] & 0xF) - minimum;
      out[i + 16] = d * static_cast<float>(qs[i] >> 4) - minimum;
    }
  }
}

// Super-blocks of 256 (Q4_K, Q6_K) -> 256 values each, in the order kquants.h's decode_k unpacks them.
inline void decode_k_row(int64_t type, const uint8_t* p, int64_t supers, float* out) {
  const int64_t bytes = block_bytes(type);
  for (int64_t s = 0; s < supers; ++s, p += bytes, out += QK_K) {
    if (type == Q6_K) {
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      const float d = f16(p + 208);
      for (int h = 0; h < 2; ++h)
        for (int t = 0; t < 4; ++t)
          for (int i = 0; i < QK; ++i) {
            const uint8_t* ql = p + 64 * h;
            const int low = ((t & 1) ? ql[32 + i] : ql[i]) >> ((t >> 1) * 4) & 0xF;
            const int value = 128 * h + 32 * t + i;
            const int u = low | (((p[128 + 32 * h + i] >> (2 * t)) & 3) << 4);
            out[value] = (d * static_cast<float>(scales[value / 16])) * static_cast<float>(u - 32);
          }
      continue;
    }
    const float d = f16(p), dmin = f16(p + 2);
    for (int sub = 0; sub < 8; ++sub) {
      int sc, m;
      scale_min_k4(sub, p + 4, &sc, &m);
      const float scale = d * static_cast<float>(sc), minimum = dmin * static_cast<float>(m);
      const uint8_t* qs = p + 16 + 32 * (sub / 2);
      for (int i = 0; i < QK; ++i)
        out[32 * sub + i] = scale * static_cast<float>((qs[i] >> ((sub & 1) * 4)) & 0xF) - minimum;
    }
  }
}

// Rows ids[0..n) of a table of `type` whose rows start `row_stride` bytes apart -> out [n, cols].
inline void decode_rows(int64_t type, const uint8_t* table, int64_t row_stride, int64_t cols, const int64_t* ids,
                        int64_t n, float* out) {
  const bool k = type == Q4_K || type == Q6_K;
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {  // one token's row is microseconds: a pass's few inline
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* p = table + ids[r] * row_stride;
      if (k)
        decode_k_row(type, p, cols / QK_K, out + r * cols);
      else
        decode_legacy_row(type, p, cols / QK, out + r * cols);
    }
  });
}

}  // namespace
