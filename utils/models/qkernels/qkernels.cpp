// Integer matrix kernels for GGUF blocks on CPU: y = x @ w.T with w kept as the file's own blocks.
//
// Activations are quantised once per row to 8 bits, q = round(x / d) with d = max|x| / 127, as llama.cpp does:
// in blocks of 32 for the legacy types (`quantize_q8`: a weight block of 32 is unsigned integers u with
// w = a * u + b, its dot product an exact integer sum, floats once per block), in blocks of 256 with sums per 16
// for the K-quants (`quantize_q8k`: the sub-block scales apply in integer arithmetic, floats once per
// super-block, the minimums folded in from the activation sums).
//
// Three paths compute the same numbers, bit for bit: a portable one (plain C++), AVX2 (maddubs + madd), and
// AVX-VNNI (dpbusd, 256-bit, legacy types) where the compiler targets it. Each float operation is defined per lane: lane l of
// a block holds the integer sum of its bytes 4l..4l+3 (what both madd and dpbusd produce), is widened to float
// and fused-multiply-added into accumulator lane l; the 8 lanes are summed in one fixed order at the end. The
// portable path mirrors that with std::fma, and the file is compiled with -ffp-contract=off so no compiler
// fuses anything on its own. Consequences: a row's result does not depend on how many rows share its call
// (batch invariance, which greedy speculative decoding needs), nor on which path ran it.
//
// Layouts from ggml-common.h / ggml-quants.c (facts, not code): see the `walk_*` functions.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECDEC_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPECDEC_VNNI 1
#define SPECDEC_DPBUSD(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define SPECDEC_VNNI 1
#define SPECDEC_DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#endif

namespace {

// GGML type ids (gguf.GGMLQuantizationType).
enum : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
enum : int64_t { PORTABLE = 0, AVX2 = 1, VNNI = 2 };

constexpr int QK = 32;    // activation block, and the unit every weight type is walked in
constexpr int QK_K = 256; // K-quant super-block
constexpr int MR = 4;     // activation rows per tile: a weight block is decoded once for this many rows

struct BlockQ8 {
  int8_t q[QK];
  float d;      // scale: x ~ d * q
  float ds;     // d * (s[0] + s[1]), for the offsets of the per-32 types
  int16_t s[2]; // sums of q over values 0..15 and 16..31 (Q6_K's offsets are per 16)
};
static_assert(sizeof(BlockQ8) == 44, "activation block layout");

// Activations for the K-quants: one scale per super-block of 256, sums per 16 for the weights' offsets, so the
// sub-block scales apply in integer arithmetic and floats enter once per super-block.
struct BlockQ8K {
  float d;
  int8_t q[QK_K];
  int16_t bsums[16];
};
static_assert(sizeof(BlockQ8K) == 292, "K activation block layout");

inline bool is_k_quant(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

struct TypeInfo {
  int64_t block_values, block_bytes;
};

bool type_info(int64_t type, TypeInfo* info) {
  switch (type) {
    case Q4_0: *info = {32, 18}; return true;
    case Q4_1: *info = {32, 20}; return true;
    case Q5_0: *info = {32, 22}; return true;
    case Q8_0: *info = {32, 34}; return true;
    case Q4_K: *info = {256, 144}; return true;
    case Q5_K: *info = {256, 176}; return true;
    case Q6_K: *info = {256, 210}; return true;
    default: return false;
  }
}

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
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

// One weight block of 32 of the legacy types, as every path sees it: w_i = a * v_i + b (Q8_0: signed v, b = 0;
// the others unsigned v).
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
      for (int64_t j = 0; j < blocks32; ++j) {
        const uint8_t* p = w + j * (type == Q4_0 ? 18 : type == Q4_1 ? 20 : 22);
        const float d = f16(p);
        const uint8_t* qs = p + (type == Q4_0 ? 2 : type == Q4_1 ? 4 : 6);
        uint32_t qh = 0;
        if (type == Q5_0) std::memcpy(&qh, p + 2, 4);
        for (int i = 0; i < 16; ++i) {
          blk.v[i] = qs[i] & 0xF;
          blk.v[i + 16] = qs[i] >> 4;
          if (type == Q5_0) {
            blk.v[i] |= ((qh >> i) & 1) << 4;
            blk.v[i + 16] |= ((qh >> (i + 16)) & 1) << 4;
          }
        }
        blk.a = d;
        blk.b = type == Q4_0 ? -8.0f * d : type == Q4_1 ? f16(p + 2) : -16.0f * d;
        f(j, blk);
      }
      break;
    case Q8_0:
      for (int64_t j = 0; j < blocks32; ++j) {
        const uint8_t* p = w + j * 34;
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

inline float lane_sum(const float* a) {
  // the AVX2 path's horizontal sum, in its order: halves, then pairs, then the last two
  const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
  return (s0 + s2) + (s1 + s3);
}

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
      if (type != Q8_0) off[r][parity] += offset_term(blk, xb);  // as the AVX2 path: Q8_0 has no offset
    }
  });
  for (int r = 0; r < R; ++r) y[r * ldy] = finish(acc[r][0], acc[r][1], off[r][0], off[r][1]);
}

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

// -- AVX2 / AVX-VNNI -------------------------------------------------------------------------------------------
#ifdef SPECDEC_AVX2

// 8 int32 lanes, lane l = sum over bytes 4l..4l+3 of u * s (u unsigned, s signed), or with int16 scales `sc`
// per half for Q6_K. maddubs cannot saturate here: u <= 63 (128 for Q8_0's |w|), |s| <= 127.
template <bool Vnni>
inline __m256i dot_lanes(__m256i u, __m256i s) {
#ifdef SPECDEC_VNNI
  if (Vnni) return SPECDEC_DPBUSD(_mm256_setzero_si256(), u, s);
#endif
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // a0+a4 .. a3+a7
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));  // (s0+s2), (s1+s3)
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline __m256i bytes_from_bits(uint32_t bits) {
  // byte i = 0xFF where bit i is set
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  const __m256i mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, mask), _mm256_set1_epi64x(-1));
}

template <int R, bool Vnni>
struct Avx2Tile {
  const BlockQ8* const* x;
  __m256 acc[2][R];  // [block parity][row], as the portable path
  float off[2][R];

  explicit Avx2Tile(const BlockQ8* const* rows) : x(rows) {
    for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps(), off[0][r] = off[1][r] = 0.0f;
  }

  // One block of unsigned values u for all rows; Signed: Q8_0's signed weights (u = |w|, activations take w's
  // sign). P is the block index's parity, a compile-time constant so the accumulators stay in registers.
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

template <int R, bool Vnni>
__attribute__((flatten)) void tile_avx2(int64_t type, const uint8_t* w, int64_t blocks32, const BlockQ8* const* x, float* y, int64_t ldy) {
  Avx2Tile<R, Vnni> t(x);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i none = _mm256_setzero_si256();
  WBlock blk;
  switch (type) {
    case Q4_0:
    case Q4_1:
    case Q5_0: {
      const int64_t bytes = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 22;
      const int64_t qs_at = type == Q4_0 ? 2 : type == Q4_1 ? 4 : 6;
      auto one = [&](int64_t j, auto parity) {
        const uint8_t* p = w + j * bytes;
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + qs_at));
        __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
        const float d = f16(p);
        blk.a = d;
        if (type == Q5_0) {
          uint32_t qh;
          std::memcpy(&qh, p + 2, 4);
          u = _mm256_or_si256(u, _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10)));
          blk.b = -16.0f * d;
        } else {
          blk.b = type == Q4_0 ? -8.0f * d : f16(p + 2);
        }
        t.template block<decltype(parity)::value, false>(j, u, none, blk);
      };
      int64_t j = 0;
      for (; j + 1 < blocks32; j += 2) one(j, Parity<0>{}), one(j + 1, Parity<1>{});
      if (j < blocks32) one(j, Parity<0>{});
      break;
    }
    case Q8_0: {
      auto one = [&](int64_t j, auto parity) {
        const uint8_t* p = w + j * 34;
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
        blk.a = f16(p);
        t.template block<decltype(parity)::value, true>(j, _mm256_abs_epi8(q), q, blk);
      };
      int64_t j = 0;
      for (; j + 1 < blocks32; j += 2) one(j, Parity<0>{}), one(j + 1, Parity<1>{});
      if (j < blocks32) one(j, Parity<0>{});
      break;
    }
  }
  t.store(y, ldy);
}
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

std::vector<int64_t> available_paths() {
  std::vector<int64_t> paths{PORTABLE};
#ifdef SPECDEC_AVX2
  paths.push_back(AVX2);
#endif
#ifdef SPECDEC_VNNI
  paths.push_back(VNNI);
#endif
  return paths;
}

int64_t best_path() { return available_paths().back(); }

template <int R>
void run_tile(int64_t path, int64_t type, const uint8_t* w, int64_t blocks32, const BlockQ8* const* x, float* y,
              int64_t ldy) {
#ifdef SPECDEC_AVX2
#ifdef SPECDEC_VNNI
  if (path == VNNI) return tile_avx2<R, true>(type, w, blocks32, x, y, ldy);
#endif
  if (path == AVX2) return tile_avx2<R, false>(type, w, blocks32, x, y, ldy);
#endif
  tile_portable<R>(type, w, blocks32, x, y, ldy);
}

template <int R>
void run_k_tile(int64_t path, int64_t type, const uint8_t* w, int64_t supers, int64_t bytes, const BlockQ8K* const* x,
                float* y, int64_t ldy) {
#ifdef SPECDEC_AVX2
  if (path != PORTABLE) return tile_k_avx2<R>(type, w, supers, bytes, x, y, ldy);  // VNNI adds nothing here
#endif
  tile_k_portable<R>(type, w, supers, bytes, x, y, ldy);
}

void run_k_rows(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t supers, int64_t bytes,
                const BlockQ8K* const* x, float* y, int64_t ldy) {
  switch (rows) {
    case 4: return run_k_tile<4>(path, type, w, supers, bytes, x, y, ldy);
    case 3: return run_k_tile<3>(path, type, w, supers, bytes, x, y, ldy);
    case 2: return run_k_tile<2>(path, type, w, supers, bytes, x, y, ldy);
    default: return run_k_tile<1>(path, type, w, supers, bytes, x, y, ldy);
  }
}

void run_rows(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t blocks32, const BlockQ8* const* x,
              float* y, int64_t ldy) {
  switch (rows) {
    case 4: return run_tile<4>(path, type, w, blocks32, x, y, ldy);
    case 3: return run_tile<3>(path, type, w, blocks32, x, y, ldy);
    case 2: return run_tile<2>(path, type, w, blocks32, x, y, ldy);
    default: return run_tile<1>(path, type, w, blocks32, x, y, ldy);
  }
}

// -- ops -------------------------------------------------------------------------------------------------------

at::Tensor quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quantize_q8: expected a 2-D float32 tensor");
  TORCH_CHECK(x.size(1) % QK == 0, "quantize_q8: the row length must be a multiple of 32, got ", x.size(1));
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), blocks = xc.size(1) / QK;
  at::Tensor out = at::empty({rows, blocks * static_cast<int64_t>(sizeof(BlockQ8))}, x.options().dtype(at::kByte));
  const float* src = xc.data_ptr<float>();
  BlockQ8* dst = reinterpret_cast<BlockQ8*>(out.data_ptr<uint8_t>());
  at::parallel_for(0, rows * blocks, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* v = src + b * QK;
      float amax = 0.0f;
      for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      BlockQ8& blk = dst[b];
      int s0 = 0, s1 = 0;
      for (int i = 0; i < QK; ++i) {
        const float q = std::nearbyint(v[i] * id);  // round half to even, as torch.round
        blk.q[i] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, q)));
        (i < 16 ? s0 : s1) += blk.q[i];
      }
      blk.d = d;
      blk.ds = d * static_cast<float>(s0 + s1);
      blk.s[0] = static_cast<int16_t>(s0);
      blk.s[1] = static_cast<int16_t>(s1);
    }
  });
  return out;
}

at::Tensor quantize_q8k(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quantize_q8k: expected a 2-D float32 tensor");
  TORCH_CHECK(x.size(1) % QK_K == 0, "quantize_q8k: the row length must be a multiple of 256, got ", x.size(1));
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), blocks = xc.size(1) / QK_K;
  at::Tensor out = at::empty({rows, blocks * static_cast<int64_t>(sizeof(BlockQ8K))}, x.options().dtype(at::kByte));
  const float* src = xc.data_ptr<float>();
  BlockQ8K* dst = reinterpret_cast<BlockQ8K*>(out.data_ptr<uint8_t>());
  at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* v = src + b * QK_K;
      float amax = 0.0f;
      for (int i = 0; i < QK_K; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      BlockQ8K& blk = dst[b];
      for (int g = 0; g < 16; ++g) {
        int sum = 0;
        for (int i = 16 * g; i < 16 * g + 16; ++i) {
          blk.q[i] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, std::nearbyint(v[i] * id))));
          sum += blk.q[i];
        }
        blk.bsums[g] = static_cast<int16_t>(sum);
      }
      blk.d = d;
    }
  });
  return out;
}

at::Tensor gguf_mm(const at::Tensor& xq, const at::Tensor& w, int64_t type, int64_t in_features, int64_t path) {
  TypeInfo info;
  TORCH_CHECK(type_info(type, &info), "gguf_mm: no kernel for GGML type ", type);
  TORCH_CHECK(in_features % info.block_values == 0, "gguf_mm: in_features ", in_features,
              " is not a multiple of the type's block of ", info.block_values);
  const int64_t blocks32 = in_features / QK;
  const int64_t row_bytes = in_features / info.block_values * info.block_bytes;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == row_bytes,
              "gguf_mm: expected weight blocks [out, ", row_bytes, "] uint8, contiguous");
  const bool k = is_k_quant(type);
  const int64_t act_bytes = k ? in_features / QK_K * static_cast<int64_t>(sizeof(BlockQ8K))
                              : blocks32 * static_cast<int64_t>(sizeof(BlockQ8));
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kByte && xq.is_contiguous() && xq.size(1) == act_bytes,
              "gguf_mm: activations must come from ", k ? "quantize_q8k" : "quantize_q8", " over rows of ",
              in_features);
  const std::vector<int64_t> paths = available_paths();
  if (path < 0) path = best_path();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "gguf_mm: path ", path,
              " is not compiled in for this CPU");
  const int64_t rows = xq.size(0), out_features = w.size(0);
  at::Tensor y = at::empty({rows, out_features}, xq.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const BlockQ8* xp = reinterpret_cast<const BlockQ8*>(xq.data_ptr<uint8_t>());
  const BlockQ8K* xkp = reinterpret_cast<const BlockQ8K*>(xq.data_ptr<uint8_t>());
  const int64_t supers = in_features / QK_K;
  float* yp = y.data_ptr<float>();
  // Weight rows in chunks that stay in L2 while every tile of activation rows passes over them.
  const int64_t chunk = std::max<int64_t>(1, (64 << 10) / row_bytes);
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(chunk, out_features / (4 * at::get_num_threads()) + 1));
  at::parallel_for(0, out_features, grain, [&](int64_t n0, int64_t n1) {
    const BlockQ8* tile[MR];
    const BlockQ8K* ktile[MR];
    for (int64_t nc = n0; nc < n1; nc += chunk) {
      const int64_t nend = std::min(n1, nc + chunk);
      for (int64_t m0 = 0; m0 < rows; m0 += MR) {
        const int64_t r = std::min<int64_t>(MR, rows - m0);
        for (int64_t i = 0; i < r; ++i) tile[i] = xp + (m0 + i) * blocks32, ktile[i] = xkp + (m0 + i) * supers;
        for (int64_t n = nc; n < nend; ++n) {
          float* out = yp + m0 * out_features + n;
          if (k)
            run_k_rows(r, path, type, wp + n * row_bytes, supers, info.block_bytes, ktile, out, out_features);
          else
            run_rows(r, path, type, wp + n * row_bytes, blocks32, tile, out, out_features);
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("quantize_q8(Tensor x) -> Tensor");
  m.def("quantize_q8k(Tensor x) -> Tensor");
  m.def("gguf_mm(Tensor xq, Tensor w, int type, int in_features, int path=-1) -> Tensor");
  m.def("paths() -> int[]", &available_paths);
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("quantize_q8", &quantize_q8);
  m.impl("quantize_q8k", &quantize_q8k);
  m.impl("gguf_mm", &gguf_mm);
}
