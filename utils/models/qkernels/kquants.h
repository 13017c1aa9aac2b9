// The K-quants (Q4_K, Q5_K, Q6_K) against 256-value activation blocks: portable and AVX2.
#pragma once

#include "common.h"

namespace {

// One weight super-block as every K path sees it: w_i = d * sc16[i / 16] * u_i + dm * mw16[i / 16], so a row's
// dot product is d * x.d * sum(sc16 * u * x.q) + dm * x.d * sum(mw16 * bsums).
struct KBlock {
  uint8_t u[QK_K];
  int16_t sc16[16], mw16[16];
  float d, dm;
};

void decode_k(int64_t type, const uint8_t* p, KBlock* b) {
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

inline int32_t offset_sum(const KBlock& b, const BlockQ8K& x) {
  int32_t m = 0;
  for (int g = 0; g < 16; ++g) m += b.mw16[g] * x.bsums[g];
  return m;
}

template <int R>
void tile_k_portable(int64_t type, const uint8_t* w, int64_t supers, int64_t bytes, const BlockQ8K* const* x, float* y,
                     int64_t ldy) {
  float acc[R][8] = {};
  float off[R] = {};
  KBlock b;
  for (int64_t s = 0; s < supers; ++s) {
    decode_k(type, w + s * bytes, &b);
    for (int r = 0; r < R; ++r) {
      const BlockQ8K& xb = x[r][s];
      int32_t lanes[8] = {};
      for (int k = 0; k < 8; ++k)  // 32 values; lane l holds bytes 4l..4l+3, scaled by their group of 16
        for (int l = 0; l < 8; ++l) {
          int32_t sum = 0;
          for (int i = 32 * k + 4 * l; i < 32 * k + 4 * l + 4; ++i) sum += b.u[i] * xb.q[i];
          lanes[l] += sum * b.sc16[2 * k + l / 4];
        }
      const float scale = b.d * xb.d;
      for (int l = 0; l < 8; ++l) acc[r][l] = std::fma(static_cast<float>(lanes[l]), scale, acc[r][l]);
      off[r] += (b.dm * xb.d) * static_cast<float>(offset_sum(b, xb));
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = lane_sum(acc[r]) + off[r];
}

#ifdef SPECDEC_AVX2
// The K-quants against 256-value activation blocks: per 32 values one maddubs and one madd (which applies the
// sub-block scales), per super-block one float multiply-add and the offsets from the activation sums.
template <int R>
__attribute__((flatten)) void tile_k_avx2(int64_t type, const uint8_t* w, int64_t supers, int64_t bytes,
                                          const BlockQ8K* const* x, float* y, int64_t ldy) {
  __m256 acc[R];
  float off[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), off[r] = 0.0f;
  const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(0x03), one = _mm256_set1_epi8(0x01);
  __m256i u[8], scv[8];
  alignas(32) int16_t sc16[16], mw16[16];
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* p = w + s * bytes;
    float d, dm;
    if (type == Q6_K) {
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      d = f16(p + 208);
      dm = -32.0f * d;
      for (int h = 0; h < 2; ++h) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
        for (int t = 0; t < 4; ++t) {
          const __m256i low = (t & 1) ? hi : lo;
          const __m256i nib = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(low, 4) : low, m4);
          const __m256i top = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), m3);
          u[4 * h + t] = _mm256_or_si256(nib, _mm256_slli_epi16(top, 4));
        }
      }
      const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(sc16), sc);
      _mm256_store_si256(reinterpret_cast<__m256i*>(mw16), sc);
    } else {
      const bool five = type == Q5_K;
      const uint8_t* qs = p + (five ? 48 : 16);
      const __m256i hbits = five ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)) : m4;
      d = f16(p);
      dm = -f16(p + 2);
      for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        u[2 * c] = _mm256_and_si256(q, m4);
        u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (five)
          for (int h = 0; h < 2; ++h) {
            const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * c + h)), one);
            u[2 * c + h] = _mm256_or_si256(u[2 * c + h], _mm256_slli_epi16(bit, 4));
          }
      }
      // the twelve bytes -> eight 6-bit scales (bytes 0..7 of sm) and eight 6-bit minimums (bytes 8..15), with
      // 32-bit masks instead of eight calls of scale_min_k4 (the same bits)
      uint32_t sm[4];
      std::memcpy(sm, p + 4, 12);
      const uint32_t m4lo = 0x3f3f3f3f, n4 = 0x0f0f0f0f, top = 0x03030303;
      sm[3] = ((sm[2] >> 4) & n4) | (((sm[1] >> 6) & top) << 4);
      const uint32_t mins_low = sm[1] & m4lo;
      sm[1] = (sm[2] & n4) | (((sm[0] >> 6) & top) << 4);
      sm[2] = mins_low;
      sm[0] &= m4lo;
      const __m128i both = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sm));
      const __m128i scales8 = _mm_cvtepu8_epi16(both), mins8 = _mm_cvtepu8_epi16(_mm_srli_si128(both, 8));
      _mm256_store_si256(reinterpret_cast<__m256i*>(sc16),  // each sub-block's scale for both of its groups of 16
                         _mm256_set_m128i(_mm_unpackhi_epi16(scales8, scales8), _mm_unpacklo_epi16(scales8, scales8)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(mw16),
                         _mm256_set_m128i(_mm_unpackhi_epi16(mins8, mins8), _mm_unpacklo_epi16(mins8, mins8)));
    }
    for (int k = 0; k < 8; ++k)  // the scales of values 32k..32k+15 (low half) and 32k+16..32k+31 (high half)
      scv[k] = _mm256_set_m128i(_mm_set1_epi16(sc16[2 * k + 1]), _mm_set1_epi16(sc16[2 * k]));
    const __m256i mw = _mm256_load_si256(reinterpret_cast<const __m256i*>(mw16));
    for (int r = 0; r < R; ++r) {
      const BlockQ8K& xb = x[r][s];
      __m256i sumi = _mm256_setzero_si256();
      for (int k = 0; k < 8; ++k) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q + 32 * k));
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], xv), scv[k]));
      }
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_set1_ps(d * xb.d), acc[r]);
      const __m256i ms = _mm256_madd_epi16(mw, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.bsums)));
      const __m128i m2 = _mm_add_epi32(_mm256_castsi256_si128(ms), _mm256_extracti128_si256(ms, 1));
      const __m128i m1 = _mm_add_epi32(m2, _mm_unpackhi_epi64(m2, m2));
      const int32_t msum = _mm_cvtsi128_si32(_mm_add_epi32(m1, _mm_shuffle_epi32(m1, 1)));  // exact: integers
      off[r] += (dm * xb.d) * static_cast<float>(msum);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]) + off[r];
}
#endif  // SPECDEC_AVX2

}  // namespace
