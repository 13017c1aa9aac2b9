// The K-quants, IQ4_XS, Q4_1 and Q8_0 with eight weight rows interleaved (Q2_K_X8, Q3_K_X8 and so on): the
// layouts, their conversions from and to the file's blocks, and their tiles (portable, AVX2 and its dpbusd variant
// for the VNNI path; AVX-512's are in avx512.h).
//
// Why: with one weight row per vector (kquants.h) every 32 values of a row take a maddubs and a madd, since the
// sub-block's scale must be applied before the next sub-block is added. With eight rows side by side, a vector
// holds 4 values of each of 8 rows, 8 such vectors cover a sub-block of 32, and their maddubs results (int16,
// each at most 2 * 15 * 127 = 3810, eight of them 30480 < 32767) are added as int16 before one madd applies the
// scales: 9 multiplies per 32 values of 8 rows instead of 16. Lane r of every vector is output row r, so no
// horizontal sum is left at the end. On the Zen 3 of benchmarks/RESULTS.md (eighth pass), weights streamed, two
// threads: 0.67-1.0x the one-row-per-vector tile's time at one activation row, 0.71-0.73x at 40.
//
// Layout of one super-block of 256 values of a group of 8 rows (X8_BYTES = 8 * 148 bytes; a group's super-blocks
// follow each other, then the next group; a tensor keeps the shape [out, in / 256 * 148] of row-equivalents):
//   [0, 16)      d of rows 0..7, float16
//   [16, 32)     dmin of rows 0..7, float16
//   [32, 96)     scale of sub-block k of row r at 32 + 8k + r (6 bits, as a byte)
//   [96, 160)    minimum of sub-block k of row r at 96 + 16 (k / 2) + 2r + k % 2 (pairs for madd with sum pairs)
//   [160, 1184)  the packed nibbles: bytes 4c..4c+3 of nibble pair j (sub-blocks 2j low, 2j+1 high nibbles) of
//                row r at 160 + 256j + 32c + 4r
// The scales are kept decoded (6-bit fields as bytes: 32 bytes more per 8 rows than the file's 1152, +2.8%):
// decoding the twelve packed bytes cost a one-row pass up to a third of its time.
#pragma once

#include "common.h"
#include "kquants.h"  // decode_k: Q6_K_X8, Q3_K_X8, Q2_K_X8 are made from the file's blocks as K tiles read them

namespace {

constexpr int64_t X8_ROWS = 8;
constexpr int64_t X8_BYTES = 8 * 148;  // one super-block of a group of 8 rows
constexpr int MR_X8 = 4;               // activation rows per tile: int16 sums, int32 sums, 3 of 16 registers free
// Q4_K_X8's and Q4_1_X8's AVX2 tiles take 5 rows (x8_tile_rows): their sums of 5 rows still fit the 16 registers
// (GCC spills no sum at 5 rows; at 6 it does).
// A 5-row verification pass then unpacks each weight vector once instead of twice (4 + 1): on the Zen 3 of
// benchmarks/RESULTS.md (thirty-fifth pass), products of 5 rows 0.85-0.94x the time (Q4_1: 0.86x), 9 rows
// 0.89-0.91x, 60 rows 0.97-0.99x; the 1.5B's passes of 5 and 9 rows 0.95x and 0.91x.
constexpr int MR_X8_FIVE = 5;

// Walks the blocks of a group of 8 rows, into the group (Back false: src the file's rows [8, blocks * file_bytes],
// dst the group) or back. For block b of row r it moves what Q4_K, Q5_K and Q4_1 keep as it is, then calls
// rest(o, p, r) with o the group's block and p the row's file block:
//   d and the minimum's factor (float16): file 0 and 2 <-> group 2r and 16 + 2r
//   nibble bytes 4i..4i+3 from `nibbles_at` in the file <-> group `vectors_at` + 32i + 4r, i < `runs`
template <bool Back, class F>
inline void walk_group(const uint8_t* src, int64_t blocks, int64_t file_bytes, int64_t group_bytes,
                       int64_t nibbles_at, int64_t vectors_at, int runs, uint8_t* dst, F&& rest) {
  const auto move = [](uint8_t* to, const uint8_t* from, int64_t n) { std::memcpy(to, from, n); };
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < 8; ++r) {
      const int64_t at_o = b * group_bytes, at_p = (r * blocks + b) * file_bytes;
      uint8_t* to = dst + (Back ? at_p : at_o);
      const uint8_t* from = src + (Back ? at_o : at_p);
      const auto pair = [&](int64_t file_at, int64_t group_at, int64_t n) {
        Back ? move(to + file_at, from + group_at, n) : move(to + group_at, from + file_at, n);
      };
      pair(0, 2 * r, 2);
      pair(2, 16 + 2 * r, 2);
      for (int i = 0; i < runs; ++i) pair(nibbles_at + 4 * i, vectors_at + 32 * i + 4 * r, 4);
      if constexpr (Back)
        rest(from, to, r);
      else
        rest(to, from, r);
    }
}

// The scales and minimums of row r's Q4_K or Q5_K block p (at p + 4, 6-bit fields) <-> group block o's bytes.
inline void x8_scales_in(uint8_t* o, const uint8_t* p, int r) {
  for (int k = 0; k < 8; ++k) {
    int sc, m;
    scale_min_k4(k, p + 4, &sc, &m);
    o[32 + 8 * k + r] = static_cast<uint8_t>(sc);
    o[96 + 16 * (k / 2) + 2 * r + k % 2] = static_cast<uint8_t>(m);
  }
}

inline void x8_scales_out(const uint8_t* o, uint8_t* p, int r) {  // packed again as scale_min_k4 reads them
  uint8_t sc[8], m[8];
  for (int k = 0; k < 8; ++k) sc[k] = o[32 + 8 * k + r], m[k] = o[96 + 16 * (k / 2) + 2 * r + k % 2];
  for (int j = 0; j < 4; ++j) {
    p[4 + j] = static_cast<uint8_t>((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
    p[8 + j] = static_cast<uint8_t>((m[j] & 63) | ((m[j + 4] >> 4) << 6));
    p[12 + j] = static_cast<uint8_t>((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
  }
}

// The file's K-quant blocks (`file_bytes` each) of rows [8g, 8g + 8) -> group g (`group_bytes` a super-block), from
// decode_k's reading: put(o, p, b, r) writes into the group's block o what row r keeps of its block p, decoded in b.
template <class F>
inline void interleave_decoded(int64_t type, const uint8_t* w, int64_t supers, int64_t file_bytes,
                               int64_t group_bytes, uint8_t* out, F&& put) {
  std::memset(out, 0, supers * group_bytes);
  KBlock b;
  for (int64_t s = 0; s < supers; ++s)
    for (int r = 0; r < 8; ++r) {
      const uint8_t* p = w + (r * supers + s) * file_bytes;
      decode_k(type, p, &b);
      put(out + s * group_bytes, p, b, r);
    }
}

// The file's Q4_K blocks of rows [8g, 8g + 8) -> group g in the layout above (the 6-bit scales and minimums
// decoded into bytes), or back byte for byte.
inline void interleave_group(const uint8_t* w, int64_t supers, uint8_t* out) {
  walk_group<false>(w, supers, 144, X8_BYTES, 16, 160, 32, out, x8_scales_in);
}

inline void deinterleave_group(const uint8_t* in, int64_t supers, uint8_t* w) {
  walk_group<true>(in, supers, 144, X8_BYTES, 16, 160, 32, w, x8_scales_out);
}

// -- Q5_K_X8 ------------------------------------------------------------------------------------------------------
// Q5_K in groups of 8 rows (Q5_K_M and Q5_K_S files): Q4_K_X8's 1184 bytes as above (d, dmin, the decoded scales
// and minimums, the low four bits of the values), then their fifth bits:
//   [1184, 1440) vector c (c = 0..7) at 1184 + 32c: bytes 4r..4r+3 are row r's file bytes qh[4c..4c+3], whose bit k
//                is the fifth bit of value 4c..4c+3 of sub-block k
// So vector c of sub-block k is Q4_K_X8's nibble vector with bit k of fifth-bit vector c as bit 4. 8 * 180 bytes a
// super-block of 8 rows (the file's 176 a row, + 4 for the decoded scales); a tensor's shape [out, in / 256 * 180].
// A value is at most 31, so maddubs's int16s (at most 2 * 31 * 127 = 7874) are summed four at a time (31496) and
// dpbusd's dwords take 8 products (as many): twice Q4_K_X8's scale multiplies, the same arithmetic per row
// otherwise, and Q4_K_X8's end of a super-block.
constexpr int64_t X8_Q5K_BYTES = 8 * 180;
constexpr int64_t X8_FIFTH_BITS = 1184;  // where the fifth-bit vectors start

// Q5_K's file block: d, dmin, scales[12], qh[32] at 16, qs[128] at 48.
inline void interleave_group_q5_k(const uint8_t* w, int64_t supers, uint8_t* out) {
  walk_group<false>(w, supers, 176, X8_Q5K_BYTES, 48, 160, 32, out, [](uint8_t* o, const uint8_t* p, int r) {
    x8_scales_in(o, p, r);
    for (int c = 0; c < 8; ++c) std::memcpy(o + X8_FIFTH_BITS + 32 * c + 4 * r, p + 16 + 4 * c, 4);
  });
}

inline void deinterleave_group_q5_k(const uint8_t* in, int64_t supers, uint8_t* w) {
  walk_group<true>(in, supers, 176, X8_Q5K_BYTES, 48, 160, 32, w, [](const uint8_t* o, uint8_t* p, int r) {
    x8_scales_out(o, p, r);
    for (int c = 0; c < 8; ++c) std::memcpy(p + 16 + 4 * c, o + X8_FIFTH_BITS + 32 * c + 4 * r, 4);
  });
}

// Sums of activation values per sub-block of 32, in the pairs the minimums are stored in: pair j holds sub-blocks
// 2j (low 16 bits) and 2j + 1 (high), each at most 32 * 127 in magnitude. Read from the block's sums32 as they
// lie (x86 is little-endian; only the AVX2 tile reads pairs), not summed here from bsums (common.h's note).
inline int32_t bsum_pair(const BlockQ8K& xb, int j) {
  int32_t pair;
  std::memcpy(&pair, xb.sums32 + 2 * j, sizeof(pair));
  return pair;
}

// Every path ends a super-block of a row the same way, per output lane r:
//   acc = fma(float(sumi), d * xd, acc); acc = fma(float(offsets), -dmin * xd, acc)
// with sumi and offsets exact integers; y holds acc between super-blocks. Five: Q5_K_X8.
template <int R, bool Five = false>
void tile_x8_portable(const uint8_t* w, int64_t supers, const BlockQ8K* const* x, float* y, int64_t ldy) {
  constexpr int64_t bytes = Five ? X8_Q5K_BYTES : X8_BYTES;
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 8; ++l) y[r * ldy + l] = 0.0f;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * bytes;
    prefetch_ahead(o, bytes);
    for (int r = 0; r < R; ++r) {
      const BlockQ8K& xb = x[r][s];
      for (int l = 0; l < 8; ++l) {
        int32_t sumi = 0, offsets = 0;
        for (int k = 0; k < 8; ++k) {
          int32_t sub = 0;
          for (int c = 0; c < 8; ++c)
            for (int i = 0; i < 4; ++i) {
              const uint8_t byte = o[160 + 256 * (k / 2) + 32 * c + 4 * l + i];
              int u = (k & 1) ? byte >> 4 : byte & 0xF;
              if (Five) u |= ((o[X8_FIFTH_BITS + 32 * c + 4 * l + i] >> k) & 1) << 4;
              sub += u * xb.q[32 * k + 4 * c + i];
            }
          sumi += sub * o[32 + 8 * k + l];
          offsets += o[96 + 16 * (k / 2) + 2 * l + k % 2] * (xb.bsums[2 * k] + xb.bsums[2 * k + 1]);
        }
        const float d = f16(o + 2 * l), dm = -f16(o + 16 + 2 * l);
        float& acc = y[r * ldy + l];
        acc = std::fma(static_cast<float>(sumi), d * xb.d, acc);
        acc = std::fma(static_cast<float>(offsets), dm * xb.d, acc);
      }
    }
  }
}

#ifdef SPECDEC_AVX2
// The lines PREFETCH_AHEAD (into L1) and PREFETCH_FAR (into L2) bytes past p, issued after `after` is loaded: each
// sub-block prefetches an eighth of a super-block (3 lines from byte 148K, some twice). __builtin_prefetch has no
// dependencies, and GCC hoisted all 48 to the super-block's start: in that burst, cold one-row passes took 1.0-1.3x
// the Q4_K tile's time, spread 0.67-1.0x (Zen 3, two threads, weights streamed). `after`: a 256- or 512-bit vector.
template <class Vector>
inline void prefetch_after(const uint8_t* p, Vector after) {
  __asm__ volatile("prefetcht0 %0" : : "m"(*(p + PREFETCH_AHEAD)), "v"(after));
  __asm__ volatile("prefetcht2 %0" : : "m"(*(p + PREFETCH_FAR)), "v"(after));
}

// Vector c (4 values x 8 rows) of sub-block K of a super-block as bytes: the low nibbles for an even K, the high
// ones for an odd K, with Q5_K_X8's fifth bits (bit K of fifth-bit vector c, moved to bit 4) where Five; the first
// three vectors prefetch the super-block's share of lines.
template <int K, bool Five = false>
inline __m256i x8_values(const uint8_t* o, int c) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 160 + 256 * (K / 2) + 32 * c));
  if (c < 3) prefetch_after(o + (Five ? 180 : 148) * K + 64 * c, q);
  const __m256i low = _mm256_and_si256(K & 1 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
  if constexpr (!Five) {
    return low;
  } else {  // 16-bit shifts of at most 4: bit 4 of each byte comes from the same byte
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + X8_FIFTH_BITS + 32 * c));
    const __m256i at4 = K < 4 ? _mm256_slli_epi16(h, 4 - K) : _mm256_srli_epi16(h, K - 4);
    return _mm256_or_si256(low, _mm256_and_si256(at4, _mm256_set1_epi8(0x10)));
  }
}

// An activation row's 4 bytes that meet vector c of sub-block K, in every lane: a broadcast load, no shuffle.
template <int K>
inline __m256i x8_activations(const BlockQ8K& xb, int c) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(xb.q + 32 * K + 4 * c)));
}

// Sub-block K of a super-block for R activation rows: 8 steps of (4 values x 8 rows) against each row's 4
// activation bytes broadcast, summed as int16, then one madd with the 8 rows' scales into sumi (Q5_K_X8: a madd
// every 4 steps, since its int16 sums would overflow past that).
template <int R, int K, bool Five = false>
inline void x8_sub_block(const uint8_t* o, const BlockQ8K* const* x, int64_t s, __m256i* sumi) {
  constexpr int run = Five ? 4 : 8;  // steps summed as int16: at most run * 2 * (Five ? 31 : 15) * 127 < 32768
  __m256i a16[R];
#pragma GCC unroll 8  // unrolled, a16 stays in registers (rolled: GCC kept it on the stack, 1.3x slower)
  for (int c = 0; c < 8; ++c) {
    const __m256i u = x8_values<K, Five>(o, c);
    for (int r = 0; r < R; ++r) {
      const __m256i p = _mm256_maddubs_epi16(u, x8_activations<K>(x[r][s], c));
      if (c % run == 0)
        a16[r] = p;
      else
        add_epi16_to(a16[r], p);
    }
    if (c % run == run - 1) {
      const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 32 + 8 * K));
      const __m256i sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));  // lanes 2r, 2r+1: row r's scale
      for (int r = 0; r < R; ++r) {
        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(a16[r], sc));
        __asm__("" : "+x"(sumi[r]));  // kept: an asm vpaddd here (as add_epi16_to) took 10% more time (14th pass)
      }
    }
  }
}

#ifdef SPECDEC_VNNI
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECDEC_DPWSSD(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#else
#define SPECDEC_DPWSSD(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#endif
// The same sub-block with VNNI: dpbusd sums each 4 products in int32, so four vectors put 16 products in a dword
// (at most 16 * 15 * 127 = 30480: an int16 in its low half, its sign in the high half), and a dpwssd against the
// rows' scales as int16 pairs (scale, 0) adds value * scale into sumi: 8 dpbusd and 2 dpwssd per row instead of
// 8 maddubs, 8 int16 additions and a madd. The same exact sums. Q5_K_X8: two vectors a dword (8 * 31 * 127 =
// 31496), 4 dpwssd.
template <int R, int K, bool Five = false>
inline void x8_sub_block_vnni(const uint8_t* o, const BlockQ8K* const* x, int64_t s, __m256i* sumi) {
  constexpr int run = Five ? 2 : 4;
  const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 32 + 8 * K)));
#pragma GCC unroll 4
  for (int part = 0; part < 8 / run; ++part) {
    __m256i sub[R];
#pragma GCC unroll 4
    for (int c = run * part; c < run * part + run; ++c) {
      const __m256i u = x8_values<K, Five>(o, c);
      for (int r = 0; r < R; ++r)
        sub[r] = SPECDEC_DPBUSD(c % run == 0 ? _mm256_setzero_si256() : sub[r], u, x8_activations<K>(x[r][s], c));
    }
    for (int r = 0; r < R; ++r) sumi[r] = SPECDEC_DPWSSD(sumi[r], sub[r], sc);
  }
}
#endif

// The end of a super-block on the vector paths, from the exact integer sums of its 8 rows (lane l: output row l):
// the offsets, then the portable path's two fmas, y holding acc between super-blocks.
template <int R>
inline void x8_finish(const uint8_t* o, const BlockQ8K* const* x, int64_t s, const __m256i* sumi, float* y,
                      int64_t ldy) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  const __m256 dm = _mm256_xor_ps(_mm256_set1_ps(-0.0f),  // -dmin, as the portable path's negation
                                  _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16))));
  for (int r = 0; r < R; ++r) {
    const BlockQ8K& xb = x[r][s];
    __m256i offsets = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 96 + 16 * j)));
      offsets = _mm256_add_epi32(offsets, _mm256_madd_epi16(mins, _mm256_set1_epi32(bsum_pair(xb, j))));
    }
    const __m256 xd = _mm256_broadcast_ss(&xb.d);
    __m256 acc = _mm256_loadu_ps(y + r * ldy);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(d, xd), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offsets), _mm256_mul_ps(dm, xd), acc);
    _mm256_storeu_ps(y + r * ldy, acc);
  }
}

template <int R, int K, bool Vnni, bool Five>
inline void x8_sub_block_on(const uint8_t* o, const BlockQ8K* const* x, int64_t s, __m256i* sumi) {
#ifdef SPECDEC_VNNI
  if constexpr (Vnni) return x8_sub_block_vnni<R, K, Five>(o, x, s, sumi);
#endif
  x8_sub_block<R, K, Five>(o, x, s, sumi);
}

// Q4_K_X8, or Q5_K_X8 where Five.
template <int R, bool Vnni = false, bool Five = false>
__attribute__((flatten)) void tile_x8_avx2(const uint8_t* w, int64_t supers, const BlockQ8K* const* x, float* y,
                                           int64_t ldy) {
  // The float accumulators live in y (one load and store per super-block and row): in registers they spill.
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_setzero_ps());
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * (Five ? X8_Q5K_BYTES : X8_BYTES);
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    x8_sub_block_on<R, 0, Vnni, Five>(o, x, s, sumi), x8_sub_block_on<R, 1, Vnni, Five>(o, x, s, sumi);
    x8_sub_block_on<R, 2, Vnni, Five>(o, x, s, sumi), x8_sub_block_on<R, 3, Vnni, Five>(o, x, s, sumi);
    x8_sub_block_on<R, 4, Vnni, Five>(o, x, s, sumi), x8_sub_block_on<R, 5, Vnni, Five>(o, x, s, sumi);
    x8_sub_block_on<R, 6, Vnni, Five>(o, x, s, sumi), x8_sub_block_on<R, 7, Vnni, Five>(o, x, s, sumi);
    x8_finish<R>(o, x, s, sumi, y, ldy);
  }
}
#endif  // SPECDEC_AVX2

// -- Q4_1_X8 ------------------------------------------------------------------------------------------------------
// Q4_1 in groups of 8 rows (the 0.5B drafter's re-quantised layers): a block of 32 values of 8 rows takes the file's
// 8 * 20 bytes, so a tensor keeps its shape [out, in / 32 * 20]:
//   [0, 16)    d of rows 0..7, float16
//   [16, 32)   m of rows 0..7, float16
//   [32, 160)  vector c (c = 0..3) at 32 + 32c: bytes 4r..4r+3 are row r's file bytes qs[4c..4c+3] (low nibbles
//              values 4c..4c+3, high nibbles values 16+4c..16+4c+3)
// The 8 maddubs of a block (4 vectors, low and high nibbles; each at most 2 * 15 * 127) are summed as int16
// (30480 < 32767) before one madd makes them int32 per row. Per block, in order, every path:
//   acc = fma(float(sumi), d * xd, acc); acc = fma(m, xd * sum(xq), acc)   (BlockQ8::ds is that product)
constexpr int64_t X8_Q41_BYTES = 8 * 20;

// Q4_1's blocks move as they are: nothing else to do per block.
inline void interleave_group_q4_1(const uint8_t* w, int64_t blocks, uint8_t* out) {
  walk_group<false>(w, blocks, 20, X8_Q41_BYTES, 4, 32, 4, out, [](uint8_t*, const uint8_t*, int) {});
}

inline void deinterleave_group_q4_1(const uint8_t* in, int64_t blocks, uint8_t* w) {
  walk_group<true>(in, blocks, 20, X8_Q41_BYTES, 4, 32, 4, w, [](const uint8_t*, uint8_t*, int) {});
}

template <int R>
void tile_x8_q4_1_portable(const uint8_t* w, int64_t blocks, const BlockQ8* const* x, float* y, int64_t ldy) {
  float acc[R][8] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* o = w + b * X8_Q41_BYTES;
    prefetch_ahead(o, X8_Q41_BYTES);
    for (int r = 0; r < R; ++r) {
      const BlockQ8& xb = x[r][b];
      for (int l = 0; l < 8; ++l) {
        int32_t sumi = 0;
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = o[32 + 32 * c + 4 * l + i];
            sumi += (byte & 0xF) * xb.q[4 * c + i] + (byte >> 4) * xb.q[16 + 4 * c + i];
          }
        acc[r][l] = std::fma(static_cast<float>(sumi), f16(o + 2 * l) * xb.d, acc[r][l]);
        acc[r][l] = std::fma(f16(o + 16 + 2 * l), xb.ds, acc[r][l]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 8; ++l) y[r * ldy + l] = acc[r][l];
}

#ifdef SPECDEC_AVX2
// A block of a row on the vector paths, from the exact integer sums of its 8 rows (lane l: output row l): the
// portable path's two fmas.
inline void x8_q4_1_accumulate(const uint8_t* o, const BlockQ8& xb, __m256i sumi, __m256& acc) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16)));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, _mm256_broadcast_ss(&xb.d)), acc);
  acc = _mm256_fmadd_ps(m, _mm256_broadcast_ss(&xb.ds), acc);
}

// noinline: inlined into mm_many's loop (as the 3- and 4-row tiles were), GCC kept the int16 sums on the stack (16
// stores and 7 loads a block of 32 maddubs); on its own, with one product live at a time, the 4-row loop stores
// only its float sums, once a block. 60-row products 0.84x the time, the drafter's 60-row pass 0.84-0.88x
// (benchmarks/RESULTS.md, seventeenth pass; the same bits). With VNNI (the VNNI path), eight dpbusd a block and
// row into one int32 sum instead of eight maddubs and a madd.
template <int R, bool Vnni = false>
__attribute__((flatten, noinline)) void tile_x8_q4_1_avx2(const uint8_t* w, int64_t blocks, const BlockQ8* const* x,
                                                          float* y, int64_t ldy) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R];  // lane l: output row l
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* o = w + b * X8_Q41_BYTES;
    __m256i sums[R];  // int16 pairs, or int32 with VNNI
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 32 + 32 * c));
      if (c < 3) prefetch_after(o + 64 * c, q);  // a block's 160 bytes: 3 lines
      const __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      for (int r = 0; r < R; ++r) {
        // one product at a time into the row's sum (both live before one addition: more spills)
        const int8_t* xq = x[r][b].q;
        const __m256i xl = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(xq + 4 * c)));
        const __m256i xh = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(xq + 16 + 4 * c)));
#ifdef SPECDEC_VNNI
        if constexpr (Vnni) {
          sums[r] = SPECDEC_DPBUSD(SPECDEC_DPBUSD(c == 0 ? _mm256_setzero_si256() : sums[r], lo, xl), hi, xh);
          continue;
        }
#endif
        if (c == 0)
          sums[r] = _mm256_maddubs_epi16(lo, xl);
        else
          add_epi16_to(sums[r], _mm256_maddubs_epi16(lo, xl));
        add_epi16_to(sums[r], _mm256_maddubs_epi16(hi, xh));
      }
    }
    for (int r = 0; r < R; ++r)
      x8_q4_1_accumulate(o, x[r][b], Vnni ? sums[r] : _mm256_madd_epi16(sums[r], ones), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}
#endif  // SPECDEC_AVX2

// -- Q8_0_X8 ------------------------------------------------------------------------------------------------------
// Q8_0 in groups of 8 rows (Q8_0 files: every layer). In the file's layout each block of a row and activation row
// ends in its own float step and a horizontal sum; at 9 rows a pass of a Q8_0 1.5B cost 3.1x its one-row pass. A
// block of 32 values of 8 rows takes the file's 8 * 34 bytes, so a tensor keeps its shape [out, in / 32 * 34]:
//   [0, 16)    d of rows 0..7, float16
//   [16, 272)  vector c (c = 0..7) at 16 + 32c: bytes 4r..4r+3 are row r's file bytes qs[4c..4c+3] (values 4c..4c+3)
// Per block, every path: sumi = the exact sum of w * q over the block (at most 32 * 128 * 127 in magnitude), then
// acc = fma(float(sumi), d * xd, acc). The values are signed: AVX2 takes |w| against q carrying w's sign (maddubs:
// at most 2 * 128 * 127 = 32512), the dpbusd paths w + 128 (w ^ 0x80, unsigned) less 128 * sum(q).
constexpr int64_t X8_Q80_BYTES = 8 * 34;

inline void interleave_group_q8_0(const uint8_t* w, int64_t blocks, uint8_t* out) {
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < 8; ++r) {
      const uint8_t* p = w + (r * blocks + b) * 34;
      uint8_t* o = out + b * X8_Q80_BYTES;
      std::memcpy(o + 2 * r, p, 2);
      for (int c = 0; c < 8; ++c) std::memcpy(o + 16 + 32 * c + 4 * r, p + 2 + 4 * c, 4);
    }
}

inline void deinterleave_group_q8_0(const uint8_t* in, int64_t blocks, uint8_t* w) {
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < 8; ++r) {
      uint8_t* p = w + (r * blocks + b) * 34;
      const uint8_t* o = in + b * X8_Q80_BYTES;
      std::memcpy(p, o + 2 * r, 2);
      for (int c = 0; c < 8; ++c) std::memcpy(p + 2 + 4 * c, o + 16 + 32 * c + 4 * r, 4);
    }
}

template <int R>
void tile_x8_q8_0_portable(const uint8_t* w, int64_t blocks, const BlockQ8* const* x, float* y, int64_t ldy) {
  float acc[R][8] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* o = w + b * X8_Q80_BYTES;
    prefetch_ahead(o, X8_Q80_BYTES);
    for (int r = 0; r < R; ++r) {
      const BlockQ8& xb = x[r][b];
      for (int l = 0; l < 8; ++l) {
        int32_t sumi = 0;
        for (int c = 0; c < 8; ++c)
          for (int i = 0; i < 4; ++i) sumi += static_cast<int8_t>(o[16 + 32 * c + 4 * l + i]) * xb.q[4 * c + i];
        acc[r][l] = std::fma(static_cast<float>(sumi), f16(o + 2 * l) * xb.d, acc[r][l]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 8; ++l) y[r * ldy + l] = acc[r][l];
}

#ifdef SPECDEC_AVX2
// A block of a row on the vector paths, from its 8 rows' exact sums (lane l: output row l): the portable path's fma.
inline void x8_q8_0_accumulate(const uint8_t* o, const BlockQ8& xb, __m256i sumi, __m256& acc) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, _mm256_broadcast_ss(&xb.d)), acc);
}

// 128 * sum(q) of an activation block: what w ^ 0x80 adds to a dpbusd sum.
inline __m256i x8_q8_0_bias(const BlockQ8& xb) { return _mm256_set1_epi32(128 * (xb.s[0] + xb.s[1])); }

// noinline as tile_x8_q4_1_avx2 (its note). AVX2: per vector and row a sign, a maddubs and a madd; VNNI: a dpbusd.
template <int R, bool Vnni = false>
__attribute__((flatten, noinline)) void tile_x8_q8_0_avx2(const uint8_t* w, int64_t blocks, const BlockQ8* const* x,
                                                          float* y, int64_t ldy) {
  __m256 acc[R];  // lane l: output row l
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* o = w + b * X8_Q80_BYTES;
    __m256i sums[R];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 16 + 32 * c));
      if (c % 2 == 0) prefetch_after(o + 32 * c, q);  // a block's 272 bytes: 5 lines
      if (c == 7) prefetch_after(o + 256, q);
      const __m256i u = Vnni ? _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80))) : _mm256_abs_epi8(q);
      for (int r = 0; r < R; ++r) {
        __m256i s = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(x[r][b].q + 4 * c)));
#ifdef SPECDEC_VNNI
        if constexpr (Vnni) {
          sums[r] = SPECDEC_DPBUSD(c == 0 ? _mm256_setzero_si256() : sums[r], u, s);
          continue;
        }
#endif
        s = _mm256_sign_epi8(s, q);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
        sums[r] = c == 0 ? p : _mm256_add_epi32(sums[r], p);
      }
    }
    for (int r = 0; r < R; ++r)
      x8_q8_0_accumulate(o, x[r][b], Vnni ? _mm256_sub_epi32(sums[r], x8_q8_0_bias(x[r][b])) : sums[r], acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}
#endif  // SPECDEC_AVX2

// -- Q6_K_X8 ------------------------------------------------------------------------------------------------------
// Q6_K in groups of 8 rows (the 1.5B target's head and half its down projections). In the file's layout each 32
// values of a row take a maddubs and a madd (its scales come every 16 values), and each super-block of a row and
// activation row ends in its own float step: at 40 rows a Q6_K product took 2.5x the time of an interleaved Q4_K
// one of the same shape (benchmarks/RESULTS.md, twenty-second pass). Here, as for Q4_K_X8, lane r of every vector is
// output row r, an activation row's bytes are broadcast, and one float step serves 8 rows. A super-block of 8
// rows takes the file's 8 * 210 bytes, so a tensor keeps its shape [out, in / 256 * 210]:
//   [0, 16)      d of rows 0..7, float16
//   [16, 144)    scale of group g (values 16g..16g+15) of row r at 16 + 8g + r (int8, as in the file)
//   [144, 1680)  chunk c (values 32c..32c+31 of the 8 rows) at 144 + 192c: nibble vectors N0..N3 at + 32n, two-bit
//                vectors H0, H1 at + 128 + 32m.
// Value vector j of a chunk (j = 0..7: values 32c + 4j .. 32c + 4j + 3, row r at bytes 4r..4r+3) is nibble vector
// N[(j & 1) + 2 (j >> 2)], its high nibbles if bit 1 of j is set, with bits 2 (j >> 1) and 2 (j >> 1) + 1 of
// H[j & 1] as bits 4 and 5. So N0 | N1 (one 512-bit load) holds vectors 0, 1 in its low nibbles and 2, 3 (the
// rest of group 2c) in its high ones, N2 | N3 those of group 2c + 1, and H0 | H1 the two-bit fields of all eight.
// Per row and super-block, every path: total = sum over groups g of scale_g * (sum of u * q - 32 * bsums_g), an
// exact int32 (at most 16 * 128 * 16 * 32 * 128 in magnitude), then acc = fma(float(total), d * xd, acc).
constexpr int64_t X8_Q6K_BYTES = 8 * 210;

constexpr int q6x8_nibble_vector(int j) { return (j & 1) + 2 * (j >> 2); }

// Byte i of row r in value vector j of a chunk: where its nibble and two-bit field lie, and their shifts.
struct Q6x8Place {
  int nibble_at, nibble_shift, two_at, two_shift;
};

constexpr Q6x8Place q6x8_place(int v, int r) {  // v: the value's index in the super-block (0..255)
  const int c = v / 32, j = v % 32 / 4, i = v % 4;
  return {144 + 192 * c + 32 * q6x8_nibble_vector(j) + 4 * r + i, 4 * ((j >> 1) & 1),
          144 + 192 * c + 128 + 32 * (j & 1) + 4 * r + i, 2 * (j >> 1)};
}

inline int q6x8_value(const uint8_t* o, int r, int v) {
  const Q6x8Place at = q6x8_place(v, r);
  return ((o[at.nibble_at] >> at.nibble_shift) & 0xF) | (((o[at.two_at] >> at.two_shift) & 3) << 4);
}

// The file's Q6_K blocks of rows [8g, 8g + 8) -> group g in the layout above, or back byte for byte (the file's
// ql, qh, scales and d: decode_k's reading of the bits, inverted).
inline void interleave_group_q6_k(const uint8_t* w, int64_t supers, uint8_t* out) {
  interleave_decoded(Q6_K, w, supers, 210, X8_Q6K_BYTES, out, [](uint8_t* o, const uint8_t* p, const KBlock& b, int r) {
    std::memcpy(o + 2 * r, p + 208, 2);
    for (int g = 0; g < 16; ++g) o[16 + 8 * g + r] = p[192 + g];
    for (int v = 0; v < QK_K; ++v) {
      const Q6x8Place at = q6x8_place(v, r);
      o[at.nibble_at] |= static_cast<uint8_t>((b.u[v] & 0xF) << at.nibble_shift);
      o[at.two_at] |= static_cast<uint8_t>((b.u[v] >> 4) << at.two_shift);
    }
  });
}

inline void deinterleave_group_q6_k(const uint8_t* in, int64_t supers, uint8_t* w) {
  for (int64_t s = 0; s < supers; ++s)
    for (int r = 0; r < 8; ++r) {
      const uint8_t* o = in + s * X8_Q6K_BYTES;
      uint8_t* p = w + (r * supers + s) * 210;
      std::memset(p, 0, 192);
      for (int v = 0; v < QK_K; ++v) {  // value 128h + 32t + i: ql[64h + 32 (t & 1) + i] nibble t >> 1, qh bits 2t
        const int u = q6x8_value(o, r, v), h = v / 128, t = v % 128 / 32, i = v % 32;
        p[64 * h + 32 * (t & 1) + i] |= static_cast<uint8_t>((u & 0xF) << (4 * (t >> 1)));
        p[128 + 32 * h + i] |= static_cast<uint8_t>((u >> 4) << (2 * t));
      }
      for (int g = 0; g < 16; ++g) p[192 + g] = o[16 + 8 * g + r];
      std::memcpy(p + 208, o + 2 * r, 2);
    }
}

// The portable tile of the layouts with an int8 scale per 16 values at 16 + 8g + l and values u - Offset (Q6_K_X8:
// u - 32, Q3_K_X8: u - 4), u read by Value(o, row, v).
template <int R, int64_t Bytes, int Offset, int (*Value)(const uint8_t*, int, int)>
void tile_x8_k16_portable(const uint8_t* w, int64_t supers, const BlockQ8K* const* x, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 8; ++l) y[r * ldy + l] = 0.0f;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * Bytes;
    prefetch_ahead(o, Bytes);
    for (int r = 0; r < R; ++r) {
      const BlockQ8K& xb = x[r][s];
      for (int l = 0; l < 8; ++l) {
        int32_t total = 0;
        for (int g = 0; g < 16; ++g) {
          int32_t dot = 0;
          for (int v = 16 * g; v < 16 * g + 16; ++v) dot += Value(o, l, v) * xb.q[v];
          total += static_cast<int8_t>(o[16 + 8 * g + l]) * (dot - Offset * xb.bsums[g]);
        }
        float& acc = y[r * ldy + l];
        acc = std::fma(static_cast<float>(total), f16(o + 2 * l) * xb.d, acc);
      }
    }
  }
}

#ifdef SPECDEC_AVX2
// The end of a super-block on the vector paths, from sumi (lane l: row l's sum of scale * u * q, exact): the
// offsets sum over g of scale_g * bsums_g (madd of the rows' scale pairs of groups 2j, 2j + 1 against the
// activation's bsums pair j), total = sumi - 2^Shift * offsets (Q6_K: 32, Q3_K_X8: 4), and the portable path's
// fma; y holds acc.
template <int R, int Shift = 5>
inline void x8_q6_k_finish(const uint8_t* o, const BlockQ8K* const* x, int64_t s, const __m256i* sumi, float* y,
                           int64_t ldy) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  __m256i pairs[8];  // int16 lanes 2l, 2l + 1: row l's scales of groups 2j, 2j + 1
  for (int j = 0; j < 8; ++j) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16 + 16 * j));
    pairs[j] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(v, _mm_srli_si128(v, 8)));
  }
  for (int r = 0; r < R; ++r) {
    const BlockQ8K& xb = x[r][s];
    __m256i offsets = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      int32_t bsum_pair;
      std::memcpy(&bsum_pair, xb.bsums + 2 * j, sizeof(bsum_pair));
      offsets = _mm256_add_epi32(offsets, _mm256_madd_epi16(pairs[j], _mm256_set1_epi32(bsum_pair)));
    }
    const __m256i total = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(offsets, Shift));
    const __m256 acc = _mm256_loadu_ps(y + r * ldy);
    _mm256_storeu_ps(y + r * ldy, _mm256_fmadd_ps(_mm256_cvtepi32_ps(total),
                                                  _mm256_mul_ps(d, _mm256_broadcast_ss(&xb.d)), acc));
  }
}

// Value vector J of a chunk as bytes 0..63 (the layout's rule above); k = J >> 1 picks the high nibbles (odd k) and
// the two-bit field (bits 2k, 2k + 1), moved to bits 4 and 5.
template <int J>
inline __m256i x8_q6_k_values(const uint8_t* chunk) {
  constexpr int n = q6x8_nibble_vector(J), k = J >> 1;
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * n));
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 128 + 32 * (J & 1)));
  const __m256i low = _mm256_and_si256(k & 1 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0F));
  const __m256i top = _mm256_and_si256(h, _mm256_set1_epi8(static_cast<char>(3 << (2 * k))));
  const __m256i top4 = k == 0 ? _mm256_slli_epi16(top, 4) : k == 1 ? _mm256_slli_epi16(top, 2)
                     : k == 2 ? top : _mm256_srli_epi16(top, 2);
  return _mm256_or_si256(low, top4);
}

// The values of a super-block of 8 rows unpacked: 8 steps of 8 vectors of 32 bytes, each as the tile computes it
// from the layout. In a wide product the first tile of activation rows writes them, and the others read them
// instead of unpacking again: removing the unpacking took 0.73-0.77x the time of a 9- and 60-row Q6_K_X8 product,
// 0.93-0.95x for Q4_K_X8 (Zen 3, thirty-sixth pass, benchmarks/RESULTS.md), whose saving a 9-row product's
// stores outweighed (1.24x the time).
constexpr int64_t X8_UNPACKED_BYTES = 2048;

// Where a tile's value vectors come from: the layout (none), the layout and written to `unpacked` as well (write),
// or read from `unpacked` (read), written by an earlier tile over the same weights.
enum class Unpack { none, write, read };

inline __m256i unpacked_vector(const uint8_t* unpacked, int step, int j) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unpacked + 256 * step + 32 * j));
}

inline void store_unpacked(uint8_t* unpacked, int step, int j, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(unpacked + 256 * step + 32 * j), v);
}

// Group G (0, 1) of chunk c for R activation rows: four maddubs a row (each int16 at most 2 * 63 * 127), summed in
// twos (at most 32004), each two-sum made int32 by one madd with the rows' scales. Mode: where the value vectors
// come from (Unpack), `unpacked` the super-block's X8_UNPACKED_BYTES.
template <int R, int G, Unpack Mode = Unpack::none>
inline void x8_q6_k_group(const uint8_t* o, uint8_t* unpacked, int c, const BlockQ8K* const* x, int64_t s,
                          __m256i* sumi) {
  const uint8_t* chunk = o + 144 + 192 * c;
  const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 16 + 8 * (2 * c + G)));
  const __m256i sc = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8, sc8));  // lanes 2r, 2r+1: row r's scale
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    const int j = 4 * G + 2 * half;  // u0 is value vector j, u1 vector j + 1
    __m256i u0, u1;
    if constexpr (Mode == Unpack::read) {
      u0 = unpacked_vector(unpacked, c, j), u1 = unpacked_vector(unpacked, c, j + 1);
    } else {
      u0 = half ? x8_q6_k_values<4 * G + 2>(chunk) : x8_q6_k_values<4 * G>(chunk);
      u1 = half ? x8_q6_k_values<4 * G + 3>(chunk) : x8_q6_k_values<4 * G + 1>(chunk);
      prefetch_after(o + 210 * c + 64 * (2 * G + half), u0);  // an eighth of the super-block's lines a chunk
      if constexpr (Mode == Unpack::write) store_unpacked(unpacked, c, j, u0), store_unpacked(unpacked, c, j + 1, u1);
    }
    const int at = 32 * c + 16 * G + 8 * half;
    for (int r = 0; r < R; ++r) {
      const int8_t* q = x[r][s].q + at;
      __m256i a = _mm256_maddubs_epi16(u0, _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(q))));
      add_epi16_to(a, _mm256_maddubs_epi16(
                          u1, _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(q + 4)))));
      sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(a, sc));
      __asm__("" : "+x"(sumi[r]));
    }
  }
}

// Mode: where the value vectors come from (x8_q6_k_group); `unpacked` holds X8_UNPACKED_BYTES a super-block, step c
// chunk c's vectors.
template <int R, Unpack Mode = Unpack::none>
__attribute__((flatten)) void tile_x8_q6_k_avx2(const uint8_t* w, int64_t supers, const BlockQ8K* const* x, float* y,
                                                int64_t ldy, uint8_t* unpacked = nullptr) {
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_setzero_ps());
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * X8_Q6K_BYTES;
    uint8_t* u = unpacked + (Mode == Unpack::none ? 0 : s * X8_UNPACKED_BYTES);
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c)
      x8_q6_k_group<R, 0, Mode>(o, u, c, x, s, sumi), x8_q6_k_group<R, 1, Mode>(o, u, c, x, s, sumi);
    x8_q6_k_finish<R>(o, x, s, sumi, y, ldy);
  }
}
#endif  // SPECDEC_AVX2

// -- Q3_K_X8 ------------------------------------------------------------------------------------------------------
// Q3_K in groups of 8 rows (Q3_K_S/M/L files), Q6_K_X8's sibling: a scale per 16 values, values u (0..7) with
// w = d * scale * (u - 4). A super-block of 8 rows takes 8 * 114 bytes (the file's 110 a row, + 4 for the scales
// kept decoded), a tensor's shape [out, in / 256 * 114]:
//   [0, 16)     d of rows 0..7, float16
//   [16, 144)   scale of group g (values 16g..16g+15) of row r at 16 + 8g + r (int8, -32..31: the file's 6 bits
//               less 32)
//   [144, 912)  chunk pair m (values 64m..64m+63 of the 8 rows) at 144 + 192m: two-bit vectors T0, T1 of chunk 2m
//               at + 0, + 32, of chunk 2m + 1 at + 64, + 96; third-bit vectors E0, E1 at + 128, + 160.
// Value vector j of chunk c (j = 0..7: values 32c + 4j .. 32c + 4j + 3, row r at bytes 4r..4r+3): bits 2 (j >> 1)
// and 2 (j >> 1) + 1 of T[j & 1] of chunk c, with bit (j >> 1) + 4 (c & 1) of E[j & 1] of its pair as bit 2. So
// T0 | T1 (one 512-bit load) holds value vectors 2p and 2p + 1 at bits 2p (the AVX-512 pairs), E0 | E1 their third
// bits at bit p + 4 (c & 1), one shift each. Four maddubs of a group (at most 2 * 7 * 127 each) are summed as int16
// (7112) before one madd with the rows' scales; dpbusd puts 8 products in a dword (at most 7112) before a dpwssd.
// Per row and super-block, every path: total = sum over groups g of scale_g * (sum of u * q - 4 * bsums_g), an
// exact int32, then acc = fma(float(total), d * xd, acc).
constexpr int64_t X8_Q3K_BYTES = 8 * 114;

struct Q3x8Place {
  int two_at, two_shift, third_at, third_shift;
};

constexpr Q3x8Place q3x8_place(int v, int r) {  // v: the value's index in the super-block (0..255)
  const int c = v / 32, j = v % 32 / 4, i = v % 4, pair = 144 + 192 * (c / 2);
  return {pair + 64 * (c & 1) + 32 * (j & 1) + 4 * r + i, 2 * (j >> 1),
          pair + 128 + 32 * (j & 1) + 4 * r + i, (j >> 1) + 4 * (c & 1)};
}

inline int q3x8_value(const uint8_t* o, int r, int v) {
  const Q3x8Place at = q3x8_place(v, r);
  return ((o[at.two_at] >> at.two_shift) & 3) | (((o[at.third_at] >> at.third_shift) & 1) << 2);
}

// The file's Q3_K blocks (hmask[32], qs[64] at 32, scales[12] at 96, d at 108) of rows [8g, 8g + 8) -> group g, or
// back byte for byte (q3_k_scale's packing inverted).
inline void interleave_group_q3_k(const uint8_t* w, int64_t supers, uint8_t* out) {
  interleave_decoded(Q3_K, w, supers, 110, X8_Q3K_BYTES, out, [](uint8_t* o, const uint8_t* p, const KBlock& b, int r) {
    std::memcpy(o + 2 * r, p + 108, 2);
    for (int g = 0; g < 16; ++g) o[16 + 8 * g + r] = static_cast<uint8_t>(static_cast<int8_t>(b.sc16[g]));
    for (int v = 0; v < QK_K; ++v) {
      const Q3x8Place at = q3x8_place(v, r);
      o[at.two_at] |= static_cast<uint8_t>((b.u[v] & 3) << at.two_shift);
      o[at.third_at] |= static_cast<uint8_t>((b.u[v] >> 2) << at.third_shift);
    }
  });
}

inline void deinterleave_group_q3_k(const uint8_t* in, int64_t supers, uint8_t* w) {
  for (int64_t s = 0; s < supers; ++s)
    for (int r = 0; r < 8; ++r) {
      const uint8_t* o = in + s * X8_Q3K_BYTES;
      uint8_t* p = w + (r * supers + s) * 110;
      std::memset(p, 0, 108);
      for (int v = 0; v < QK_K; ++v) {  // value 32k + i: two bits at 2 (k % 4) of qs[32 (k / 4) + i], bit k of hmask[i]
        const int u = q3x8_value(o, r, v), k = v / 32, i = v % 32;
        p[32 + 32 * (k / 4) + i] |= static_cast<uint8_t>((u & 3) << (2 * (k % 4)));
        p[i] |= static_cast<uint8_t>((u >> 2) << k);
      }
      for (int g = 0; g < 16; ++g) {
        const int biased = static_cast<int8_t>(o[16 + 8 * g + r]) + 32;  // 0..63
        p[96 + g % 8] |= static_cast<uint8_t>((biased & 0xF) << (g < 8 ? 0 : 4));
        p[96 + 8 + g % 4] |= static_cast<uint8_t>((biased >> 4) << (2 * (g / 4)));
      }
      std::memcpy(p + 108, o + 2 * r, 2);
    }
}

#ifdef SPECDEC_AVX2
// Value vector J of chunk C as bytes 0..7 (the layout's rule above).
template <int C, int J>
inline __m256i x8_q3_k_values(const uint8_t* o) {
  const uint8_t* pair = o + 144 + 192 * (C / 2);
  const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 64 * (C & 1) + 32 * (J & 1)));
  const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair + 128 + 32 * (J & 1)));
  constexpr int third = (J >> 1) + 4 * (C & 1);  // 16-bit shifts below: bit 2 of each byte from the same byte
  const __m256i low = _mm256_and_si256(_mm256_srli_epi16(t, 2 * (J >> 1)), _mm256_set1_epi8(3));
  const __m256i at2 = third >= 2 ? _mm256_srli_epi16(e, third - 2) : _mm256_slli_epi16(e, 2 - third);
  return _mm256_or_si256(low, _mm256_and_si256(at2, _mm256_set1_epi8(4)));
}

// The AVX2 tile of the layouts with small values (at most 7) and a scale per 16, Q3_K_X8 and Q2_K_X8: L gives
// bytes (a super-block of 8 rows), row_bytes, group<C, G>(o, u) (group G of chunk C: its four value vectors into u,
// the rows' scale pairs back) and finish<R>. Per group and row four maddubs (at most 2 * 7 * 127 each) are summed
// as int16, then one madd with the scales.
template <int R, class L, int C, int G>
inline void x8_small_group(const uint8_t* o, const BlockQ8K* const* x, int64_t s, __m256i* sumi) {
  __m256i u[4];
  const __m256i sc = L::template group<C, G>(o, u);  // lanes 2r, 2r+1: row r's scale
  prefetch_after(o + L::row_bytes * C + 64 * G, u[0]);  // an eighth of the super-block's lines a chunk
  for (int r = 0; r < R; ++r) {
    const int8_t* q = x[r][s].q + 32 * C + 16 * G;
    __m256i a = _mm256_maddubs_epi16(u[0], _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(q))));
    for (int k = 1; k < 4; ++k)
      add_epi16_to(a, _mm256_maddubs_epi16(
                          u[k], _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(q + 4 * k)))));
    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(a, sc));
    __asm__("" : "+x"(sumi[r]));
  }
}

template <int R, class L, int C>
inline void x8_small_chunk(const uint8_t* o, const BlockQ8K* const* x, int64_t s, __m256i* sumi) {
  x8_small_group<R, L, C, 0>(o, x, s, sumi), x8_small_group<R, L, C, 1>(o, x, s, sumi);
}

template <int R, class L>
__attribute__((flatten)) void tile_x8_small_avx2(const uint8_t* w, int64_t supers, const BlockQ8K* const* x, float* y,
                                                 int64_t ldy) {
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_setzero_ps());
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * L::bytes;
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    x8_small_chunk<R, L, 0>(o, x, s, sumi), x8_small_chunk<R, L, 1>(o, x, s, sumi);
    x8_small_chunk<R, L, 2>(o, x, s, sumi), x8_small_chunk<R, L, 3>(o, x, s, sumi);
    x8_small_chunk<R, L, 4>(o, x, s, sumi), x8_small_chunk<R, L, 5>(o, x, s, sumi);
    x8_small_chunk<R, L, 6>(o, x, s, sumi), x8_small_chunk<R, L, 7>(o, x, s, sumi);
    L::template finish<R>(o, x, s, sumi, y, ldy);
  }
}

struct Q3x8Avx2 {
  static constexpr int64_t bytes = X8_Q3K_BYTES;
  static constexpr int row_bytes = 114;
  template <int C, int G>
  static __m256i group(const uint8_t* o, __m256i* u) {
    u[0] = x8_q3_k_values<C, 4 * G>(o), u[1] = x8_q3_k_values<C, 4 * G + 1>(o);
    u[2] = x8_q3_k_values<C, 4 * G + 2>(o), u[3] = x8_q3_k_values<C, 4 * G + 3>(o);
    const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 16 + 8 * (2 * C + G)));
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8, sc8));
  }
  template <int R>
  static void finish(const uint8_t* o, const BlockQ8K* const* x, int64_t s, const __m256i* sumi, float* y,
                     int64_t ldy) {
    x8_q6_k_finish<R, 2>(o, x, s, sumi, y, ldy);
  }
};
#endif  // SPECDEC_AVX2

// -- Q2_K_X8 ------------------------------------------------------------------------------------------------------
// Q2_K in groups of 8 rows (Q2_K files): values u (0..3), a 4-bit scale and a 4-bit minimum per 16 values,
// w = d * scale * u - dmin * minimum. A super-block of 8 rows takes the file's 8 * 84 bytes, a tensor keeps its
// shape [out, in / 256 * 84]:
//   [0, 16)     d of rows 0..7, float16
//   [16, 32)    dmin of rows 0..7, float16
//   [32, 160)   the file's byte of group g (values 16g..16g+15) of row r at 32 + 8g + r: scale in its low nibble,
//               minimum in its high one
//   [160, 672)  chunk c (values 32c..32c+31 of the 8 rows) at 160 + 64c: two-bit vectors T0, T1 at + 0, + 32
// Value vector j of chunk c (values 32c + 4j .. 32c + 4j + 3, row r at bytes 4r..4r+3): bits 2 (j >> 1) and
// 2 (j >> 1) + 1 of T[j & 1] (Q3_K_X8's two-bit vectors). Per row and super-block, every path, with sumi = sum
// over groups g of scale_g * (sum of u * q) and offsets = sum over g of minimum_g * bsums_g, exact:
//   acc = fma(float(sumi), d * xd, acc); acc = fma(float(offsets), -dmin * xd, acc)   (Q4_K_X8's end)
constexpr int64_t X8_Q2K_BYTES = 8 * 84;

constexpr Q3x8Place q2x8_place(int v, int r) {  // only the two-bit field (Q3x8Place's first half)
  const int c = v / 32, j = v % 32 / 4, i = v % 4;
  return {160 + 64 * c + 32 * (j & 1) + 4 * r + i, 2 * (j >> 1), 0, 0};
}

inline int q2x8_value(const uint8_t* o, int r, int v) {
  const Q3x8Place at = q2x8_place(v, r);
  return (o[at.two_at] >> at.two_shift) & 3;
}

// The file's Q2_K blocks (scales[16], qs[64] at 16, d at 80, dmin at 82) of rows [8g, 8g + 8) -> group g, or back
// byte for byte.
inline void interleave_group_q2_k(const uint8_t* w, int64_t supers, uint8_t* out) {
  interleave_decoded(Q2_K, w, supers, 84, X8_Q2K_BYTES, out, [](uint8_t* o, const uint8_t* p, const KBlock& b, int r) {
    std::memcpy(o + 2 * r, p + 80, 2);
    std::memcpy(o + 16 + 2 * r, p + 82, 2);
    for (int g = 0; g < 16; ++g) o[32 + 8 * g + r] = p[g];
    for (int v = 0; v < QK_K; ++v) {
      const Q3x8Place at = q2x8_place(v, r);
      o[at.two_at] |= static_cast<uint8_t>(b.u[v] << at.two_shift);
    }
  });
}

inline void deinterleave_group_q2_k(const uint8_t* in, int64_t supers, uint8_t* w) {
  for (int64_t s = 0; s < supers; ++s)
    for (int r = 0; r < 8; ++r) {
      const uint8_t* o = in + s * X8_Q2K_BYTES;
      uint8_t* p = w + (r * supers + s) * 84;
      std::memset(p + 16, 0, 64);
      for (int g = 0; g < 16; ++g) p[g] = o[32 + 8 * g + r];
      for (int v = 0; v < QK_K; ++v) {  // value 32k + i: two bits at 2 (k % 4) of qs[32 (k / 4) + i]
        const int k = v / 32, i = v % 32;
        p[16 + 32 * (k / 4) + i] |= static_cast<uint8_t>(q2x8_value(o, r, v) << (2 * (k % 4)));
      }
      std::memcpy(p + 80, o + 2 * r, 2);
      std::memcpy(p + 82, o + 16 + 2 * r, 2);
    }
}

template <int R>
void tile_x8_q2_k_portable(const uint8_t* w, int64_t supers, const BlockQ8K* const* x, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 8; ++l) y[r * ldy + l] = 0.0f;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * X8_Q2K_BYTES;
    prefetch_ahead(o, X8_Q2K_BYTES);
    for (int r = 0; r < R; ++r) {
      const BlockQ8K& xb = x[r][s];
      for (int l = 0; l < 8; ++l) {
        int32_t sumi = 0, offsets = 0;
        for (int g = 0; g < 16; ++g) {
          int32_t dot = 0;
          for (int v = 16 * g; v < 16 * g + 16; ++v) dot += q2x8_value(o, l, v) * xb.q[v];
          sumi += (o[32 + 8 * g + l] & 0xF) * dot;
          offsets += (o[32 + 8 * g + l] >> 4) * xb.bsums[g];
        }
        const float d = f16(o + 2 * l), dm = -f16(o + 16 + 2 * l);
        float& acc = y[r * ldy + l];
        acc = std::fma(static_cast<float>(sumi), d * xb.d, acc);
        acc = std::fma(static_cast<float>(offsets), dm * xb.d, acc);
      }
    }
  }
}

#ifdef SPECDEC_AVX2
// The end of a super-block on the vector paths (lane l: row l's sumi): the offsets (madd of the rows' minimum
// pairs of groups 2j, 2j + 1 against the activation's bsums pair j), then the portable path's two fmas.
template <int R>
inline void x8_q2_k_finish(const uint8_t* o, const BlockQ8K* const* x, int64_t s, const __m256i* sumi, float* y,
                           int64_t ldy) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  const __m256 dm = _mm256_xor_ps(_mm256_set1_ps(-0.0f),  // -dmin, as the portable path's negation
                                  _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 16))));
  __m256i pairs[8];  // int16 lanes 2l, 2l + 1: row l's minimums of groups 2j, 2j + 1
  for (int j = 0; j < 8; ++j) {
    const __m128i v = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o + 32 + 16 * j)), 4),
                                    _mm_set1_epi8(0x0F));
    pairs[j] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, _mm_srli_si128(v, 8)));
  }
  for (int r = 0; r < R; ++r) {
    const BlockQ8K& xb = x[r][s];
    __m256i offsets = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      int32_t bsum_pair;
      std::memcpy(&bsum_pair, xb.bsums + 2 * j, sizeof(bsum_pair));
      offsets = _mm256_add_epi32(offsets, _mm256_madd_epi16(pairs[j], _mm256_set1_epi32(bsum_pair)));
    }
    const __m256 xd = _mm256_broadcast_ss(&xb.d);
    __m256 acc = _mm256_loadu_ps(y + r * ldy);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(d, xd), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offsets), _mm256_mul_ps(dm, xd), acc);
    _mm256_storeu_ps(y + r * ldy, acc);
  }
}

// Q2_K_X8 for tile_x8_small_avx2: value vector 4G + k of chunk C is T[k & 1], bits 2 (2G + k / 2); the scales are
// the low nibbles of the packed bytes.
struct Q2x8Avx2 {
  static constexpr int64_t bytes = X8_Q2K_BYTES;
  static constexpr int row_bytes = 84;
  template <int C, int G>
  static __m256i group(const uint8_t* o, __m256i* u) {
    const uint8_t* chunk = o + 160 + 64 * C;
    for (int k = 0; k < 4; ++k) {
      const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * (k & 1)));
      u[k] = _mm256_and_si256(_mm256_srli_epi16(t, 2 * (2 * G + k / 2)), _mm256_set1_epi8(3));
    }
    const __m128i sc8 = _mm_and_si128(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 32 + 8 * (2 * C + G))),
                                      _mm_set1_epi8(0x0F));
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));
  }
  template <int R>
  static void finish(const uint8_t* o, const BlockQ8K* const* x, int64_t s, const __m256i* sumi, float* y,
                     int64_t ldy) {
    x8_q2_k_finish<R>(o, x, s, sumi, y, ldy);
  }
};
#endif  // SPECDEC_AVX2

// -- IQ4_XS_X8 ----------------------------------------------------------------------------------------------------
// IQ4_XS in groups of 8 rows (IQ4_XS files): a 6-bit signed scale per 32 values, each value a 4-bit index into the
// sixteen signed levels (IQ4_LEVELS, -127..113), w = d * scale * level. A super-block of 8 rows takes 8 * 138
// bytes (the file's 136 a row, + 2 for the scales kept decoded), a tensor's shape [out, in / 256 * 138]:
//   [0, 16)      d of rows 0..7, float16
//   [16, 80)     scale of sub-block k of row r at 16 + 8k + r (int8, -32..31)
//   [80, 1104)   the indices as Q4_K_X8 keeps its nibbles: bytes 4c..4c+3 of pair j (sub-blocks 2j low nibbles,
//                2j + 1 high ones; values 4c..4c+3 of each) of row r at 80 + 256j + 32c + 4r
// Per row and super-block, every path: total = sum over sub-blocks k of scale_k * (sum of level * q), an exact
// int32 (at most 8 * 32 * 32 * 127 * 127 in magnitude), then acc = fma(float(total), d * xd, acc). A level
// reaches 127, so no int16 holds two products: AVX2 takes |level| against q carrying its sign, one madd with the
// scales a vector; the dpbusd paths take level + 128 (unsigned), a vpmulld with the scales a sub-block, and
// 128 * sum over k of scale_k * sums32_k less at the end (the Q4_K_X8 minimums' madd).
constexpr int64_t X8_IQ4XS_BYTES = 8 * 138;

inline void interleave_group_iq4_xs(const uint8_t* w, int64_t supers, uint8_t* out) {
  std::memset(out, 0, supers * X8_IQ4XS_BYTES);
  for (int64_t s = 0; s < supers; ++s)
    for (int r = 0; r < 8; ++r) {
      const uint8_t* p = w + (r * supers + s) * 136;
      uint8_t* o = out + s * X8_IQ4XS_BYTES;
      std::memcpy(o + 2 * r, p, 2);
      for (int k = 0; k < 8; ++k) {
        o[16 + 8 * k + r] = static_cast<uint8_t>(static_cast<int8_t>(iq4_xs_scale(p, k)));
        for (int v = 0; v < 32; ++v) {  // the file: value v < 16 a low nibble of byte v, else a high one of v - 16
          const int index = (p[8 + 16 * k + v % 16] >> (4 * (v / 16))) & 0xF;
          o[80 + 256 * (k / 2) + 32 * (v / 4) + 4 * r + v % 4] |= static_cast<uint8_t>(index << (4 * (k & 1)));
        }
      }
    }
}

inline void deinterleave_group_iq4_xs(const uint8_t* in, int64_t supers, uint8_t* w) {
  for (int64_t s = 0; s < supers; ++s)
    for (int r = 0; r < 8; ++r) {
      const uint8_t* o = in + s * X8_IQ4XS_BYTES;
      uint8_t* p = w + (r * supers + s) * 136;
      std::memset(p, 0, 136);
      std::memcpy(p, o + 2 * r, 2);
      int high = 0;
      for (int k = 0; k < 8; ++k) {
        const int biased = static_cast<int8_t>(o[16 + 8 * k + r]) + 32;  // 0..63
        p[4 + k / 2] |= static_cast<uint8_t>((biased & 0xF) << (4 * (k % 2)));
        high |= (biased >> 4) << (2 * k);
        for (int v = 0; v < 32; ++v) {
          const int index = (o[80 + 256 * (k / 2) + 32 * (v / 4) + 4 * r + v % 4] >> (4 * (k & 1))) & 0xF;
          p[8 + 16 * k + v % 16] |= static_cast<uint8_t>(index << (4 * (v / 16)));
        }
      }
      p[2] = static_cast<uint8_t>(high & 0xFF);
      p[3] = static_cast<uint8_t>(high >> 8);
    }
}

template <int R>
void tile_x8_iq4_xs_portable(const uint8_t* w, int64_t supers, const BlockQ8K* const* x, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 8; ++l) y[r * ldy + l] = 0.0f;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * X8_IQ4XS_BYTES;
    prefetch_ahead(o, X8_IQ4XS_BYTES);
    for (int r = 0; r < R; ++r) {
      const BlockQ8K& xb = x[r][s];
      for (int l = 0; l < 8; ++l) {
        int32_t total = 0;
        for (int k = 0; k < 8; ++k) {
          int32_t dot = 0;
          for (int c = 0; c < 8; ++c)
            for (int i = 0; i < 4; ++i) {
              const int index = (o[80 + 256 * (k / 2) + 32 * c + 4 * l + i] >> (4 * (k & 1))) & 0xF;
              dot += IQ4_LEVELS[index] * xb.q[32 * k + 4 * c + i];
            }
          total += static_cast<int8_t>(o[16 + 8 * k + l]) * dot;
        }
        float& acc = y[r * ldy + l];
        acc = std::fma(static_cast<float>(total), f16(o + 2 * l) * xb.d, acc);
      }
    }
  }
}

#ifdef SPECDEC_AVX2
// The end of a super-block on the vector paths, from sumi (lane l: row l's sum of scale * level * q, exact; with
// `biased` the levels + 128, so 128 * sum of scale_k * sums32_k comes off): the portable path's fma; y holds acc.
template <int R>
inline void x8_iq4_xs_finish(const uint8_t* o, const BlockQ8K* const* x, int64_t s, const __m256i* sumi, bool biased,
                             float* y, int64_t ldy) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(o)));
  __m256i pairs[4];  // int16 lanes 2l, 2l + 1: row l's scales of sub-blocks 2j, 2j + 1
  if (biased)
    for (int j = 0; j < 4; ++j)
      pairs[j] = _mm256_cvtepi8_epi16(
          _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 16 + 16 * j)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 24 + 16 * j))));
  for (int r = 0; r < R; ++r) {
    const BlockQ8K& xb = x[r][s];
    __m256i total = sumi[r];
    if (biased) {
      __m256i offsets = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j)
        offsets = _mm256_add_epi32(offsets, _mm256_madd_epi16(pairs[j], _mm256_set1_epi32(bsum_pair(xb, j))));
      total = _mm256_sub_epi32(total, _mm256_slli_epi32(offsets, 7));
    }
    const __m256 acc = _mm256_loadu_ps(y + r * ldy);
    _mm256_storeu_ps(y + r * ldy, _mm256_fmadd_ps(_mm256_cvtepi32_ps(total),
                                                  _mm256_mul_ps(d, _mm256_broadcast_ss(&xb.d)), acc));
  }
}

// Sub-block K for R activation rows. AVX2: per vector of (4 values x 8 rows) and row, the activations take the
// levels' signs, a maddubs against |level| (at most 2 * 127 * 127) and a madd with the rows' scales. VNNI: per
// vector and row a dpbusd of level + 128, per sub-block and row a vpmulld with the scales.
template <int R, int K, bool Vnni>
inline void x8_iq4_xs_sub_block(const uint8_t* o, const BlockQ8K* const* x, int64_t s, __m256i* sumi) {
#ifndef SPECDEC_VNNI
  static_assert(!Vnni, "the biased levels need dpbusd");
#endif
  const __m256i levels = iq4_levels256(), m4 = _mm256_set1_epi8(0x0F);
  const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(o + 16 + 8 * K));
  const __m256i sc = Vnni ? _mm256_cvtepi8_epi32(sc8)  // lane r: row r's scale
                          : _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8, sc8));  // lanes 2r, 2r+1
  __m256i dot[R];
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o + 80 + 256 * (K / 2) + 32 * c));
    if (c < 3) prefetch_after(o + 138 * K + 64 * c, q);
    const __m256i level = _mm256_shuffle_epi8(levels, _mm256_and_si256(K & 1 ? _mm256_srli_epi16(q, 4) : q, m4));
    const __m256i u = Vnni ? _mm256_xor_si256(level, _mm256_set1_epi8(static_cast<char>(0x80))) : _mm256_abs_epi8(level);
    for (int r = 0; r < R; ++r) {
      const __m256i a = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(x[r][s].q + 32 * K + 4 * c)));
#ifdef SPECDEC_VNNI
      if constexpr (Vnni) {
        dot[r] = SPECDEC_DPBUSD(c == 0 ? _mm256_setzero_si256() : dot[r], u, a);
        continue;
      }
#endif
      sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(a, level)), sc));
    }
  }
  if constexpr (Vnni)
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(dot[r], sc));
}

template <int R, bool Vnni = false>
__attribute__((flatten)) void tile_x8_iq4_xs_avx2(const uint8_t* w, int64_t supers, const BlockQ8K* const* x,
                                                  float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy, _mm256_setzero_ps());
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* o = w + s * X8_IQ4XS_BYTES;
    __m256i sumi[R];
    for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
    x8_iq4_xs_sub_block<R, 0, Vnni>(o, x, s, sumi), x8_iq4_xs_sub_block<R, 1, Vnni>(o, x, s, sumi);
    x8_iq4_xs_sub_block<R, 2, Vnni>(o, x, s, sumi), x8_iq4_xs_sub_block<R, 3, Vnni>(o, x, s, sumi);
    x8_iq4_xs_sub_block<R, 4, Vnni>(o, x, s, sumi), x8_iq4_xs_sub_block<R, 5, Vnni>(o, x, s, sumi);
    x8_iq4_xs_sub_block<R, 6, Vnni>(o, x, s, sumi), x8_iq4_xs_sub_block<R, 7, Vnni>(o, x, s, sumi);
    x8_iq4_xs_finish<R>(o, x, s, sumi, Vnni, y, ldy);
  }
}
#endif  // SPECDEC_AVX2

}  // namespace
