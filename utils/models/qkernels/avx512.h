// 512-bit tiles for the K-quants (AVX-512 BW/DQ/VL + VNNI): two 32-value steps per instruction, for tiles of 1 to
// 8 activation rows (32 vector registers). The legacy types run the 256-bit code (matmul.h says why).
//
// They compute the AVX2 path's bits. Each 256-bit half of a 512-bit register holds the lanes of one 32-value
// step (steps 2k and 2k+1 of a super-block), lane l the integer sum of bytes 4l..4l+3 as before. The sub-block
// scales apply through dpwssd (madd and add in one); the halves are added as integers at the end of the
// super-block, which is exact, so the lanes equal AVX2's, and the float code after that is AVX2's own
// (`k_accumulate`).
#pragma once

#include "kquants.h"

#ifdef SPECDEC_AVX512
namespace {

inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Values 64k..64k+63 of a super-block (steps 2k, 2k+1) as unsigned bytes.
template <int64_t T, int K2>
inline __m512i k_values512(const uint8_t* p) {
  if (T == Q4_K) {  // the 32 bytes of steps 2k and 2k+1: low nibbles, then high nibbles
    const __m256i q = load256(p + 16 + 32 * K2);
    return _mm512_and_si512(join(q, _mm256_srli_epi16(q, 4)), _mm512_set1_epi8(0x0F));
  }
  return join(k_values<T, 2 * K2>(p), k_values<T, 2 * K2 + 1>(p));
}

template <int R, int64_t T, int K2>
inline void k_step512(const uint8_t* p, __m512i S, const BlockQ8K* const* x, int64_t s, __m512i* sumi) {
  const __m512i u = k_values512<T, K2>(p);
  // the scales of steps 2k (low half) and 2k+1 (high half), picked from S as the AVX2 path picks them
  const __m512i pick = join(_mm256_set1_epi16(static_cast<int16_t>((4 * K2 + 1) << 8 | 4 * K2)),
                            _mm256_set1_epi16(static_cast<int16_t>((4 * K2 + 3) << 8 | (4 * K2 + 2))));
  const __m512i sc = _mm512_shuffle_epi8(S, pick);
  for (int r = 0; r < R; ++r) {
    const __m512i xv = _mm512_loadu_si512(x[r][s].q + 64 * K2);
    sumi[r] = _mm512_dpwssd_epi32(sumi[r], _mm512_maddubs_epi16(u, xv), sc);
  }
}

template <int R, int64_t T>
__attribute__((flatten)) void tile_k_avx512_type(const uint8_t* w, int64_t supers, const BlockQ8K* const* x, float* y,
                                                 int64_t ldy) {
  k_tile<R, T>(w, supers, x, y, ldy, [x](const uint8_t* p, const KScales& k, int64_t s, __m256i* lanes) {
    const __m512i S = _mm512_broadcast_i64x4(k.S);
    __m512i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm512_setzero_si512();
    k_step512<R, T, 0>(p, S, x, s, sumi), k_step512<R, T, 1>(p, S, x, s, sumi);
    k_step512<R, T, 2>(p, S, x, s, sumi), k_step512<R, T, 3>(p, S, x, s, sumi);
    for (int r = 0; r < R; ++r)
      lanes[r] = _mm256_add_epi32(_mm512_castsi512_si256(sumi[r]), _mm512_extracti64x4_epi64(sumi[r], 1));
  });
}

template <int R>
void tile_k_avx512(int64_t type, const uint8_t* w, int64_t supers, int64_t, const BlockQ8K* const* x, float* y,
                   int64_t ldy) {
  switch (type) {
    case Q4_K: return tile_k_avx512_type<R, Q4_K>(w, supers, x, y, ldy);
    case Q5_K: return tile_k_avx512_type<R, Q5_K>(w, supers, x, y, ldy);
    default: return tile_k_avx512_type<R, Q6_K>(w, supers, x, y, ldy);
  }
}

}  // namespace
#endif  // SPECDEC_AVX512
