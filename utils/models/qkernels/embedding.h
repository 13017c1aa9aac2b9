// Token embeddings kept as the file's blocks: the rows a pass looks up, decoded to float32.
//
// The values are those of utils/models/gguf_blocks.py's `decode` + `dequantize` (and so of the `gguf` package),
// bit for bit: the same float operations in the same order, one rounding each (the file is compiled with
// -ffp-contract=off): w = scale * q for Q8_0, Q5_0, IQ4_NL (q a level), Q6_K, Q3_K, IQ4_XS and the IQ grid types
// (the K types' scale d * sc; the grid types' d scaled by a power of two, exactly), w = scale * q - minimum for Q4_0
// (minimum d * 8), Q4_1, Q5_1 (minimum -m) and Q2_K, Q4_K, Q5_K (scale d * sc, minimum dmin * m). The types
// `gguf_blocks.py` does not decode match the `gguf` package's numpy decoder instead (tests/test_qkernels.py checks
// every type against it). Why: that decode is ~15 small torch calls, 0.3-0.4 ms a one-token pass of the 0.5B
// drafter (~2% of its step) where this takes microseconds.
#pragma once

#include "common.h"
#include "kquants.h"

namespace {

inline bool has_row_decoder(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q8_0 || type == Q2_K || type == Q3_K ||
         type == Q4_K || type == Q5_K || type == Q6_K || type == Q5_1 || type == IQ4_NL || type == IQ4_XS ||
         is_grid_type(type);
}

// Blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) -> 32 values each.
inline void decode_legacy_row(int64_t type, const uint8_t* p, int64_t blocks, float* out) {
  const int64_t bytes = block_bytes(type);
  for (int64_t j = 0; j < blocks; ++j, p += bytes, out += QK) {
    const float d = f16(p);
    if (type == Q8_0) {
      for (int i = 0; i < QK; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(p[2 + i]));
      continue;
    }
    const uint8_t* qs = p + nibbles_at(type);
    if (type == IQ4_NL) {
      for (int i = 0; i < 16; ++i) {
        out[i] = d * static_cast<float>(IQ4_LEVELS[qs[i] & 0xF]);
        out[i + 16] = d * static_cast<float>(IQ4_LEVELS[qs[i] >> 4]);
      }
      continue;
    }
    if (type == Q5_0 || type == Q5_1) {  // value i: nibble i of qs (low nibbles first), bit i of qh as bit 4
      uint32_t qh;
      std::memcpy(&qh, p + (type == Q5_0 ? 2 : 4), 4);
      const float m = type == Q5_1 ? f16(p + 2) : 0.0f;
      for (int i = 0; i < 16; ++i) {
        const int low = (qs[i] & 0xF) | (((qh >> i) & 1) << 4), high = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
        if (type == Q5_0) {
          out[i] = d * static_cast<float>(low - 16);
          out[i + 16] = d * static_cast<float>(high - 16);
        } else {  // as the gguf package: (d * q) + m
          out[i] = d * static_cast<float>(low) + m;
          out[i + 16] = d * static_cast<float>(high) + m;
        }
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

// Super-blocks of 256 (the K types) -> 256 values each, unpacked by kquants.h's decode_k (the tiles' own reading of
// the bits): Q6_K, Q3_K and IQ4_XS w = (d * sc) * (u - 32, 4 or 0; IQ4_XS's u a signed level), the others
// w = (d * sc) * u - dmin * m, as the torch and numpy decoders round them (decode_k keeps -dmin, whose negation is
// exact).
inline void decode_k_row(int64_t type, const uint8_t* p, int64_t supers, float* out) {
  const int64_t bytes = block_bytes(type);
  KBlock b;
  // a fixed offset (u - centre; IQ4_XS and the grid types: none, their values signed), not a minimum per 16
  const bool centred = centre_of(type) != 0 || signed_k_values(type);
  const int centre = centre_of(type);
  for (int64_t s = 0; s < supers; ++s, p += bytes, out += QK_K) {
    decode_k(type, p, &b);
    for (int i = 0; i < QK_K; ++i) {
      const int g = i / 16;
      const float scale = b.d * static_cast<float>(b.sc16[g]);
      out[i] = centred ? scale * static_cast<float>(k_value(b, i) - centre)
                       : scale * static_cast<float>(b.u[i]) - (-b.dm) * static_cast<float>(b.mw16[g]);
    }
  }
}

// One row of `type` (`cols` values) -> out.
inline void decode_row(int64_t type, const uint8_t* p, int64_t cols, float* out) {
  if (is_k_quant(type))
    decode_k_row(type, p, cols / QK_K, out);
  else
    decode_legacy_row(type, p, cols / QK, out);
}

// Rows ids[0..n) of a table of `type` whose rows start `row_stride` bytes apart -> out [n, cols].
inline void decode_rows(int64_t type, const uint8_t* table, int64_t row_stride, int64_t cols, const int64_t* ids,
                        int64_t n, float* out) {
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {  // one token's row is microseconds: a pass's few inline
    for (int64_t r = begin; r < end; ++r) decode_row(type, table + ids[r] * row_stride, cols, out + r * cols);
  });
}

}  // namespace
