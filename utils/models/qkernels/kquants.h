// The K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), IQ4_XS and the grid types (IQ3_S, IQ3_XXS, IQ2_S, IQ2_XS, IQ2_XXS,
// IQ1_S, IQ1_M) against 256-value activation blocks: portable and AVX2 (AVX-512: avx512.h, but the grid types).
// Each is read as values u, a scale per 16 values and an offset per 16 (KBlock), so one integer loop serves them all:
// Q2_K and Q3_K (Q3_K_M and Q2_K files, ggml-common.h's layouts) differ from Q4_K and Q6_K only in how their bits
// unpack; IQ4_XS's values are signed levels and the grid types' signed grid values, without an offset.
#pragma once

#include "common.h"
#include "iq_grids.h"

namespace {

// One weight super-block as every K path sees it: w_i = d * sc16[i / 16] * u_i + dm * mw16[i / 16], so a row's
// dot product is d * x.d * sum(sc16 * u * x.q) + dm * x.d * sum(mw16 * bsums).
struct KBlock {
  uint8_t u[QK_K];  // IQ4_XS, grid types: signed values (levels, grid values), stored as their bytes
  int16_t sc16[16], mw16[16];
  float d, dm;
  bool signed_u;
};

inline int k_value(const KBlock& b, int i) { return b.signed_u ? static_cast<int8_t>(b.u[i]) : b.u[i]; }

// Q3_K: sixteen 6-bit scales in twelve bytes (low nibbles: bytes 0..7, then their high nibbles; bits 4-5: two bits
// of bytes 8..11 each, scale i from byte 8 + i % 4 at bit 2 * (i / 4)), stored biased by 32.
inline int q3_k_scale(const uint8_t* sb, int i) {
  const int low = i < 8 ? sb[i] & 0xF : sb[i - 8] >> 4;
  return (low | (((sb[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32;
}

// IQ4_XS: eight 6-bit scales (one per 32 values, biased by 32): low four bits in the nibbles of bytes 4..7, high
// two in the 16-bit field at byte 2.
inline int iq4_xs_scale(const uint8_t* p, int ib) {
  const int high = ((p[2] | p[3] << 8) >> (2 * ib)) & 3;
  return (((p[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | high << 4) - 32;
}

// The IQ types whose values come from a grid (iq_grids.h): K blocks of signed values (a grid value and a sign bit
// each; IQ1_S, IQ1_M: 8 * (-1, 0, 1) and an offset +-1 per 32 or per 8 values), a scale 1 + 2s per 32 or per 16,
// no offset. Layouts are ggml-common.h's (the `gguf` package's decoders read the same bytes). Signed values
// (these and IQ4_XS's): maddubs takes |w| against the activations carrying w's sign.
constexpr bool is_grid_type(int64_t t) {
  return t == IQ3_S || t == IQ3_XXS || t == IQ2_XXS || t == IQ2_XS || t == IQ2_S || t == IQ1_S || t == IQ1_M;
}
constexpr bool is_iq1(int64_t t) { return t == IQ1_S || t == IQ1_M; }
constexpr bool signed_k_values(int64_t type) { return type == IQ4_XS || is_grid_type(type); }
// Q3_K and Q6_K: w = d * scale * (u - centre), a fixed offset, not a minimum per 16 values; 0 for the others.
constexpr int32_t centre_of(int64_t type) { return type == Q6_K ? 32 : type == Q3_K ? 4 : 0; }

// IQ3_S (IQ3_S and IQ3_M files), 110 bytes: d | 64 grid indices' low bytes | 8 bytes of their ninth bits | 32 bytes
// of sign bits | 4 bytes of scales. w = d * (1 + 2 * s) * g * sign: s a nibble per 32 values (low nibble first),
// g one of the four values of grid entry 8k + j (IQ3S_GRID) for values 32k + 4j.., a sign bit per value.
inline int iq3_s_scale(const uint8_t* p, int k) { return 1 + 2 * ((p[106 + k / 2] >> (4 * (k % 2))) & 0xF); }
inline uint32_t iq3_s_entry(const uint8_t* p, int k, int j) {
  return IQ3S_GRID[p[2 + 8 * k + j] | (((p[66 + k] >> j) & 1) << 8)];
}

// ksigns: a 7-bit code -> 8 sign bits, the eighth making their count even; four codes at bits 0, 7, 14, 21 -> four
// sign bytes (IQ3_XXS, IQ2_XXS, IQ2_XS).
inline uint32_t sign_byte(uint32_t code) { return code | ((__builtin_popcount(code) & 1u) << 7); }
inline uint32_t sign_bytes4(uint32_t aux) {
  return sign_byte(aux & 127) | sign_byte((aux >> 7) & 127) << 8 | sign_byte((aux >> 14) & 127) << 16 |
         sign_byte((aux >> 21) & 127) << 24;
}
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Values 32k..32k+31 of a grid type's super-block: their grid values, 8 a uint64 (IQ1_S, IQ1_M: signed 8 * g), and
// their sign bits (bit i: value 32k + i). IQ1 types have no sign bits: bit j of `signs` says whether the offset of
// values 8j..8j+7 is -1 (else +1).
//   IQ3_S   110 bytes: above.
//   IQ3_XXS  98 bytes: d | 64 indices (4 values each) | per 32 values a uint32: four sign codes and s (bits 28-31).
//   IQ2_XXS  66 bytes: d | per 32 values a uint32 of four indices (8 values each), a uint32 of sign codes and s.
//   IQ2_XS   74 bytes: d | per 8 values a uint16: index (9 bits) and sign code | 16 scales per 16, in nibbles.
//   IQ2_S    82 bytes: d | per 8 values an index's low byte | its sign bits | 2 high bits each | scales per 16.
//   IQ1_S    50 bytes: d | per 8 values an index's low byte | per 32 a uint16: 3 high bits per index, s (bits
//            12-14) and the sign of the sub-block's offset +-1/8 (bit 15).
//   IQ1_M    56 bytes: per 8 values an index's low byte | per 8 values a nibble: 3 high bits, the offset's sign |
//            4 uint16: 3-bit scales per 16, and d's 16 bits in their top nibbles.
inline void grid_parts(int64_t type, const uint8_t* p, int k, uint64_t* g, uint32_t* signs) {
  const auto pair = [](uint32_t a, uint32_t b) { return a | static_cast<uint64_t>(b) << 32; };
  switch (type) {
    case IQ3_S:
      for (int j = 0; j < 4; ++j) g[j] = pair(iq3_s_entry(p, k, 2 * j), iq3_s_entry(p, k, 2 * j + 1));
      *signs = load_u32(p + 74 + 4 * k);
      return;
    case IQ3_XXS:
      for (int j = 0; j < 4; ++j) g[j] = pair(IQ3XXS_GRID[p[2 + 8 * k + 2 * j]], IQ3XXS_GRID[p[3 + 8 * k + 2 * j]]);
      *signs = sign_bytes4(load_u32(p + 66 + 4 * k));
      return;
    case IQ2_XXS:
      for (int j = 0; j < 4; ++j) g[j] = IQ2XXS_GRID[p[2 + 8 * k + j]];
      *signs = sign_bytes4(load_u32(p + 6 + 8 * k));
      return;
    case IQ2_XS:
      *signs = 0;
      for (int j = 0; j < 4; ++j) {
        const uint32_t q = p[2 + 8 * k + 2 * j] | p[3 + 8 * k + 2 * j] << 8;
        g[j] = IQ2XS_GRID[q & 511];
        *signs |= sign_byte(q >> 9) << (8 * j);
      }
      return;
    case IQ2_S:
      for (int j = 0; j < 4; ++j) g[j] = IQ2S_GRID[p[2 + 4 * k + j] | ((p[66 + k] >> (2 * j)) & 3) << 8];
      *signs = load_u32(p + 34 + 4 * k);
      return;
    case IQ1_S: {
      const uint32_t qh = p[34 + 2 * k] | p[35 + 2 * k] << 8;
      for (int j = 0; j < 4; ++j) g[j] = IQ1S_GRID[p[2 + 4 * k + j] | ((qh >> (3 * j)) & 7) << 8];
      *signs = qh >> 15 ? 0xF : 0;
      return;
    }
    default: {  // IQ1_M: group t = 4k + j of 8 values, its nibble t % 2 of byte 32 + t / 2
      *signs = 0;
      for (int j = 0; j < 4; ++j) {
        const int t = 4 * k + j, nibble = (p[32 + t / 2] >> (4 * (t % 2))) & 0xF;
        g[j] = IQ1S_GRID[p[t] | (nibble & 7) << 8];
        *signs |= static_cast<uint32_t>(nibble >> 3) << j;
      }
    }
  }
}

// The integer scale of values 16m..16m+15 of a grid type's super-block, and d (the float factor of every value).
inline int grid_scale16(int64_t type, const uint8_t* p, int m) {
  const int k = m / 2;
  switch (type) {
    case IQ3_S: return iq3_s_scale(p, k);
    case IQ3_XXS: return 1 + 2 * (p[69 + 4 * k] >> 4);  // bits 28-31 of the sub-block's uint32
    case IQ2_XXS: return 1 + 2 * (p[9 + 8 * k] >> 4);
    case IQ2_XS: return 1 + 2 * ((p[66 + m / 2] >> (4 * (m % 2))) & 15);
    case IQ2_S: return 1 + 2 * ((p[74 + m / 2] >> (4 * (m % 2))) & 15);
    case IQ1_S: return 1 + 2 * ((p[35 + 2 * k] >> 4) & 7);
    default: return 1 + 2 * (((p[48 + 2 * (m / 4)] | p[49 + 2 * (m / 4)] << 8) >> (3 * (m % 4))) & 7);  // IQ1_M
  }
}
// d * (0.5 + s) * 0.5 (IQ3_XXS) and * 0.25 (IQ2 types) as d / 4 and d / 8 times 1 + 2s (exact scalings);
// IQ1_S's and IQ1_M's d * (2s + 1) * (g +- 1/8) as d / 8 times 8g +- 1.
inline float grid_d(int64_t type, const uint8_t* p) {
  if (type == IQ1_M) {  // d's bits are the top nibbles of its four uint16 scales (bytes 49, 51, 53, 55), lowest first
    const uint8_t bits[2] = {static_cast<uint8_t>(p[49] >> 4 | (p[51] & 0xF0)),
                             static_cast<uint8_t>(p[53] >> 4 | (p[55] & 0xF0))};
    return f16(bits) * 0.125f;
  }
  const float d = f16(p);
  return type == IQ3_S ? d : type == IQ3_XXS ? d * 0.25f : d * 0.125f;
}

void decode_k(int64_t type, const uint8_t* p, KBlock* b) {
  b->signed_u = signed_k_values(type);
  if (is_grid_type(type)) {
    b->d = grid_d(type, p);
    b->dm = 0.0f;
    for (int k = 0; k < 8; ++k) {
      uint64_t g[4];
      uint32_t signs;
      grid_parts(type, p, k, g, &signs);
      for (int i = 0; i < QK; ++i) {
        const int m = static_cast<int8_t>((g[i / 8] >> (8 * (i % 8))) & 0xFF);  // (a grid value is at most 62)
        const int v = is_iq1(type) ? m + ((signs >> (i / 8)) & 1 ? -1 : 1) : (signs >> i) & 1 ? -m : m;
        b->u[32 * k + i] = static_cast<uint8_t>(v);
      }
    }
    for (int m = 0; m < 16; ++m) b->sc16[m] = static_cast<int16_t>(grid_scale16(type, p, m)), b->mw16[m] = 0;
    return;
  }
  if (type == IQ4_XS) {  // w = d * sc * level: value 32k + i indexes the levels by nibble i of bytes 8 + 16k..
    b->d = f16(p);
    b->dm = 0.0f;
    for (int k = 0; k < 8; ++k) {
      for (int i = 0; i < 16; ++i) {
        b->u[32 * k + i] = static_cast<uint8_t>(IQ4_LEVELS[p[8 + 16 * k + i] & 0xF]);
        b->u[32 * k + 16 + i] = static_cast<uint8_t>(IQ4_LEVELS[p[8 + 16 * k + i] >> 4]);
      }
      b->sc16[2 * k] = b->sc16[2 * k + 1] = static_cast<int16_t>(iq4_xs_scale(p, k));
      b->mw16[2 * k] = b->mw16[2 * k + 1] = 0;
    }
    return;
  }
  if (type == Q2_K || type == Q3_K) {
    // value 32k + i: two bits at 2 * (k % 4) of byte 32 * (k / 4) + i (Q3_K: and bit k of mask byte i as bit 2)
    const bool three = type == Q3_K;
    const uint8_t* qs = p + (three ? 32 : 16);
    for (int k = 0; k < 8; ++k)
      for (int i = 0; i < QK; ++i) {
        const int low = (qs[32 * (k / 4) + i] >> (2 * (k % 4))) & 3;
        b->u[32 * k + i] = static_cast<uint8_t>(three ? low | (((p[i] >> k) & 1) << 2) : low);
      }
    if (three) {  // w = d * sc * (u - 4)
      b->d = f16(p + 108);
      b->dm = -4.0f * b->d;
      for (int g = 0; g < 16; ++g) b->sc16[g] = b->mw16[g] = static_cast<int16_t>(q3_k_scale(p + 96, g));
    } else {  // w = d * (s & 15) * u - dmin * (s >> 4)
      b->d = f16(p + 80);
      b->dm = -f16(p + 82);
      for (int g = 0; g < 16; ++g) b->sc16[g] = p[g] & 0xF, b->mw16[g] = p[g] >> 4;
    }
    return;
  }
  if (type == Q6_K) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
    b->d = f16(p + 208);
    b->dm = -32.0f * b->d;
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 4; ++t)
        for (int i = 0; i < QK; ++i) {
          const uint8_t* ql = p + 64 * h;
          const int low = (t & 1) ? ql[32 + i] : ql[i];
          b->u[128 * h + 32 * t + i] = static_cast<uint8_t>(((low >> ((t >> 1) * 4)) & 0xF) |
                                                            (((p[128 + 32 * h + i] >> (2 * t)) & 3) << 4));
        }
    for (int g = 0; g < 16; ++g) b->sc16[g] = b->mw16[g] = scales[g];
    return;
  }
  const bool five = type == Q5_K;
  const uint8_t* qs = p + (five ? 48 : 16);
  b->d = f16(p);
  b->dm = -f16(p + 2);
  for (int sub = 0; sub < 8; ++sub) {
    for (int i = 0; i < QK; ++i) {
      uint8_t v = (qs[32 * (sub / 2) + i] >> ((sub & 1) * 4)) & 0xF;
      if (five) v |= ((p[16 + i] >> sub) & 1) << 4;
      b->u[32 * sub + i] = v;
    }
    int sc, m;
    scale_min_k4(sub, p + 4, &sc, &m);
    b->sc16[2 * sub] = b->sc16[2 * sub + 1] = static_cast<int16_t>(sc);
    b->mw16[2 * sub] = b->mw16[2 * sub + 1] = static_cast<int16_t>(m);
  }
}

template <int R>
void tile_k_portable(int64_t type, const uint8_t* w, int64_t supers, int64_t bytes, const BlockQ8K* const* x, float* y,
                     int64_t ldy) {
  float acc[R][8] = {};
  KBlock b;
  for (int64_t s = 0; s < supers; ++s) {
    prefetch_ahead(w + s * bytes, bytes);
    decode_k(type, w + s * bytes, &b);
    for (int r = 0; r < R; ++r) {
      const BlockQ8K& xb = x[r][s];
      int32_t lanes[8] = {};
      for (int k = 0; k < 8; ++k)  // 32 values; lane l holds bytes 4l..4l+3, scaled by their group of 16
        for (int l = 0; l < 8; ++l) {
          int32_t sum = 0;
          for (int i = 32 * k + 4 * l; i < 32 * k + 4 * l + 4; ++i) sum += k_value(b, i) * xb.q[i];
          lanes[l] += sum * b.sc16[2 * k + l / 4];
        }
      const float scale = b.d * xb.d, offset_scale = b.dm * xb.d;
      const int32_t centre = centre_of(type);
      for (int l = 0; l < 8; ++l) {  // lane l: the offsets of groups 2l and 2l+1, as madd pairs them
        const int32_t m = b.mw16[2 * l] * xb.bsums[2 * l] + b.mw16[2 * l + 1] * xb.bsums[2 * l + 1];
        if (centre) {
          acc[r][l] = std::fma(static_cast<float>(lanes[l] - centre * m), scale, acc[r][l]);
        } else {
          acc[r][l] = std::fma(static_cast<float>(lanes[l]), scale, acc[r][l]);
          acc[r][l] = std::fma(static_cast<float>(m), offset_scale, acc[r][l]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = lane_sum(acc[r]);
}

#ifdef SPECDEC_AVX2
// The K-quants against 256-value activation blocks: per 32 values one maddubs and one madd (which applies the
// sub-block scales), per super-block two float multiply-adds (the values, then the offsets from the activation
// sums). Values are unpacked 32 at a time inside the loop over rows, so nothing of a super-block but its scales
// stays live: no spills with 16 vector registers.

// A super-block's scales: S holds the int16 scales of the even groups of 16 in its low lane and of the odd groups
// in its high lane (so one in-lane shuffle gives the scales of values 32k..32k+31); mw the minimum weights of the
// 16 groups in order; d and dm the float factors of values and of offsets.
struct KScales {
  __m256i S, mw;
  float d, dm;
};

template <int64_t T>
inline KScales k_scales(const uint8_t* p) {
  KScales k;
  const __m128i evens_odds = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  if (T == Q2_K) {  // scale and minimum weight in the low and high nibble of one byte per 16 values
    const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    k.S = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_and_si128(sm, m4), evens_odds));
    k.mw = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), m4));
    float dmin;
    f16_pair(p + 80, &k.d, &dmin);
    k.dm = -dmin;
    return k;
  }
  if (is_grid_type(T)) {  // sixteen scales (equal in pairs where they are per 32), as Q6_K's
    alignas(16) int8_t sc[16];
    for (int m = 0; m < 16; ++m) sc[m] = static_cast<int8_t>(grid_scale16(T, p, m));
    k.S = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(sc)), evens_odds));
    k.mw = _mm256_setzero_si256();
    k.d = grid_d(T, p);
    k.dm = 0.0f;
    return k;
  }
  if (T == IQ4_XS) {  // one scale per 32 values: the same eight in the even groups' lane and the odd groups'
    const __m128i eight = _mm_setr_epi16(
        static_cast<int16_t>(iq4_xs_scale(p, 0)), static_cast<int16_t>(iq4_xs_scale(p, 1)),
        static_cast<int16_t>(iq4_xs_scale(p, 2)), static_cast<int16_t>(iq4_xs_scale(p, 3)),
        static_cast<int16_t>(iq4_xs_scale(p, 4)), static_cast<int16_t>(iq4_xs_scale(p, 5)),
        static_cast<int16_t>(iq4_xs_scale(p, 6)), static_cast<int16_t>(iq4_xs_scale(p, 7)));
    k.S = _mm256_set_m128i(eight, eight);
    k.mw = _mm256_setzero_si256();
    k.d = f16(p);
    k.dm = 0.0f;
    return k;
  }
  if (T == Q3_K) {  // q3_k_scale's bits, sixteen at once: low nibbles, then two bits of bytes 8..11 each
    uint64_t low8;
    uint32_t top;
    std::memcpy(&low8, p + 96, 8);
    std::memcpy(&top, p + 104, 4);
    const __m128i l8 = _mm_cvtsi64_si128(static_cast<long long>(low8));
    const __m128i low = _mm_and_si128(_mm_unpacklo_epi64(l8, _mm_srli_epi16(l8, 4)), _mm_set1_epi8(0x0F));
    const __m128i two = _mm_and_si128(_mm_setr_epi32(static_cast<int>(top), static_cast<int>(top >> 2),
                                                     static_cast<int>(top >> 4), static_cast<int>(top >> 6)),
                                      _mm_set1_epi8(3));
    const __m128i sc8 = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(two, 4)), _mm_set1_epi8(32));
    k.S = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, evens_odds));
    k.mw = _mm256_cvtepi8_epi16(sc8);
    k.d = f16(p + 108);
    k.dm = -4.0f * k.d;
    return k;
  }
  if (T == Q6_K) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
    k.S = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, evens_odds));
    k.mw = _mm256_cvtepi8_epi16(sc8);
    k.d = f16(p + 208);
    k.dm = -32.0f * k.d;
    return k;
  }
  // The twelve bytes -> eight 6-bit scales (bytes 0..7 of sm) and eight 6-bit minimums (bytes 8..15), in vector
  // registers (scale_min_k4's bits): scales/mins 0..3 are the low six bits of bytes 0..3 / 4..7; 4..7 take the
  // low / high nibbles of bytes 8..11 and, as bits 4-5, the top two bits of bytes 0..3 / 4..7.
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));  // 12 scale bytes, 4 value bytes
  const __m128i low = _mm_shuffle_epi8(q, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i nibbles = _mm_blend_epi32(low, _mm_srli_epi16(low, 4), 0b1000);  // mins 4..7: high nibbles
  const __m128i bits =
      _mm_and_si128(nibbles, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15));
  const __m128i high = _mm_shuffle_epi8(q, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i top = _mm_srli_epi16(_mm_and_si128(high, _mm_set1_epi8(static_cast<char>(0xC0))), 2);
  const __m128i sm = _mm_or_si128(bits, top);
  // S: the scales as int16 in both lanes; mw: each minimum twice (groups 2j and 2j+1 are sub-block j), in order
  k.S = _mm256_permute4x64_epi64(_mm256_cvtepu8_epi16(sm), 0x44);
  const __m128i twice = _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  k.mw = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(sm, twice));
  float dmin;
  f16_pair(p, &k.d, &dmin);
  k.dm = -dmin;
  return k;
}

// Values 32k..32k+31 of a super-block as unsigned bytes (IQ4_XS: signed levels; K is a compile-time constant
// after unrolling). The grid types: grid_vectors.
template <int64_t T, int K>
inline __m256i k_values(const uint8_t* p) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  if (T == IQ4_XS) {  // 16 bytes: low nibbles are values 0..15, high nibbles 16..31, each a level's index
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 + 16 * K));
    const __m256i index = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
    return _mm256_shuffle_epi8(iq4_levels256(), index);
  }
  if (T == Q2_K || T == Q3_K) {  // decode_k's bits: two at 2 * (K % 4) of 32 bytes; Q3_K's mask bit K as bit 2
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (T == Q3_K ? 32 : 16) + 32 * (K / 4)));
    constexpr int shift = 2 * (K % 4);
    const __m256i u = _mm256_and_si256(shift ? _mm256_srli_epi16(q, shift) : q, _mm256_set1_epi8(3));
    if (T == Q2_K) return u;
    const __m256i mask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i bit = _mm256_and_si256(mask, _mm256_set1_epi8(static_cast<char>(1 << K)));
    return _mm256_or_si256(u, K < 2 ? _mm256_slli_epi16(bit, 2 - K) : K == 2 ? bit : _mm256_srli_epi16(bit, K - 2));
  }
  if (T == Q6_K) {
    constexpr int h = K / 4, t = K % 4;  // low nibbles: bytes 64h + 32(t&1) .., high nibble if t >= 2
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (t & 1)));
    const __m256i nib = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(low, 4) : low, m4);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
    // bits 2t, 2t+1 of qh are bits 4, 5 of the value: masked in place, then one shift (none for t = 2)
    const __m256i top = _mm256_and_si256(qh, _mm256_set1_epi8(static_cast<char>(3 << (2 * t))));
    const __m256i top4 = t == 0 ? _mm256_slli_epi16(top, 4) : t == 1 ? _mm256_slli_epi16(top, 2)
                                : t == 2 ? top : _mm256_srli_epi16(top, 2);
    return _mm256_or_si256(nib, top4);
  }
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (T == Q5_K ? 48 : 16) + 32 * (K / 2)));
  __m256i u = _mm256_and_si256(K % 2 ? _mm256_srli_epi16(q, 4) : q, m4);
  if (T == Q5_K) {  // bit K of each of the 32 high-bit bytes is bit 4 of value 32K + i
    const __m256i hbits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const __m256i bit = _mm256_and_si256(hbits, _mm256_set1_epi8(static_cast<char>(1 << K)));
    u = _mm256_or_si256(u, K <= 4 ? _mm256_slli_epi16(bit, 4 - K) : _mm256_srli_epi16(bit, K - 4));
  }
  return u;
}

// 32 sign bits (bit i: value i) as bytes: -1 where the value is negative, else +1 (sign_epi8's second operand).
inline __m256i signs_of(uint32_t bits) { return _mm256_or_si256(bytes_from_bits(bits), _mm256_set1_epi8(1)); }

// A grid type's values 32K..32K+31 as maddubs takes them: |w| and the sign to give the activations. IQ3_S and
// IQ3_XXS gather their eight 4-value entries (vpgatherdd); the others take four 8-value entries from grid_parts.
template <int64_t T, int K>
inline void grid_vectors(const uint8_t* p, __m256i* u, __m256i* sign) {
  if (T == IQ3_S || T == IQ3_XXS) {
    const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2 + 8 * K)));
    if (T == IQ3_S) {  // bit j of one byte is index j's ninth
      const __m256i ninth = _mm256_and_si256(
          _mm256_srlv_epi32(_mm256_set1_epi32(p[66 + K]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
          _mm256_set1_epi32(1));
      *u = _mm256_i32gather_epi32(reinterpret_cast<const int*>(IQ3S_GRID),
                                  _mm256_or_si256(low, _mm256_slli_epi32(ninth, 8)), 4);
      *sign = signs_of(load_u32(p + 74 + 4 * K));
    } else {
      *u = _mm256_i32gather_epi32(reinterpret_cast<const int*>(IQ3XXS_GRID), low, 4);
      *sign = signs_of(sign_bytes4(load_u32(p + 66 + 4 * K)));
    }
    return;
  }
  uint64_t g[4];
  uint32_t bits;
  grid_parts(T, p, K, g, &bits);
  const __m256i v = _mm256_setr_epi64x(static_cast<long long>(g[0]), static_cast<long long>(g[1]),
                                       static_cast<long long>(g[2]), static_cast<long long>(g[3]));
  if (is_iq1(T)) {  // signed 8g and the offsets, +1 or -1 (all bits set) per 8 values: never 0
    const auto offset = [bits](int j) {
      return static_cast<long long>(0x0101010101010101ULL | (0 - static_cast<uint64_t>((bits >> j) & 1)));
    };
    const __m256i w = _mm256_add_epi8(v, _mm256_setr_epi64x(offset(0), offset(1), offset(2), offset(3)));
    *u = _mm256_abs_epi8(w);
    *sign = w;
    return;
  }
  *u = v;
  *sign = signs_of(bits);
}

template <int R, int64_t T, int K>
inline void k_step(const uint8_t* p, const KScales& k, const BlockQ8K* const* x, int64_t s, __m256i* sumi) {
  // signed values as maddubs takes them: |w| against the activations with w's sign (|x| <= 127: exact). IQ4_XS:
  // |level| and the level as the sign (no level is 0, which would zero the activation instead).
  __m256i u, sign;
  if constexpr (is_grid_type(T)) {
    grid_vectors<T, K>(p, &u, &sign);
  } else {
    sign = k_values<T, K>(p);
    u = T == IQ4_XS ? _mm256_abs_epi8(sign) : sign;
  }
  const __m256i sc = _mm256_shuffle_epi8(k.S, _mm256_set1_epi16(static_cast<int16_t>((2 * K + 1) << 8 | 2 * K)));
  for (int r = 0; r < R; ++r) {
    __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r][s].q + 32 * K));
    if (signed_k_values(T)) xv = _mm256_sign_epi8(xv, sign);
    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), sc));
    // The sum must exist here: without this empty asm, GCC 12 reassociated each row's eight additions into a
    // tree, kept all 64 products of an 8-row tile live and spilled them to the stack; with it, 4-64 rows took
    // ~20% less time on the Zen 3 of benchmarks/RESULTS.md (same bits: integer sums). An asm vpaddd here (as
    // common.h's add_epi16_to) measured 1-5% slower (fourteenth pass).
    __asm__("" : "+x"(sumi[r]));
  }
}

// A super-block's integer lanes (lane l: bytes 4l..4l+3 of every 32 values, scaled) into a row's float
// accumulator: the values, then the offsets. Every vector path ends a super-block with this (or the next).
// d and dm: the super-block's factors in every lane; the products with the row's scale are vector multiplies
// (the same float products as scalar ones), so the broadcast is a load: ~5% less time at 8-64 rows on the Zen 3.
inline __m256 k_accumulate(__m256 acc, __m256i lanes, __m256 d, __m256 dm, __m256i mw, const BlockQ8K& xb) {
  const __m256 xd = _mm256_broadcast_ss(&xb.d);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_mul_ps(d, xd), acc);
  // the offsets per lane: lane l = mw[2l] * bsums[2l] + mw[2l+1] * bsums[2l+1], exact in integers
  const __m256i ms = _mm256_madd_epi16(mw, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums)));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_mul_ps(dm, xd), acc);
}

// The same for a centred type (Q3_K, Q6_K: w = d * scale * (u - centre), the offsets' weights the scales): the
// offsets leave the lanes as integers, then one float step, as the interleaved tiles and llama.cpp do. Two float
// steps lost the digits that the value and offset terms cancel (an outlier activation at 4096 inputs missed the
// float64 reference by more than the tests allow).
template <int Shift>
inline __m256 k_accumulate_centred(__m256 acc, __m256i lanes, __m256 d, __m256i mw, const BlockQ8K& xb) {
  const __m256 xd = _mm256_broadcast_ss(&xb.d);
  const __m256i ms = _mm256_madd_epi16(mw, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums)));
  const __m256i total = _mm256_sub_epi32(lanes, _mm256_slli_epi32(ms, Shift));  // lanes - centre * offsets
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, xd), acc);
}

// The super-block loop every vector K-quant tile runs: prefetch, scales, each row's integer lanes from
// `lanes_of(p, k, s, lanes)` (AVX2's layout, whatever width computed them), then the shared float step.
template <int R, int64_t T, class LanesOf>
inline void k_tile(const uint8_t* w, int64_t supers, const BlockQ8K* const* x, float* y, int64_t ldy,
                   LanesOf&& lanes_of) {
  constexpr int64_t bytes = block_bytes(T);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* p = w + s * bytes;
    prefetch_ahead(p, bytes);
    const KScales k = k_scales<T>(p);
    __m256i lanes[R];
    lanes_of(p, k, s, lanes);
    const __m256 d = _mm256_set1_ps(k.d), dm = _mm256_set1_ps(k.dm);
    for (int r = 0; r < R; ++r) {
      if constexpr (centre_of(T) != 0) {
        acc[r] = k_accumulate_centred<centre_of(T) == 32 ? 5 : 2>(acc[r], lanes[r], d, k.mw, x[r][s]);
      } else {
        acc[r] = k_accumulate(acc[r], lanes[r], d, dm, k.mw, x[r][s]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]);
}

template <int R, int64_t T>
__attribute__((flatten)) void tile_k_avx2_type(const uint8_t* w, int64_t supers, const BlockQ8K* const* x, float* y,
                                               int64_t ldy) {
  k_tile<R, T>(w, supers, x, y, ldy, [x](const uint8_t* p, const KScales& k, int64_t s, __m256i* sumi) {
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    k_step<R, T, 0>(p, k, x, s, sumi), k_step<R, T, 1>(p, k, x, s, sumi);
    k_step<R, T, 2>(p, k, x, s, sumi), k_step<R, T, 3>(p, k, x, s, sumi);
    k_step<R, T, 4>(p, k, x, s, sumi), k_step<R, T, 5>(p, k, x, s, sumi);
    k_step<R, T, 6>(p, k, x, s, sumi), k_step<R, T, 7>(p, k, x, s, sumi);
  });
}

// The IQ grid types' vector tiles exist for these widths only (tiles_k.cpp runs 3, 5, 6 and 7 rows on the next
// one, the extra rows repeating the first): their grid lookups made each width's tile costly to compile, 12 s of
// the first start's build for eight widths on the Zen 3 of benchmarks/RESULTS.md (thirty-fourth pass).
constexpr bool grid_tile_width(int64_t rows) { return rows == 1 || rows == 2 || rows == 4 || rows == 8; }

template <int R>
void tile_k_avx2(int64_t type, const uint8_t* w, int64_t supers, int64_t, const BlockQ8K* const* x, float* y,
                 int64_t ldy) {
  if constexpr (grid_tile_width(R)) {
    switch (type) {
      case IQ3_S: return tile_k_avx2_type<R, IQ3_S>(w, supers, x, y, ldy);
      case IQ3_XXS: return tile_k_avx2_type<R, IQ3_XXS>(w, supers, x, y, ldy);
      case IQ2_XXS: return tile_k_avx2_type<R, IQ2_XXS>(w, supers, x, y, ldy);
      case IQ2_XS: return tile_k_avx2_type<R, IQ2_XS>(w, supers, x, y, ldy);
      case IQ2_S: return tile_k_avx2_type<R, IQ2_S>(w, supers, x, y, ldy);
      case IQ1_S: return tile_k_avx2_type<R, IQ1_S>(w, supers, x, y, ldy);
      case IQ1_M: return tile_k_avx2_type<R, IQ1_M>(w, supers, x, y, ldy);
      default: break;
    }
  }
  switch (type) {
    case Q2_K: return tile_k_avx2_type<R, Q2_K>(w, supers, x, y, ldy);
    case Q3_K: return tile_k_avx2_type<R, Q3_K>(w, supers, x, y, ldy);
    case IQ4_XS: return tile_k_avx2_type<R, IQ4_XS>(w, supers, x, y, ldy);
    case Q4_K: return tile_k_avx2_type<R, Q4_K>(w, supers, x, y, ldy);
    case Q5_K: return tile_k_avx2_type<R, Q5_K>(w, supers, x, y, ldy);
    default: return tile_k_avx2_type<R, Q6_K>(w, supers, x, y, ldy);
  }
}
#endif  // SPECDEC_AVX2

}  // namespace
