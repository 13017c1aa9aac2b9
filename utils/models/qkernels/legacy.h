// The types in blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) against 32-value activation blocks: portable,
// AVX2 and AVX-VNNI (also the AVX-512 path's, in tiles of up to 8 rows: matmul.h). IQ4_NL's 4-bit values index a
// table of signed levels (IQ4_LEVELS), so it runs as Q8_0 does once looked up (one shuffle).
#pragma once

#include "common.h"

namespace {

// One weight block of 32 of the legacy types, as every path sees it: w_i = a * v_i + b (Q8_0, IQ4_NL: signed v,
// b = 0; the others unsigned v).
inline bool signed_values(int64_t type) { return type == Q8_0 || type == IQ4_NL; }

struct WBlock {
  int16_t v[QK];
  float a, b;
};

// -- portable walkers: each calls f(block_index, WBlock) for the 32-blocks of one weight row, in order ---------

template <class F>
void walk_portable(int64_t type, const uint8_t* w, int64_t blocks32, F&& f) {
  WBlock blk;
  switch (type) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1:
    case IQ4_NL:
      for (int64_t j = 0; j < blocks32; ++j) {
        const int64_t bytes = block_bytes(type);
        const uint8_t* p = w + j * bytes;
        prefetch_ahead(p, bytes);
        const float d = f16(p);
        const bool five = type == Q5_0 || type == Q5_1;
        const uint8_t* qs = p + nibbles_at(type);
        uint32_t qh = 0;
        if (five) std::memcpy(&qh, p + (type == Q5_0 ? 2 : 4), 4);
        for (int i = 0; i < 16; ++i) {
          blk.v[i] = qs[i] & 0xF;
          blk.v[i + 16] = qs[i] >> 4;
          if (five) {
            blk.v[i] |= ((qh >> i) & 1) << 4;
            blk.v[i + 16] |= ((qh >> (i + 16)) & 1) << 4;
          }
          if (type == IQ4_NL) blk.v[i] = IQ4_LEVELS[blk.v[i]], blk.v[i + 16] = IQ4_LEVELS[blk.v[i + 16]];
        }
        blk.a = d;
        blk.b = type == Q4_0 ? -8.0f * d : type == Q5_0 ? -16.0f * d : type == IQ4_NL ? 0.0f : f16(p + 2);
        f(j, blk);
      }
      break;
    case Q8_0:
      for (int64_t j = 0; j < blocks32; ++j) {
        const uint8_t* p = w + j * 34;
        prefetch_ahead(p, 34);
        for (int i = 0; i < QK; ++i) blk.v[i] = static_cast<int8_t>(p[2 + i]);
        blk.a = f16(p);
        blk.b = 0.0f;
        f(j, blk);
      }
      break;
  }
}

// The offset term of one block for one activation block, identical on every path.
inline float offset_term(const WBlock& blk, const BlockQ8& x) { return blk.b * x.ds; }


// Each row keeps two accumulators (and two offset sums), one for even blocks and one for odd ones, so that a
// one-row pass is not bound by the latency of a single chain of dependent additions; they are combined at the
// end in one fixed order.
inline float finish(const float (&even)[8], const float (&odd)[8], float off_even, float off_odd) {
  float lanes[8];
  for (int l = 0; l < 8; ++l) lanes[l] = even[l] + odd[l];
  return lane_sum(lanes) + (off_even + off_odd);
}

template <int R>
void tile_portable(int64_t type, const uint8_t* w, int64_t blocks32, const BlockQ8* const* x, float* y, int64_t ldy) {
  float acc[R][2][8] = {};
  float off[R][2] = {};
  walk_portable(type, w, blocks32, [&](int64_t j, const WBlock& blk) {
    const int parity = static_cast<int>(j & 1);
    for (int r = 0; r < R; ++r) {
      const BlockQ8& xb = x[r][j];
      const float scale = xb.d * blk.a;
      for (int l = 0; l < 8; ++l) {
        int32_t lane = 0;
        for (int i = 4 * l; i < 4 * l + 4; ++i) lane += blk.v[i] * xb.q[i];
        acc[r][parity][l] = std::fma(static_cast<float>(lane), scale, acc[r][parity][l]);
      }
      if (!signed_values(type)) off[r][parity] += offset_term(blk, xb);  // as the AVX2 path: no offset there
    }
  });
  for (int r = 0; r < R; ++r) y[r * ldy] = finish(acc[r][0], acc[r][1], off[r][0], off[r][1]);
}

#ifdef SPECDEC_AVX2

// 8 int32 lanes, lane l = sum over bytes 4l..4l+3 of u * s (u unsigned, s signed), or with int16 scales `sc`
// per half for Q6_K. maddubs cannot saturate here: u <= 63 (127 for Q8_0's and IQ4_NL's |w|), |s| <= 127.
template <bool Vnni>
inline __m256i dot_lanes(__m256i u, __m256i s) {
#ifdef SPECDEC_VNNI
  if (Vnni) return SPECDEC_DPBUSD(_mm256_setzero_si256(), u, s);
#endif
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// The 32 unsigned values of a Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL block at p (IQ4_NL: the table's indices), and its
// float factors into blk. T is a compile-time type: with the type a runtime value, its tests cost a one-row pass
// ~20% of its time (the loop is short).
template <int64_t T>
inline __m256i nibble_values(const uint8_t* p, WBlock* blk) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + nibbles_at(T)));
  __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
  if (T == Q4_1 || T == Q5_1) {
    f16_pair(p, &blk->a, &blk->b);  // d and m
  } else {
    blk->a = f16(p);
    blk->b = T == Q4_0 ? -8.0f * blk->a : T == Q5_0 ? -16.0f * blk->a : 0.0f;
  }
  if (T == Q5_0 || T == Q5_1) {
    uint32_t qh;
    std::memcpy(&qh, p + (T == Q5_0 ? 2 : 4), 4);
    u = _mm256_or_si256(u, _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10)));
  }
  return u;
}

template <int R, bool Vnni>
struct Avx2Tile {
  const BlockQ8* const* x;
  __m256 acc[2][R];  // [block parity][row], as the portable path
  float off[2][R];

  explicit Avx2Tile(const BlockQ8* const* rows) : x(rows) {
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps(), off[0][r] = off[1][r] = 0.0f;
  }

  // One block of unsigned values u for all rows; Signed: Q8_0's or IQ4_NL's signed weights (u = |w|, activations
  // take w's sign). P is the block index's parity, a compile-time constant so the accumulators stay in registers.
  template <int P, bool Signed>
  inline void block(int64_t j, __m256i u, __m256i wsign, const WBlock& blk) {
    for (int r = 0; r < R; ++r) {
      const BlockQ8& xb = x[r][j];
      __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q));
      if (Signed) s = _mm256_sign_epi8(s, wsign);
      const __m256i lanes = dot_lanes<Vnni>(u, s);
      acc[P][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(xb.d * blk.a), acc[P][r]);
      if (!Signed) off[P][r] += offset_term(blk, xb);
    }
  }

  void store(float* y, int64_t ldy) {
    for (int r = 0; r < R; ++r)
      y[r * ldy] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + (off[0][r] + off[1][r]);
  }
};

template <int P>
using Parity = std::integral_constant<int, P>;

template <int R, bool Vnni, int64_t T>
__attribute__((flatten)) void tile_avx2_type(const uint8_t* w, int64_t blocks32, const BlockQ8* const* x, float* y,
                                             int64_t ldy) {
  Avx2Tile<R, Vnni> t(x);
  WBlock blk;
  constexpr int64_t bytes = block_bytes(T);
  auto one = [&](int64_t j, auto parity) {
    const uint8_t* p = w + j * bytes;
    if constexpr (T == Q8_0) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
      blk.a = f16(p);
      t.template block<decltype(parity)::value, true>(j, _mm256_abs_epi8(q), q, blk);
    } else if constexpr (T == IQ4_NL) {  // the levels looked up 32 at a time, then as Q8_0
      const __m256i v = _mm256_shuffle_epi8(iq4_levels256(), nibble_values<T>(p, &blk));
      t.template block<decltype(parity)::value, true>(j, _mm256_abs_epi8(v), v, blk);
    } else {
      const __m256i u = nibble_values<T>(p, &blk);
      t.template block<decltype(parity)::value, false>(j, u, _mm256_setzero_si256(), blk);
    }
  };
  int64_t j = 0;
  for (; j + 1 < blocks32; j += 2) prefetch_ahead(w + j * bytes, 2 * bytes), one(j, Parity<0>{}), one(j + 1, Parity<1>{});
  if (j < blocks32) one(j, Parity<0>{});
  t.store(y, ldy);
}

template <int R, bool Vnni>
void tile_avx2(int64_t type, const uint8_t* w, int64_t blocks32, const BlockQ8* const* x, float* y, int64_t ldy) {
  switch (type) {
    case Q4_0: return tile_avx2_type<R, Vnni, Q4_0>(w, blocks32, x, y, ldy);
    case Q4_1: return tile_avx2_type<R, Vnni, Q4_1>(w, blocks32, x, y, ldy);
    case Q5_0: return tile_avx2_type<R, Vnni, Q5_0>(w, blocks32, x, y, ldy);
    case Q5_1: return tile_avx2_type<R, Vnni, Q5_1>(w, blocks32, x, y, ldy);
    case IQ4_NL: return tile_avx2_type<R, Vnni, IQ4_NL>(w, blocks32, x, y, ldy);
    default: return tile_avx2_type<R, Vnni, Q8_0>(w, blocks32, x, y, ldy);
  }
}
#endif  // SPECDEC_AVX2

}  // namespace
