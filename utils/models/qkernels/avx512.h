// 512-bit tiles for the K-quants (AVX-512 BW/DQ/VL + VNNI): two 32-value steps per instruction, for tiles of 1 to
// 8 activation rows (32 vector registers); then those of the interleaved layouts (below). The legacy types run the
// 256-bit code (tiles_legacy.cpp's run_tile says why).
//
// They compute the AVX2 path's bits. Each 256-bit half of a 512-bit register holds the lanes of one 32-value
// step (steps 2k and 2k+1 of a super-block), lane l the integer sum of bytes 4l..4l+3 as before. The sub-block
// scales apply through dpwssd (madd and add in one); the halves are added as integers at the end of the
// super-block, which is exact, so the lanes equal AVX2's, and the float code after that is AVX2's own
// (`k_accumulate`).
#pragma once

#include "interleaved.h"
#include "kquants.h"

#ifdef SPECDEC_AVX512
namespace {

inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Values 64k..64k+63 of a super-block (steps 2k, 2k+1) as bytes (unsigned; IQ4_XS: signed levels).
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
  const __m512i v = k_values512<T, K2>(p);
  // IQ4_XS's signed values: |w|, and the activations negated where w < 0 (AVX-512 has no byte sign instruction)
  const __m512i u = T == IQ4_XS ? _mm512_abs_epi8(v) : v;
  const __mmask64 negative = T == IQ4_XS ? _mm512_movepi8_mask(v) : 0;
  // the scales of steps 2k (low half) and 2k+1 (high half), picked from S as the AVX2 path picks them
  const __m512i pick = join(_mm256_set1_epi16(static_cast<int16_t>((4 * K2 + 1) << 8 | 4 * K2)),
                            _mm256_set1_epi16(static_cast<int16_t>((4 * K2 + 3) << 8 | (4 * K2 + 2))));
  const __m512i sc = _mm512_shuffle_epi8(S, pick);
  for (int r = 0; r < R; ++r) {
    __m512i xv = _mm512_loadu_si512(x[r][s].q + 64 * K2);
    if (T == IQ4_XS) xv = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
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
    case Q2_K: return tile_k_avx512_type<R, Q2_K>(w, supers, x, y, ldy);
    case Q3_K: return tile_k_avx512_type<R, Q3_K>(w, supers, x, y, ldy);
    case IQ4_XS: return tile_k_avx512_type<R, IQ4_XS>(w, supers, x, y, ldy);
    case Q4_K: return tile_k_avx512_type<R, Q4_K>(w, supers, x, y, ldy);
    case Q5_K: return tile_k_avx512_type<R, Q5_K>(w, supers, x, y, ldy);
    default: return tile_k_avx512_type<R, Q6_K>(w, supers, x, y, ldy);
  }
}

// -- the interleaved layouts (interleaved.h) ---------------------------------------------------------------------
// A 256-bit vector of those layouts holds 4 bytes of each of 8 rows (lane l: row l). Two consecutive vectors 2t
// and 2t+1 are loaded as one 512-bit vector and their lanes interleaved (dword 2l: row l's bytes of vector 2t,
// dword 2l+1: of vector 2t+1), so that one 8-byte broadcast of an activation row serves both. Row l's two dwords
// are added as integers before the float step, which is the AVX2 tile's own (x8_finish, x8_q4_1_accumulate, ...):
// the same exact integer sums, the same bits. One permute per 64 weight bytes, shared by the tile's 1-8 rows.
inline __m512i x8_pair(const uint8_t* p) {
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm512_permutexvar_epi32(order, _mm512_loadu_si512(p));
}

// Activation bytes q[0..7] in every 8-byte lane: bytes 0..3 meet vector 2t, bytes 4..7 vector 2t+1.
inline __m512i broadcast8(const int8_t* q) {
  int64_t v;
  std::memcpy(&v, q, sizeof(v));
  return _mm512_set1_epi64(v);
}

// Row l's two dwords (2l, 2l+1) -> lane l of 8: their exact sum.
inline __m256i x8_fold(__m512i v) { return _mm512_cvtepi64_epi32(_mm512_add_epi32(v, _mm512_srli_epi64(v, 32))); }

// Sub-blocks 2J (low nibbles) and 2J+1 (high) of a Q4_K_X8 super-block for R activation rows. Per sub-block, four
// 512-bit dpbusd (each 64 values of the 8 rows) sum 16 products into each dword (at most 16 * 15 * 127 = 30480 in
// magnitude: an int16 in int32's low half, its sign in the high half), and one dpwssd against the rows' scales as
// int16 pairs (scale, 0) adds value * scale into sumi. Measured against maddubs summed as int16 and then dpwssd
// (benchmarks/RESULTS.md, nineteenth pass): 0.71-0.77x the time at 8 and 40 rows; a vpmulld for the scales
// instead of the dpwssd: 0.83-0.87x. Five (Q5_K_X8): bit k of the fifth-bit pairs as bit 4 of the values (at most
// 31), and a dpwssd every two dpbusd (8 products a dword, at most 31496).
template <int R, int J, bool Five = false>
inline void x8_sub_pair512(const uint8_t* o, const BlockQ8K* const* x, int64_t s, __m512i* sumi) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // dword i <- scale i / 2
  constexpr int share = Five ? 360 : 296;  // a quarter of the super-block's bytes, prefetched by this pair
  const uint8_t* qs = o + 160 + 256 * J;
  __m512i v[4], h5[4];
  for (int t = 0; t < 4; ++t) {
    v[t] = x8_pair(qs + 64 * t);
    prefetch_after(o + share * J + 64 * t, v[t]);
    if (Five) h5[t] = x8_pair(o + X8_FIFTH_BITS + 64 * t);  // every pair of sub-blocks reads all four (from L1)
  }
  // 5 lines a pair of sub-blocks, 64 or 40 bytes apart (Five: 6): no line of the super-block left out
  prefetch_after(o + share * J + 256, v[3]);
  if (Five) prefetch_after(o + share * J + 320, v[3]);
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const int K = 2 * J + h;
    const __m512i sc = _mm512_permutexvar_epi32(
        spread, _mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 32 + 8 * K))));
    __m512i sub[R];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      __m512i u = _mm512_and_si512(h ? _mm512_srli_epi16(v[t], 4) : v[t], m4);
      if (Five)  // 16-bit shifts of at most 4: bit 4 of each byte comes from the same byte
        u = _mm512_or_si512(u, _mm512_and_si512(K < 4 ? _mm512_slli_epi16(h5[t], 4 - K)
                                                      : _mm512_srli_epi16(h5[t], K - 4), bit4));
      for (int r = 0; r < R; ++r) {
        const bool first = Five ? t % 2 == 0 : t == 0;
        sub[r] = _mm512_dpbusd_epi32(first ? _mm512_setzero_si512() : sub[r], u,
                                     broadcast8(x[r][s].q + 32 * K + 8 * t));
        if (Five ? t % 2 == 1 : t == 3) sumi[r] = _mm512_dpwssd_epi32(sumi[r], sub[r], sc);
      }
    }
  }
}

// Q4_K_X8, or Q5_K_X8 where Five.
template <int R, bool Five = false>
__attribute__((flatten)) void tile_x8_avx512(const uint8_t* w, int64_t supers, const BlockQ8K* const* x, float* y,
                                             int64_t ldy) {
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_setzero_ps());
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * (Five ? X8_Q5K_BYTES : X8_BYTES);
    __m512i sumi512[R];
    for (int r = 0; r < R; ++r) sumi512[r] = _mm512_setzero_si512();
    x8_sub_pair512<R, 0, Five>(o, x, s, sumi512), x8_sub_pair512<R, 1, Five>(o, x, s, sumi512);
    x8_sub_pair512<R, 2, Five>(o, x, s, sumi512), x8_sub_pair512<R, 3, Five>(o, x, s, sumi512);
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = x8_fold(sumi512[r]);
    x8_finish<R>(o, x, s, sumi, y, ldy);
  }
}

// Q4_1_X8: a block's four vectors as two pairs, low and high nibbles; dpbusd sums each 4 products in int32, so a
// block of a row takes four multiplies (the AVX2 tile: eight maddubs and a madd).
template <int R>
__attribute__((flatten, noinline)) void tile_x8_q4_1_avx512(const uint8_t* w, int64_t blocks, const BlockQ8* const* x,
                                                            float* y, int64_t ldy) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m256 acc[R];  // lane l: output row l
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* o = w + b * X8_Q41_BYTES;
    const __m512i v0 = x8_pair(o + 32), v1 = x8_pair(o + 96);
    prefetch_after(o, v0);  // a block's 160 bytes: 3 lines
    prefetch_after(o + 64, v0);
    prefetch_after(o + 128, v1);
    const __m512i lo0 = _mm512_and_si512(v0, m4), hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
    const __m512i lo1 = _mm512_and_si512(v1, m4), hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = x[r][b].q;  // values 8t.. of a pair's low nibbles, 16 + 8t.. of its high ones
      __m512i sumi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo0, broadcast8(q));
      sumi = _mm512_dpbusd_epi32(sumi, lo1, broadcast8(q + 8));
      sumi = _mm512_dpbusd_epi32(sumi, hi0, broadcast8(q + 16));
      sumi = _mm512_dpbusd_epi32(sumi, hi1, broadcast8(q + 24));
      x8_q4_1_accumulate(o, x[r][b], x8_fold(sumi), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// Q8_0_X8: a block's eight vectors as four pairs, made unsigned (w ^ 0x80 = w + 128) once for all rows; four
// dpbusd a block and row, less 128 * sum(q) (interleaved.h).
template <int R>
__attribute__((flatten, noinline)) void tile_x8_q8_0_avx512(const uint8_t* w, int64_t blocks, const BlockQ8* const* x,
                                                            float* y, int64_t ldy) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m256 acc[R];  // lane l: output row l
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* o = w + b * X8_Q80_BYTES;
    __m512i u[4];
    for (int t = 0; t < 4; ++t) {
      u[t] = _mm512_xor_si512(x8_pair(o + 16 + 64 * t), flip);
      prefetch_after(o + 64 * t, u[t]);  // a block's 272 bytes: 5 lines
    }
    prefetch_after(o + 256, u[3]);
    for (int r = 0; r < R; ++r) {
      const int8_t* q = x[r][b].q;  // bytes 8t..8t+7 meet pair t
      __m512i sumi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], broadcast8(q));
      sumi = _mm512_dpbusd_epi32(sumi, u[1], broadcast8(q + 8));
      sumi = _mm512_dpbusd_epi32(sumi, u[2], broadcast8(q + 16));
      sumi = _mm512_dpbusd_epi32(sumi, u[3], broadcast8(q + 24));
      x8_q8_0_accumulate(o, x[r][b], _mm256_sub_epi32(x8_fold(sumi), x8_q8_0_bias(x[r][b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// The scales of group g of 8 rows for dpwssd: dwords 2l and 2l + 1 (row l's two dwords after x8_pair) hold (row l's
// scale, 0) as int16. Int8 at o + 16 + 8g (Q6_K_X8, Q3_K_X8), or with `nibble` the low nibbles of the bytes at
// o + 32 + 8g (Q2_K_X8).
inline __m512i x8_group_scales512(const uint8_t* o, int g, bool nibble = false) {
  const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // dword i <- scale i / 2
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + (nibble ? 32 : 16) + 8 * g));
  const __m512i scales = nibble ? _mm512_and_si512(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(0xF))
                                : _mm512_and_si512(_mm512_cvtepi8_epi32(bytes), _mm512_set1_epi32(0xFFFF));
  return _mm512_permutexvar_epi32(spread, scales);
}

// Q6_K_X8 (interleaved.h's layout): per chunk of 32 values, three 512-bit loads (N0 | N1, N2 | N3, H0 | H1) paired
// as above, so that value vectors 2p and 2p + 1 meet one 8-byte broadcast of the activations. A dpbusd puts 4
// products in a dword (at most 4 * 63 * 128 = 32256: an int16 and its sign, as in x8_sub_pair512), and a dpwssd
// against the rows' scales as int16 pairs (scale, 0) adds value * scale into sumi: two multiplies a 64 values of
// 8 rows, where the file's layout takes two a 64 values of one row, plus a float step per row and super-block.
// Mode: where the value vectors come from, as in AVX2's tile (interleaved.h's Unpack): a chunk's four pairs take
// 256 of the super-block's X8_UNPACKED_BYTES in `unpacked`.
template <int R, Unpack Mode = Unpack::none>
__attribute__((flatten)) void tile_x8_q6_k_avx512(const uint8_t* w, int64_t supers, const BlockQ8K* const* x,
                                                  float* y, int64_t ldy, uint8_t* unpacked = nullptr) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_setzero_ps());
  // Chains of dpwssd a row: with few rows one chain would wait on each dpwssd's latency (the four are added as
  // integers at the end: the same sums).
  constexpr int A = R <= 2 ? 4 : R <= 4 ? 2 : 1;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * X8_Q6K_BYTES;
    uint8_t* unpacked_s = unpacked + (Mode == Unpack::none ? 0 : s * X8_UNPACKED_BYTES);
    __m512i sumi512[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) sumi512[r][a] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int c = 0; c < 8; ++c) {
      __m512i u[4];
      if constexpr (Mode == Unpack::read) {
        for (int p = 0; p < 4; ++p) u[p] = _mm512_loadu_si512(unpacked_s + 256 * c + 64 * p);
      } else {
        const uint8_t* chunk = o + 144 + 192 * c;
        const __m512i n01 = x8_pair(chunk), n23 = x8_pair(chunk + 64), h = x8_pair(chunk + 128);
        prefetch_after(o + 210 * c, n01);  // an eighth of the super-block's lines a chunk
        prefetch_after(o + 210 * c + 64, n23);
        prefetch_after(o + 210 * c + 128, h);
        prefetch_after(o + 210 * c + 192, h);
        u[0] = _mm512_or_si512(_mm512_and_si512(n01, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m30));
        u[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n01, 4), m4),
                               _mm512_and_si512(_mm512_slli_epi16(h, 2), m30));
        u[2] = _mm512_or_si512(_mm512_and_si512(n23, m4), _mm512_and_si512(h, m30));
        u[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n23, 4), m4),
                               _mm512_and_si512(_mm512_srli_epi16(h, 2), m30));
        if constexpr (Mode == Unpack::write)
          for (int p = 0; p < 4; ++p) _mm512_storeu_si512(unpacked_s + 256 * c + 64 * p, u[p]);
      }
      const __m512i sc[2] = {x8_group_scales512(o, 2 * c), x8_group_scales512(o, 2 * c + 1)};
      for (int r = 0; r < R; ++r) {
        const int8_t* q = x[r][s].q + 32 * c;
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p)
          sumi512[r][p % A] = _mm512_dpwssd_epi32(
              sumi512[r][p % A], _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[p], broadcast8(q + 8 * p)), sc[p / 2]);
      }
    }
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) {
      for (int a = 1; a < A; ++a) sumi512[r][0] = _mm512_add_epi32(sumi512[r][0], sumi512[r][a]);
      sumi[r] = x8_fold(sumi512[r][0]);
    }
    x8_q6_k_finish<R>(o, x, s, sumi, y, ldy);
  }
}

// Q3_K_X8 and Q2_K_X8 (interleaved.h's layouts; L: Q3x8Avx2 or Q2x8Avx2, with values512 and scales512 below): per
// chunk of 32 values one 512-bit load of its two-bit vectors (T0 | T1; Q3_K: and one of its pair's third bits,
// E0 | E1), paired as above, so value vectors 2p and 2p + 1 come out of one shift each and meet one 8-byte
// broadcast of the activations. Two dpbusd put 8 products of a group in a dword (at most 8 * 7 * 127 = 7112: an
// int16 and its sign; dwords 2l and 2l + 1 hold its two halves until x8_fold), and one dpwssd against the rows'
// scales as (scale, 0) adds them.
template <int R, class L>
__attribute__((flatten)) void tile_x8_small_avx512(const uint8_t* w, int64_t supers, const BlockQ8K* const* x,
                                                   float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_setzero_ps());
  constexpr int A = R <= 2 ? 2 : 1;  // chains of dpwssd a row (Q6_K_X8's note)
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * L::bytes;
    __m512i sumi512[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) sumi512[r][a] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int c = 0; c < 8; ++c) {
      __m512i u[4];
      L::values512(o, c, u);
      const __m512i sc[2] = {L::scales512(o, 2 * c), L::scales512(o, 2 * c + 1)};
      for (int r = 0; r < R; ++r) {
        const int8_t* q = x[r][s].q + 32 * c;
        for (int g = 0; g < 2; ++g) {
          const __m512i dot = _mm512_dpbusd_epi32(
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[2 * g], broadcast8(q + 16 * g)), u[2 * g + 1],
              broadcast8(q + 16 * g + 8));
          sumi512[r][g % A] = _mm512_dpwssd_epi32(sumi512[r][g % A], dot, sc[g]);
        }
      }
    }
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) {
      for (int a = 1; a < A; ++a) sumi512[r][0] = _mm512_add_epi32(sumi512[r][0], sumi512[r][a]);
      sumi[r] = x8_fold(sumi512[r][0]);
    }
    L::template finish<R>(o, x, s, sumi, y, ldy);
  }
}

// Chunk c's value vector pairs 2p, 2p + 1 (p = 0..3) and group g's scale pairs, per layout.
struct Q3x8Avx512 : Q3x8Avx2 {
  static void values512(const uint8_t* o, int c, __m512i* u) {
    const uint8_t* pair = o + 144 + 192 * (c / 2);
    const __m512i t = x8_pair(pair + 64 * (c & 1)), e = x8_pair(pair + 128);
    prefetch_after(o + 114 * c, t);  // an eighth of the super-block's lines a chunk
    prefetch_after(o + 114 * c + 64, e);
    const __m512i e0 = _mm512_srli_epi16(e, 4 * (c & 1));
    for (int p = 0; p < 4; ++p)  // bit 2 of each byte from bit p of the same byte (16-bit shifts of at most 3)
      u[p] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(t, 2 * p), _mm512_set1_epi8(3)),
                             _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(e0, p), _mm512_set1_epi8(1)), 2));
  }
  static __m512i scales512(const uint8_t* o, int g) { return x8_group_scales512(o, g); }
};

struct Q2x8Avx512 : Q2x8Avx2 {
  static void values512(const uint8_t* o, int c, __m512i* u) {
    const __m512i t = x8_pair(o + 160 + 64 * c);
    prefetch_after(o + 84 * c, t);  // an eighth of the super-block's lines a chunk
    prefetch_after(o + 84 * c + 64, t);
    for (int p = 0; p < 4; ++p) u[p] = _mm512_and_si512(_mm512_srli_epi16(t, 2 * p), _mm512_set1_epi8(3));
  }
  static __m512i scales512(const uint8_t* o, int g) { return x8_group_scales512(o, g, true); }
};

// IQ4_XS_X8 (interleaved.h's layout): per pair of sub-blocks four 512-bit loads paired as above, the levels looked
// up (+ 128, unsigned) 64 at a time for the tile's rows; per sub-block and row four dpbusd and one vpmulld with the
// scales (a dword of 16 products reaches 489712: no dpwssd trick), the biased levels' offsets at the end.
template <int R>
__attribute__((flatten)) void tile_x8_iq4_xs_avx512(const uint8_t* w, int64_t supers, const BlockQ8K* const* x,
                                                    float* y, int64_t ldy) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i levels = _mm512_xor_si512(
      _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS))), flip);
  const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // dword i <- scale i / 2
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_setzero_ps());
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * X8_IQ4XS_BYTES;
    __m512i sumi512[R];
    for (int r = 0; r < R; ++r) sumi512[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i v[4];
      for (int t = 0; t < 4; ++t) {
        v[t] = x8_pair(o + 80 + 256 * j + 64 * t);
        prefetch_after(o + 276 * j + 64 * t, v[t]);
      }
      prefetch_after(o + 276 * j + 256, v[3]);  // 5 lines a pair of sub-blocks: all of the super-block's 1104 bytes
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512i sc = _mm512_permutexvar_epi32(
            spread, _mm512_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 16 + 8 * (2 * j + h)))));
        __m512i u[4];
        for (int t = 0; t < 4; ++t)
          u[t] = _mm512_shuffle_epi8(levels, _mm512_and_si512(h ? _mm512_srli_epi16(v[t], 4) : v[t], m4));
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x[r][s].q + 32 * (2 * j + h);
          __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], broadcast8(q));
          dot = _mm512_dpbusd_epi32(dot, u[1], broadcast8(q + 8));
          dot = _mm512_dpbusd_epi32(dot, u[2], broadcast8(q + 16));
          dot = _mm512_dpbusd_epi32(dot, u[3], broadcast8(q + 24));
          sumi512[r] = _mm512_add_epi32(sumi512[r], _mm512_mullo_epi32(dot, sc));
        }
      }
    }
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = x8_fold(sumi512[r]);
    x8_iq4_xs_finish<R>(o, x, s, sumi, true, y, ldy);
  }
}

}  // namespace
#endif  // SPECDEC_AVX512
