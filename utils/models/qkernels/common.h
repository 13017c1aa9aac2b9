// Shared by the kernels: GGML type ids, activation block layouts, float16 and K-quant scale decoding, and the
// one horizontal-sum order every path uses. No torch tensor headers: matmul.cpp and the tiles compile without them.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define SPECDEC_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECDEC_VNNI 1
#define SPECDEC_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define SPECDEC_VNNI 1
#define SPECDEC_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define SPECDEC_AVX512 1
#endif
#endif

namespace {

// GGML type ids (gguf.GGMLQuantizationType).
enum : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23,
  IQ1_M = 29
};
// IQ4_NL's and IQ4_XS's sixteen weight levels (ggml-common.h's kvalues_iq4nl): a 4-bit value indexes this table.
alignas(16) constexpr int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Where a 32-value block's 16 bytes of nibbles start (after d; Q4_1, Q5_1: d and m; Q5_*: 4 bytes of high bits).
constexpr int nibbles_at(int64_t type) {
  return type == Q4_0 || type == IQ4_NL ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
}
// Ours, not GGML's (whose ids stay below 100): the K-quants, IQ4_XS, Q4_1 and Q8_0 with 8 rows interleaved
// (interleaved.h), 100 + the file type's id.
enum : int64_t { Q4_1_X8 = 103, Q8_0_X8 = 108, Q2_K_X8 = 110, Q3_K_X8 = 111, Q4_K_X8 = 112, Q5_K_X8 = 113,
                 Q6_K_X8 = 114, IQ4_XS_X8 = 123 };
enum : int64_t { PORTABLE = 0, AVX2 = 1, VNNI = 2, AVX512 = 3, AMX = 4 };  // AMX: AVX-512's tiles and amx.h's

constexpr int QK = 32;    // activation block, and the unit every weight type is walked in
constexpr int QK_K = 256; // K-quant super-block
constexpr int MR = 4;     // activation rows per tile in portable C++: a weight block is decoded once for these
constexpr int MR_WIDE = 8; // the same on the vector paths (tile_rows)

struct BlockQ8 {
  int8_t q[QK];
  float d;      // scale: x ~ d * q
  float ds;     // d * (s[0] + s[1]), for the offsets of the per-32 types
  int16_t s[2]; // sums of q over values 0..15 and 16..31 (Q6_K's offsets are per 16)
};
static_assert(sizeof(BlockQ8) == 44, "activation block layout");

// Activations for the K-quants: one scale per super-block of 256, sums per 16 for the weights' offsets, so the
// sub-block scales apply in integer arithmetic and floats enter once per super-block. The values come first and a
// block takes 320 bytes, five cache lines: in a row that starts on a line (torch's allocations do), no 32-byte load
// of the values straddles two lines. With d first and 308 bytes, the Q6_K tile took 3-5% more time (fourteenth
// pass, benchmarks/RESULTS.md).
struct BlockQ8K {
  int8_t q[QK_K];
  float d;
  int16_t bsums[16];
  // Sums per 32 (sub-block k at k): read as one int32 at 2j, sub-blocks 2j and 2j + 1 are its low and high halves,
  // the pairs the interleaved Q4_K tile's minimums are stored in. Made once per activation row: summed from bsums
  // inside that tile, once per row and super-block of every group of 8 weight rows, they were ~230 of its ~1,350
  // instructions a super-block (interleaved.h's bsum_pair).
  int16_t sums32[8];
  uint8_t unused[12];
};
static_assert(sizeof(BlockQ8K) == 320, "K activation block layout");

inline bool is_k_quant(int64_t type) {
  return type == Q2_K || type == Q3_K || type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS ||
         type == IQ3_S || type == IQ3_XXS || type == IQ2_XXS || type == IQ2_XS || type == IQ2_S || type == IQ1_S ||
         type == IQ1_M || type == Q2_K_X8 || type == Q3_K_X8 || type == Q4_K_X8 || type == Q5_K_X8 || type == Q6_K_X8 ||
         type == IQ4_XS_X8;
}

inline bool is_x8(int64_t type) {
  return type == Q2_K_X8 || type == Q3_K_X8 || type == Q4_K_X8 || type == Q5_K_X8 || type == Q6_K_X8 ||
         type == IQ4_XS_X8 || type == Q4_1_X8 || type == Q8_0_X8;
}
// The interleaved layout of a file type (a type of its own only where is_x8 says so).
constexpr int64_t x8_of(int64_t file_type) { return 100 + file_type; }

// Output rows one tile call computes for a weight row (or group) of this type.
inline int64_t rows_per_unit(int64_t type) { return is_x8(type) ? 8 : 1; }

struct TypeInfo {
  int64_t block_values, block_bytes;
};

constexpr bool type_info(int64_t type, TypeInfo* info) {
  switch (type) {
    case Q4_0: *info = {32, 18}; return true;
    case Q4_1: *info = {32, 20}; return true;
    case Q5_0: *info = {32, 22}; return true;
    case Q5_1: *info = {32, 24}; return true;
    case IQ4_NL: *info = {32, 18}; return true;
    case IQ4_XS: *info = {256, 136}; return true;
    case IQ3_S: *info = {256, 110}; return true;
    case IQ3_XXS: *info = {256, 98}; return true;
    case IQ2_XXS: *info = {256, 66}; return true;
    case IQ2_XS: *info = {256, 74}; return true;
    case IQ2_S: *info = {256, 82}; return true;
    case IQ1_S: *info = {256, 50}; return true;
    case IQ1_M: *info = {256, 56}; return true;
    case Q8_0: *info = {32, 34}; return true;
    case Q2_K: *info = {256, 84}; return true;
    case Q3_K: *info = {256, 110}; return true;
    case Q4_K: *info = {256, 144}; return true;
    case Q5_K: *info = {256, 176}; return true;
    case Q6_K: *info = {256, 210}; return true;
    case Q2_K_X8: *info = {256, 84}; return true;  // the file's bytes, rearranged
    case Q3_K_X8: *info = {256, 114}; return true;  // scales decoded, as Q4_K_X8's
    case Q4_K_X8: *info = {256, 148}; return true;  // per row: a group of 8 rows takes 8 * 148 bytes a super-block
    case Q5_K_X8: *info = {256, 180}; return true;  // the same, 8 * 180
    case Q4_1_X8: *info = {32, 20}; return true;
    case Q8_0_X8: *info = {32, 34}; return true;
    case Q6_K_X8: *info = {256, 210}; return true;  // the file's bytes, rearranged
    case IQ4_XS_X8: *info = {256, 138}; return true;  // scales decoded: 2 bytes more
    default: return false;
  }
}

constexpr int64_t block_bytes(int64_t type) {
  TypeInfo info{0, 0};
  type_info(type, &info);
  return info.block_bytes;
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);  // exact, as the software conversion below: one instruction instead of ~15
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// Q4_K / Q5_K: twelve bytes hold eight 6-bit scales and eight 6-bit minimums.
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Weights stream from memory once per pass, and the hardware prefetcher alone did not keep up: on the Xeon of
// benchmarks/RESULTS.md the products of a one-row pass of the 1.5B read their blocks at 10 GB/s of the
// machine's 26 (95 ms), 23 GB/s (42 ms) with a prefetch into L1 PREFETCH_AHEAD bytes ahead. A second one into L2,
// further ahead, keeps more lines in flight than L1's few fill buffers allow: weights streamed from memory,
// 1 row, Q4_1 4864x896 15.8 -> 19.4 GB/s, Q4_K 8960x1536 19 -> 21.6 GB/s (a plain float sum: 27-33).
// Every tile loop calls it once per weight block it starts.
constexpr int64_t PREFETCH_AHEAD = 1536;  // bytes; 576 measured 12% slower, 2304 the same
constexpr int64_t PREFETCH_FAR = 8192;    // bytes; 4096 and 16384 measured the same

// Prefetch the cache lines PREFETCH_AHEAD (into L1) and PREFETCH_FAR (into L2: prefetcht2) bytes past
// [p, p + bytes): one per 64 bytes, so that consecutive blocks leave no line out.
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) {
    __builtin_prefetch(p + PREFETCH_AHEAD + o);
    __builtin_prefetch(p + PREFETCH_FAR + o, 0, 1);
  }
}

inline float lane_sum(const float* a) {
  // the AVX2 path's horizontal sum, in its order: halves, then pairs, then the last two
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  return (s0 + s2) + (s1 + s3);
}

// A float dot product in eight fixed lanes (value i into lane i mod 8, the tail into lane 0), summed as lane_sum
// does: the same bits whatever else a call computes (RMSNorm's sum of squares, attention's scores).
inline float dot_lanes(const float* a, const float* b, int64_t n) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += a[i + l] * b[i + l];
  for (; i < n; ++i) lanes[0] += a[i] * b[i];
  return lane_sum(lanes);
}

#ifdef SPECDEC_AVX2
// Two float16 values side by side at p (a block's d and m, or d and dmin): one conversion for both, each exact.
inline void f16_pair(const uint8_t* p, float* first, float* second) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
  *first = _mm_cvtss_f32(both);
  *second = _mm_cvtss_f32(_mm_movehdup_ps(both));
}

// acc += v in int16 lanes, as one instruction GCC must keep where it is. A tile's sums are chains of such
// additions; written as intrinsics, GCC 12 reassociated them into trees and spilled the terms (an empty asm on the
// sum after each addition stopped that, but left the copy of the tile `mm_many` calls moving sums between
// registers: 54 moves). With this in the interleaved tiles and BlockQ8K's sums32, the Q4_K_X8 products of 4 to 60
// rows took 13-16% less time, Q4_1_X8's 2-12%, the same bits (fourteenth pass, benchmarks/RESULTS.md; each change
// alone made a 60-row product slower).
inline void add_epi16_to(__m256i& acc, __m256i v) { __asm__("vpaddw %1, %0, %0" : "+x"(acc) : "x"(v)); }

// IQ4_LEVELS in both 128-bit lanes: one shuffle looks up 32 levels by their 4-bit indices.
inline __m256i iq4_levels256() {
  return _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS)));
}

// 32 bits -> 32 bytes: byte i = 0xFF where bit i is set (Q5_0's fifth bits, the IQ grid types' signs).
inline __m256i bytes_from_bits(uint32_t bits) {
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  const __m256i mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, mask), _mm256_set1_epi64x(-1));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // a0+a4 .. a3+a7
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));  // (s0+s2), (s1+s3)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
#endif

}  // namespace
