// Wide products of Q4_K_X8, Q6_K_X8 and Q4_1_X8 on AMX (Intel's tile unit, AMX-INT8), in tiles of 16 activation
// rows x 16 output rows (two groups of 8). The AVX-512 tiles spend a dpbusd per 64 products of a row; a tdpbsud does
// 16 x 16 x 64. Used by mm_many (matmul.cpp) from amx_min_rows activation rows: with fewer, unpacking the weights
// for the tile unit costs more than it saves, and the AVX-512 tiles run them.
//
// The same bits as every other path (interleaved.h's portable tiles): per block the integer sums are exact however
// they are summed, and the float step is the one every path takes, in the same order.
//
// Q4_K_X8: the tile unit cannot apply a scale per 32 values inside a product, so each 6-bit scale is split as
// scale = 8 * high + low (both at most 7) and the weights are unpacked twice, nibble times high and nibble times
// low (at most 105: an unsigned byte), into two tiles: sumi = 8 * C_high + C_low. Unpacked per pair of groups and
// super-block (AMX_SUPER bytes):
//   [0, 64)       d of the 16 rows, float
//   [64, 128)     -dmin of the 16 rows, float
//   [128, 384)    minimum pairs (sub-blocks 2j, 2j + 1) of the 16 rows for j = 0..3, int16 pairs
//   [384, 8576)   for j = 0..3 (values 64j..64j+63): the high tile, then the low one. Row t of a tile holds, for
//                 output row n, bytes 4n..4n+3: values 4t..4t+3 of the 64 (the tile unit's "VNNI" layout)
// Q6_K_X8: the same split of value times scale (amx_unpack_q6_k), signed, p = 64 * high + low.
// Q4_1_X8: a block of 32 values has its own float scale, so each block's sums leave the tile unit. Unpacked per
// pair of groups and block (AMX_Q41_BLOCK bytes): d, then m of the 16 rows (floats), then the nibbles as a tile of
// 8 rows (values 4t..4t+3 of output row n at 64t + 4n).
#pragma once

#include "avx512.h"  // join, load256
#include "interleaved.h"

#if defined(SPECDEC_AVX512) && defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__linux__)
#define SPECDEC_AMX 1
#include <cstdlib>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int AMX_TILE_ROWS = 16;  // activation rows of a tile, and output rows (two groups of 8)
constexpr int64_t AMX_HEAD = 384;
constexpr int64_t AMX_SUPER = AMX_HEAD + 4 * 2 * 1024;  // a Q4_K super-block of a pair of groups, unpacked
constexpr int64_t AMX_Q41_BLOCK = 128 + 512;             // a Q4_1 block of a pair of groups, unpacked
constexpr int64_t AMX_Q6K_HEAD = 64 + 8 * 64;  // d, then the scale pairs (amx_unpack_q6_k)
constexpr int64_t AMX_Q6K_SUPER = AMX_Q6K_HEAD + 4 * 2 * 1024;  // a Q6_K super-block of a pair of groups, unpacked
constexpr int64_t AMX_UNPACKED = std::max(AMX_SUPER, AMX_Q6K_SUPER);  // the most any type's block takes

// Linux hands the tile registers' state (8 KB a thread) only to a process that asks (arch_prctl,
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a kernel or hypervisor that refuses leaves the path out, and so does
// SPECDEC_AMX=off (AVX-512's tiles then run everything: to compare, or where the tile unit misbehaves).
inline bool amx_permitted() {
  static const bool granted = [] {
    const char* setting = std::getenv("SPECDEC_AMX");
    return !(setting && std::strcmp(setting, "off") == 0) &&
           syscall(SYS_arch_prctl, static_cast<unsigned long>(0x1023), static_cast<unsigned long>(18)) == 0;
  }();
  return granted;
}

// The palette of our tiles for tiles of `rows` activation rows. Q4_K_X8 and Q6_K_X8: 0 and 1 the high and low sums
// [rows, 16] int32 of a first row tile, 2 and 3 those of a second, 4 and 5 their activations [rows, 64] int8, 6 and 7
// the high and low weights [16, 64] (bytes; Q6_K's high ones signed), loaded once for both row tiles. Q4_1_X8: 0
// and 1 the sums of two successive blocks of a row tile, 2 and 3 their activations [rows, 32], 4 and 5 their
// weights [8, 64]. Loaded at the start of each thread's part (torch's oneDNN kernels configure the same registers
// for their own shapes on the same threads).
inline void amx_configure(int64_t type, int rows) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  const bool k = type != Q4_1_X8;  // Q4_K_X8 and Q6_K_X8 alike
  for (int t = 0; t < (k ? 8 : 6); ++t) {
    config.colsb[t] = !k && (t == 2 || t == 3) ? 32 : 64;
    config.rows[t] = k ? (t < 6 ? rows : AMX_TILE_ROWS) : (t < 4 ? rows : 8);
  }
  _tile_loadconfig(&config);
}

inline __m512 join_ps(__m256 lo, __m256 hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }

inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m128i load64(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }

inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// One super-block of groups g0 and g1 (at o0, o1: X8_BYTES each) -> AMX_SUPER bytes at u.
inline void amx_unpack_q4_k(const uint8_t* o0, const uint8_t* o1, uint8_t* u) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), seven = _mm512_set1_epi32(7);
  const auto twice = [](__m512i v) { return _mm512_or_si512(v, _mm512_slli_epi32(v, 16)); };  // (v, v) as int16
  // the weights stream from memory: without prefetches the first loads of each super-block took 40% of this
  // function's time (perf, the default chat's target passes)
  prefetch_ahead(o0, X8_BYTES), prefetch_ahead(o1, X8_BYTES);
  _mm512_storeu_ps(u, join_ps(f16x8(o0), f16x8(o1)));
  const __m256 sign = _mm256_set1_ps(-0.0f);  // -dmin, as the other paths negate it
  _mm512_storeu_ps(u + 64, join_ps(_mm256_xor_ps(sign, f16x8(o0 + 16)), _mm256_xor_ps(sign, f16x8(o1 + 16))));
  for (int j = 0; j < 4; ++j) {
    const __m128i first = load128(o0 + 96 + 16 * j), second = load128(o1 + 96 + 16 * j);
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(first), second, 1);
    _mm512_storeu_si512(u + 128 + 64 * j, _mm512_cvtepu8_epi16(both));
  }
  for (int j = 0; j < 4; ++j) {
    __m512i high[2], low[2];  // the scales of sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles)
    for (int h = 0; h < 2; ++h) {
      const int k = 2 * j + h;
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(load64(o0 + 32 + 8 * k), load64(o1 + 32 + 8 * k)));
      high[h] = twice(_mm512_srli_epi32(sc, 3)), low[h] = twice(_mm512_and_si512(sc, seven));
    }
    uint8_t* tiles = u + AMX_HEAD + 2048 * j;
    for (int c = 0; c < 8; ++c) {
      const __m512i v = join(load256(o0 + 160 + 256 * j + 32 * c), load256(o1 + 160 + 256 * j + 32 * c));
      const __m512i nibbles[2] = {_mm512_and_si512(v, m4), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4)};
      // a 16-bit multiply scales both bytes of a word (one output row's): each product stays below 256
      for (int h = 0; h < 2; ++h) {
        _mm512_storeu_si512(tiles + 64 * (8 * h + c), _mm512_mullo_epi16(nibbles[h], high[h]));
        _mm512_storeu_si512(tiles + 1024 + 64 * (8 * h + c), _mm512_mullo_epi16(nibbles[h], low[h]));
      }
    }
  }
}

// A row tile of a super-block: where its activation rows start (row stride act_bytes, at the super-block's
// block), where their outputs go (y[r * ldy + n], n < 16), how many rows it has, and how many of its first rows
// an earlier tile of the product has already summed (the last full tile of a product overlaps the one before).
struct AmxRows {
  const uint8_t* x;
  float* y;
  int rows, skip;
};

// The float step of every path (interleaved.h's tile_x8_portable) for a Q4_K row tile whose integer sums are in
// sums[0] (high) and sums[1] (low): y = acc, with acc zero at the first super-block.
inline void amx_q4_k_finish(const uint8_t* us, const int32_t (*sums)[AMX_TILE_ROWS * 16], const AmxRows& t, int64_t ldy,
                       int64_t act_bytes, bool first) {
  const __m512 d = _mm512_loadu_ps(us), dm = _mm512_loadu_ps(us + 64);
  __m512i mins[4];
  for (int j = 0; j < 4; ++j) mins[j] = _mm512_loadu_si512(us + 128 + 64 * j);
  for (int r = t.skip; r < t.rows; ++r) {
    const BlockQ8K& xb = *reinterpret_cast<const BlockQ8K*>(t.x + r * act_bytes);
    const __m512i sumi = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[0] + 16 * r), 3),
                                          _mm512_load_si512(sums[1] + 16 * r));
    __m512i offsets = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) offsets = _mm512_dpwssd_epi32(offsets, mins[j], _mm512_set1_epi32(bsum_pair(xb, j)));
    const __m512 xd = _mm512_set1_ps(xb.d);
    __m512 acc = first ? _mm512_setzero_ps() : _mm512_loadu_ps(t.y + r * ldy);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_mul_ps(d, xd), acc);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(offsets), _mm512_mul_ps(dm, xd), acc);
    _mm512_storeu_ps(t.y + r * ldy, acc);
  }
}

// Sums tile C += activations tile A times the high weights (tile 6), signed or not. A macro: GCC's tile intrinsics
// paste their register numbers into asm, so they take literal numbers only (not a template's).
#define SPECDEC_AMX_HIGH(C, A)     \
  do {                             \
    if constexpr (SignedHigh)      \
      _tile_dpbssd(C, A, 6);       \
    else                           \
      _tile_dpbsud(C, A, 6);       \
  } while (0)

// The sums of one super-block against one row tile or two, to memory: sums[0] and sums[1] the first tile's high
// and low, sums[2] and sums[3] the second's. `tiles`: the unpacked high and low tiles, 2048 bytes a 64 values;
// SignedHigh: Q6_K's high tiles are signed (tdpbssd), Q4_K's unsigned (tdpbsud); the low ones are unsigned.
template <bool SignedHigh>
inline void amx_k_sums(const uint8_t* tiles, const AmxRows& a, const AmxRows& b, bool two, int64_t act_bytes,
                       int32_t (*sums)[AMX_TILE_ROWS * 16]) {
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int j = 0; j < 4; ++j) {
    _tile_loadd(6, tiles + 2048 * j, 64);
    _tile_loadd(7, tiles + 2048 * j + 1024, 64);
    _tile_loadd(4, a.x + 64 * j, act_bytes);
    SPECDEC_AMX_HIGH(0, 4);
    _tile_dpbsud(1, 4, 7);
    if (two) {
      _tile_loadd(5, b.x + 64 * j, act_bytes);
      SPECDEC_AMX_HIGH(2, 5);
      _tile_dpbsud(3, 5, 7);
    }
  }
  _tile_stored(0, sums[0], 64);
  _tile_stored(1, sums[1], 64);
  if (two) {
    _tile_stored(2, sums[2], 64);
    _tile_stored(3, sums[3], 64);
  }
}
#undef SPECDEC_AMX_HIGH

// One Q4_K super-block (unpacked at us) against one row tile or two: their sums, then their float step.
inline void amx_q4_k_super(const uint8_t* us, const AmxRows& a, const AmxRows& b, bool two, int64_t ldy,
                           int64_t act_bytes, bool first) {
  alignas(64) int32_t sums[4][AMX_TILE_ROWS * 16];
  amx_k_sums<false>(us + AMX_HEAD, a, b, two, act_bytes, sums);
  amx_q4_k_finish(us, sums, a, ldy, act_bytes, first);
  if (two) amx_q4_k_finish(us, sums + 2, b, ldy, act_bytes, first);
}

// One block of a pair of groups of Q4_1_X8 (at o0, o1: X8_Q41_BYTES each) -> AMX_Q41_BLOCK bytes at u.
inline void amx_unpack_q4_1(const uint8_t* o0, const uint8_t* o1, uint8_t* u) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  prefetch_ahead(o0, X8_Q41_BYTES), prefetch_ahead(o1, X8_Q41_BYTES);
  _mm512_storeu_ps(u, join_ps(f16x8(o0), f16x8(o1)));
  _mm512_storeu_ps(u + 64, join_ps(f16x8(o0 + 16), f16x8(o1 + 16)));
  for (int c = 0; c < 4; ++c) {  // vector c: low nibbles values 4c..4c+3, high nibbles 16 + 4c..
    const __m512i v = join(load256(o0 + 32 + 32 * c), load256(o1 + 32 + 32 * c));
    _mm512_storeu_si512(u + 128 + 64 * c, _mm512_and_si512(v, m4));
    _mm512_storeu_si512(u + 128 + 64 * (4 + c), _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
  }
}

// Tile C = the sums of the block unpacked at ub against the activations at xb (tiles A, B: its operands). A macro
// for SPECDEC_AMX_HIGH's reason: literal tile numbers only.
#define SPECDEC_AMX_Q4_1_SUMS(C, A, B, ub, xb, act_bytes) \
  do {                                                    \
    _tile_loadd(B, (ub) + 128, 64);                       \
    _tile_loadd(A, (xb), (act_bytes));                    \
    _tile_zero(C);                                        \
    _tile_dpbsud(C, A, B);                                \
  } while (0)

// The float step of a block whose sums were just stored in `sums`: acc[r] for the row tile's rows r < height.
inline void amx_q4_1_step(const uint8_t* ub, const uint8_t* xb, int64_t act_bytes, int height, const int32_t* sums,
                          __m512* acc) {
  const __m512 d = _mm512_loadu_ps(ub), m = _mm512_loadu_ps(ub + 64);
#pragma GCC unroll 16
  for (int r = 0; r < AMX_TILE_ROWS; ++r) {
    if (r < height) {
      const BlockQ8& x = *reinterpret_cast<const BlockQ8*>(xb + r * act_bytes);
      const __m512 sumi = _mm512_cvtepi32_ps(_mm512_load_si512(sums + 16 * r));
      acc[r] = _mm512_fmadd_ps(sumi, _mm512_mul_ps(d, _mm512_set1_ps(x.d)), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.ds), acc[r]);
    }
  }
}

// A pair of groups of Q4_1_X8 (`blocks` blocks at g0, g1), unpacked whole into `u` (blocks * AMX_Q41_BLOCK bytes,
// in L1 or L2), then one row tile at a time: its 16 outputs a row stay in registers over all blocks, and the tile
// unit sums block b + 1 (tiles 1, 3, 5 or 0, 2, 4 in turn) while the float step of block b runs, every path's two
// fmas a block (interleaved.h's x8_q4_1_accumulate). One block a call, each block's sums waited for and its outputs
// loaded and stored, spent most of its time waiting on the tile unit and took 37% of the cache-off drafter's
// samples (forty-third pass).
inline void amx_q4_1_pair(const uint8_t* g0, const uint8_t* g1, int64_t blocks, const uint8_t* xq, int64_t act_bytes,
                          int64_t rows, float* y, int64_t ldy, uint8_t* u) {
  for (int64_t b = 0; b < blocks; ++b)
    amx_unpack_q4_1(g0 + b * X8_Q41_BYTES, g1 + b * X8_Q41_BYTES, u + b * AMX_Q41_BLOCK);
  asm volatile("" ::: "memory");  // the tile loads below read `u` (amx_pair's note)
  const int height = static_cast<int>(std::min<int64_t>(rows, AMX_TILE_ROWS));
  constexpr int64_t x_block = sizeof(BlockQ8);
  alignas(64) int32_t sums[AMX_TILE_ROWS * 16];
  for (int64_t t = 0; t * AMX_TILE_ROWS < rows; ++t) {
    const int64_t m0 = std::min<int64_t>(t * AMX_TILE_ROWS, rows - height);
    const uint8_t* xs = xq + m0 * act_bytes;
    __m512 acc[AMX_TILE_ROWS];
    for (int r = 0; r < AMX_TILE_ROWS; ++r) acc[r] = _mm512_setzero_ps();
    SPECDEC_AMX_Q4_1_SUMS(0, 2, 4, u, xs, act_bytes);
    for (int64_t b = 0; b < blocks; b += 2) {
      const uint8_t *u0 = u + b * AMX_Q41_BLOCK, *u1 = u0 + AMX_Q41_BLOCK;
      const uint8_t *x0 = xs + b * x_block, *x1 = x0 + x_block;
      if (b + 1 < blocks) SPECDEC_AMX_Q4_1_SUMS(1, 3, 5, u1, x1, act_bytes);
      _tile_stored(0, sums, 64);
      amx_q4_1_step(u0, x0, act_bytes, height, sums, acc);
      if (b + 1 == blocks) break;
      if (b + 2 < blocks) SPECDEC_AMX_Q4_1_SUMS(0, 2, 4, u1 + AMX_Q41_BLOCK, x1 + x_block, act_bytes);
      _tile_stored(1, sums, 64);
      amx_q4_1_step(u1, x1, act_bytes, height, sums, acc);
    }
    const int skip = static_cast<int>(t * AMX_TILE_ROWS - m0);  // rows an earlier tile did
#pragma GCC unroll 16
    for (int r = 0; r < AMX_TILE_ROWS; ++r)  // constant indices: acc stays in registers
      if (r >= skip && r < height) _mm512_storeu_ps(y + (m0 + r) * ldy, acc[r]);
  }
}
#undef SPECDEC_AMX_Q4_1_SUMS

// One Q6_K super-block of groups g0 and g1 (at o0, o1: X8_Q6K_BYTES each, interleaved.h's layout) -> AMX_Q6K_SUPER
// bytes at u: d of the 16 rows (floats), then the scale pairs of groups 2j, 2j + 1 of the 16 rows as int16 pairs
// (j = 0..7), then for each 64 values the high tile (signed), then the low one: each 6-bit value u times its
// group's signed scale, p = u * scale (at most 8064 in magnitude), split as p = 64 * high + low, low = p & 63.
inline void amx_unpack_q6_k(const uint8_t* o0, const uint8_t* o1, uint8_t* u) {
  prefetch_ahead(o0, X8_Q6K_BYTES), prefetch_ahead(o1, X8_Q6K_BYTES);
  const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3), byte = _mm512_set1_epi16(0x00FF);
  const __m512i m63 = _mm512_set1_epi16(63), word = _mm512_set1_epi32(0xFFFF);
  _mm512_storeu_ps(u, join_ps(f16x8(o0), f16x8(o1)));
  const auto scales = [&](int g) {  // group g's scale of output row n in dword lane n, sign-extended
    return _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(load64(o0 + 16 + 8 * g), load64(o1 + 16 + 8 * g)));
  };
  for (int j = 0; j < 8; ++j) {
    const __m512i even = _mm512_and_si512(scales(2 * j), word), odd = _mm512_slli_epi32(scales(2 * j + 1), 16);
    const __m512i pair = _mm512_or_si512(even, odd);
    _mm512_storeu_si512(u + 64 + 64 * j, pair);
  }
  for (int c = 0; c < 8; ++c) {
    const uint8_t* c0 = o0 + 144 + 192 * c;
    const uint8_t* c1 = o1 + 144 + 192 * c;
    const auto vector = [&](int at) { return join(load256(c0 + at), load256(c1 + at)); };
    const __m512i nibbles[4] = {vector(0), vector(32), vector(64), vector(96)}, twos[2] = {vector(128), vector(160)};
    for (int h = 0; h < 2; ++h) {  // groups 2c (values 4j.., j < 4) and 2c + 1
      const __m512i v = scales(2 * c + h);
      const __m512i sc = _mm512_or_si512(_mm512_and_si512(v, word), _mm512_slli_epi32(v, 16));  // (scale, scale)
      for (int jj = 0; jj < 4; ++jj) {
        const int j = 4 * h + jj;  // value vector j: values 32c + 4j .. 32c + 4j + 3
        const __m512i n = nibbles[(j & 1) + 2 * (j >> 2)];
        const __m512i low4 = (j & 2) ? _mm512_and_si512(_mm512_srli_epi16(n, 4), m4) : _mm512_and_si512(n, m4);
        const __m512i two = _mm512_and_si512(_mm512_srl_epi16(twos[j & 1], _mm_cvtsi32_si128(2 * (j >> 1))), m3);
        const __m512i values = _mm512_or_si512(low4, _mm512_slli_epi16(two, 4));
        // both bytes of a word are one output row's: products as int16, then split and packed back to bytes
        const __m512i even = _mm512_mullo_epi16(_mm512_and_si512(values, byte), sc);
        const __m512i odd = _mm512_mullo_epi16(_mm512_srli_epi16(values, 8), sc);
        const __m512i high = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(even, 6), byte),
                                             _mm512_slli_epi16(_mm512_srai_epi16(odd, 6), 8));
        const __m512i low =
            _mm512_or_si512(_mm512_and_si512(even, m63), _mm512_slli_epi16(_mm512_and_si512(odd, m63), 8));
        uint8_t* tiles = u + AMX_Q6K_HEAD + 2048 * (c / 2) + 64 * (8 * (c & 1) + j);
        _mm512_storeu_si512(tiles, high);
        _mm512_storeu_si512(tiles + 1024, low);
      }
    }
  }
}

// One Q6_K super-block (unpacked at us) against one row tile or two: their sums (tdpbssd with the high tiles),
// then every path's float step (interleaved.h's tile_x8_k16_portable): total = 64 * high + low - 32 *
// offsets, offsets the sum over groups of scale * bsums, exact; acc = fma(float(total), d * xd, acc).
inline void amx_q6_k_super(const uint8_t* us, const AmxRows& a, const AmxRows& b, bool two, int64_t ldy,
                           int64_t act_bytes, bool first) {
  alignas(64) int32_t sums[4][AMX_TILE_ROWS * 16];
  amx_k_sums<true>(us + AMX_Q6K_HEAD, a, b, two, act_bytes, sums);
  const __m512 d = _mm512_loadu_ps(us);
  __m512i pairs[8];
  for (int j = 0; j < 8; ++j) pairs[j] = _mm512_loadu_si512(us + 64 + 64 * j);
  for (int i = 0; i < (two ? 2 : 1); ++i) {
    const AmxRows& t = i ? b : a;
    for (int r = t.skip; r < t.rows; ++r) {
      const BlockQ8K& xb = *reinterpret_cast<const BlockQ8K*>(t.x + r * act_bytes);
      __m512i offsets = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        int32_t bsums;
        std::memcpy(&bsums, xb.bsums + 2 * j, sizeof(bsums));
        offsets = _mm512_dpwssd_epi32(offsets, pairs[j], _mm512_set1_epi32(bsums));
      }
      const __m512i total = _mm512_sub_epi32(
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[2 * i] + 16 * r), 6),
                           _mm512_load_si512(sums[2 * i + 1] + 16 * r)),
          _mm512_slli_epi32(offsets, 5));
      __m512 acc = first ? _mm512_setzero_ps() : _mm512_loadu_ps(t.y + r * ldy);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, _mm512_set1_ps(xb.d)), acc);
      _mm512_storeu_ps(t.y + r * ldy, acc);
    }
  }
}

// `rows` activation rows (xq, row stride act_bytes) against a pair of groups of Q4_K_X8, Q6_K_X8 or Q4_1_X8 (g0, g1:
// `blocks` blocks each) -> y[m * ldy + n], n < 16; Q4_1_X8 as amx_q4_1_pair does. The K-quants block by block:
// its weights are unpacked into `u` (which stays in L1 with the block's activations while every row tile passes),
// then the row tiles two at a time. From 16 rows every tile has 16 (the last starts at rows - 16 and leaves the
// rows before it to the tile before), so one configuration serves the whole product: amx_configure(type,
// min(rows, 16)) before.
inline void amx_pair(int64_t type, const uint8_t* g0, const uint8_t* g1, int64_t blocks, const uint8_t* xq,
                     int64_t act_bytes, int64_t rows, float* y, int64_t ldy, uint8_t* u) {
  if (type == Q4_1_X8) return amx_q4_1_pair(g0, g1, blocks, xq, act_bytes, rows, y, ldy, u);
  const int64_t group_block = type == Q4_K_X8 ? X8_BYTES : X8_Q6K_BYTES;
  constexpr int64_t x_block = sizeof(BlockQ8K);
  const int64_t height = std::min<int64_t>(rows, AMX_TILE_ROWS);
  const int64_t tiles = (rows + AMX_TILE_ROWS - 1) / AMX_TILE_ROWS;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t *o0 = g0 + b * group_block, *o1 = g1 + b * group_block;
    type == Q4_K_X8 ? amx_unpack_q4_k(o0, o1, u) : amx_unpack_q6_k(o0, o1, u);
    // GCC's tile loads are asm with register operands only: nothing tells the compiler they read what was just
    // written to `u`, so no store may move past this point
    asm volatile("" ::: "memory");
    const uint8_t* xs = xq + b * x_block;
    const auto tile = [&](int64_t t) {
      const int64_t m0 = std::min(t * AMX_TILE_ROWS, rows - height);
      const int skip = static_cast<int>(t * AMX_TILE_ROWS - m0);
      return AmxRows{xs + m0 * act_bytes, y + m0 * ldy, static_cast<int>(height), skip};
    };
    for (int64_t t = 0; t < tiles; t += 2) {
      const bool two = t + 1 < tiles;
      const AmxRows first_tile = tile(t), second_tile = two ? tile(t + 1) : first_tile;
      if (type == Q4_K_X8)
        amx_q4_k_super(u, first_tile, second_tile, two, ldy, act_bytes, b == 0);
      else
        amx_q6_k_super(u, first_tile, second_tile, two, ldy, act_bytes, b == 0);
    }
  }
}

}  // namespace
#endif  // SPECDEC_AMX
