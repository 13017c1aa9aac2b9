// The definitions of matmul.h: 8-bit activation quantisation per block, and the threaded loop over output rows,
// which calls the tiles (tiles.h: tiles_k.cpp, tiles_legacy.cpp, tiles_x8.cpp). A translation unit of its own
// (torch's tensor headers are not needed here), so the build compiles it beside the glue and the tiles.

#include "matmul.h"

#include "amx.h"
#include "interleaved.h"  // the layouts' conversions (interleave_rows)
#include "tiles.h"

#include <atomic>
#include <cstdlib>
#include <limits>

namespace {

// -- activation quantisation: one block at a time, the same code for the ops and the fused layers -------------
// The vector form gives the same bytes as the scalar one (tests): the largest magnitude does not depend on the
// order it is searched in, each value is the same float product rounded by the same rule, and the sums are of
// integers. Scalar, it took 7% of a 60-row cache-off pass of the 1.5B (perf, Zen 5, twenty-fourth pass).

inline float scale_of(float amax, float* inverse) {
  const float d = amax / 127.0f;
  *inverse = d != 0.0f ? 1.0f / d : 0.0f;
  return d;
}

inline float absmax(const float* v, int n) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(v[i]));  // a NaN is passed over
  return amax;
}

inline int8_t to_q8(float v, float inverse) {  // round half to even, as torch.round
  return static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, std::nearbyint(v * inverse))));
}

inline void set_block_sums(BlockQ8* blk, float d, int s0, int s1) {  // s0, s1: the sums of values 0..15, 16..31
  blk->d = d;
  blk->ds = d * static_cast<float>(s0 + s1);
  blk->s[0] = static_cast<int16_t>(s0);
  blk->s[1] = static_cast<int16_t>(s1);
}

inline void quantize_block_q8(const float* v, BlockQ8* blk) {
  float id;
  const float d = scale_of(absmax(v, QK), &id);
  int s0 = 0, s1 = 0;
  for (int i = 0; i < QK; ++i) {
    blk->q[i] = to_q8(v[i], id);
    (i < 16 ? s0 : s1) += blk->q[i];
  }
  set_block_sums(blk, d, s0, s1);
}

inline void quantize_block_q8k(const float* v, BlockQ8K* blk) {
  float id;
  blk->d = scale_of(absmax(v, QK_K), &id);
  for (int g = 0; g < 16; ++g) {
    int sum = 0;
    for (int i = 16 * g; i < 16 * g + 16; ++i) sum += (blk->q[i] = to_q8(v[i], id));
    blk->bsums[g] = static_cast<int16_t>(sum);
  }
  for (int k = 0; k < 8; ++k) blk->sums32[k] = static_cast<int16_t>(blk->bsums[2 * k] + blk->bsums[2 * k + 1]);
  std::memset(blk->unused, 0, sizeof(blk->unused));  // the same bytes for the same row, always
}

#ifdef SPECDEC_AVX2
inline float absmax_avx2(const float* v, int n) {  // n a multiple of 8
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  // maxps returns its second operand where the first is NaN: a NaN is passed over, as in absmax
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// 8 values as to_q8 makes them, in int32 lanes: nearbyint's rounding, then min and max in to_q8's operand order
// (a NaN product becomes 127 in both).
inline __m256i to_q8_avx2(const float* v, __m256 inverse) {
  const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(v), inverse), _MM_FROUND_NEARBYINT);
  return _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(r, _mm256_set1_ps(127.0f)), _mm256_set1_ps(-127.0f)));
}

inline int sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// 32 values quantised as to_q8 makes them, stored as int8 in their order; their sums per 16.
inline void quantise_32_avx2(const float* v, __m256 inverse, int8_t* out, int* first16, int* second16) {
  const __m256i q[4] = {to_q8_avx2(v, inverse), to_q8_avx2(v + 8, inverse), to_q8_avx2(v + 16, inverse),
                        to_q8_avx2(v + 24, inverse)};  // int32 lanes in [-127, 127]
  const __m256i ab = _mm256_packs_epi32(q[0], q[1]), cd = _mm256_packs_epi32(q[2], q[3]);
  // dwords now hold values 0-3, 8-11, 16-19, 24-27, 4-7, 12-15, 20-23, 28-31
  const __m256i bytes =
      _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
  *first16 = sum_lanes(_mm256_add_epi32(q[0], q[1]));
  *second16 = sum_lanes(_mm256_add_epi32(q[2], q[3]));
}

inline void quantize_block_q8_avx2(const float* v, BlockQ8* blk) {
  float id;
  const float d = scale_of(absmax_avx2(v, QK), &id);
  int s0, s1;
  quantise_32_avx2(v, _mm256_set1_ps(id), blk->q, &s0, &s1);
  set_block_sums(blk, d, s0, s1);
}

inline void quantize_block_q8k_avx2(const float* v, BlockQ8K* blk) {
  float id;
  blk->d = scale_of(absmax_avx2(v, QK_K), &id);
  const __m256 inverse = _mm256_set1_ps(id);
  for (int j = 0; j < QK_K / 32; ++j) {
    int first, second;
    quantise_32_avx2(v + 32 * j, inverse, blk->q + 32 * j, &first, &second);
    blk->bsums[2 * j] = static_cast<int16_t>(first);
    blk->bsums[2 * j + 1] = static_cast<int16_t>(second);
    blk->sums32[j] = static_cast<int16_t>(first + second);
  }
  std::memset(blk->unused, 0, sizeof(blk->unused));
}
#endif

}  // namespace

namespace specdec {

std::vector<int64_t> available_paths() {
  std::vector<int64_t> paths{PORTABLE};
#ifdef SPECDEC_AVX2
  paths.push_back(AVX2);
#endif
#ifdef SPECDEC_VNNI
  paths.push_back(VNNI);
#endif
#ifdef SPECDEC_AVX512
  paths.push_back(AVX512);
#endif
#ifdef SPECDEC_AMX
  if (amx_permitted()) paths.push_back(AMX);
#endif
  return paths;
}

int64_t best_path() { return available_paths().back(); }

// The CPU flags (as /proc/cpuinfo names them) each path of available_paths() executes, as this build encoded
// them: the VNNI path's dpbusd is AVX-VNNI's VEX form, or AVX-512 VNNI's EVEX form where the build has AVX512VL
// (a CPU with one of the two may lack the other, and raise #UD on it).
std::vector<std::string> path_flags() {
  std::vector<std::string> flags{""};
#ifdef SPECDEC_AVX2
  flags.push_back("avx2 fma");
#endif
#ifdef SPECDEC_VNNI
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  flags.push_back("avx2 fma avx512_vnni avx512vl");
#else
  flags.push_back("avx2 fma avx_vnni");
#endif
#endif
#ifdef SPECDEC_AVX512
  flags.push_back("avx2 fma avx512f avx512bw avx512dq avx512vl avx512_vnni");
#endif
#ifdef SPECDEC_AMX
  if (amx_permitted()) flags.push_back("avx512f avx512bw avx512dq avx512vl avx512_vnni amx_int8 amx_tile");
#endif
  return flags;
}

// x [rows, in] float32 (row stride ldx) -> dst [rows, activation_row_bytes], threads over blocks.
void quantize_rows(const float* x, int64_t rows, int64_t in, int64_t ldx, bool k, uint8_t* dst, bool portable) {
  const int64_t per_row = in / (k ? QK_K : QK), bytes = activation_row_bytes(k, in);
#ifdef SPECDEC_AVX2
  const bool vector = !portable;
#else
  const bool vector = false;
  (void)portable;
#endif
  at::parallel_for(0, rows * per_row, k ? 64 : 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t r = b / per_row, j = b % per_row;
      const float* v = x + r * ldx + j * (k ? QK_K : QK);
      BlockQ8K* to_k = reinterpret_cast<BlockQ8K*>(dst + r * bytes) + j;
      BlockQ8* to = reinterpret_cast<BlockQ8*>(dst + r * bytes) + j;
#ifdef SPECDEC_AVX2
      if (vector) {
        k ? quantize_block_q8k_avx2(v, to_k) : quantize_block_q8_avx2(v, to);
        continue;
      }
#endif
      k ? quantize_block_q8k(v, to_k) : quantize_block_q8(v, to);
    }
  });
}

// Parts per thread in mm_many, taken in turn from a shared counter: on a 2-vCPU VM whose vCPUs slow down at
// different times, one fixed half each made a wide product wait for the slower half (benchmarks/RESULTS.md, twelfth
// pass: 4-row to 60-row passes of the 1.5B 5-20% faster). One-row products, bound by memory, keep one part each.
constexpr int64_t PARTS_PER_THREAD = 8;
inline int64_t parts_per_thread(int64_t rows) { return rows >= 2 ? PARTS_PER_THREAD : 1; }

// -- products ---------------------------------------------------------------------------------------------------

// Activation rows from which a product runs on the tile unit (amx.h) on the AMX path: unpacking its weights for the
// tile unit costs a Q4_K_X8 product about what AVX-512's tiles save at 6-9 rows, a Q6_K_X8 one (more work a
// value) at 9-16 (benchmarks/RESULTS.md, forty-second pass), a Q4_1_X8 one (a float step every 32 values, beside
// the tile unit's sums of the next block) at 9-12 (forty-third pass: at 12 rows 0.8-0.9x AVX-512's time on the
// 0.5B drafter's shapes, at 8 1.0-1.2x).
inline int64_t amx_min_rows(int64_t type) {
  return type == Q4_K_X8 ? 8 : type == Q6_K_X8 ? 16 : type == Q4_1_X8 ? 12 : std::numeric_limits<int64_t>::max();
}

// This thread's room for unpacked weights (mm_many), at least `bytes`: kept between products, as the pool's threads.
inline uint8_t* unpack_space(int64_t bytes) {
  static thread_local std::vector<uint8_t> space;
  if (static_cast<int64_t>(space.size()) < bytes) space.resize(bytes);
  return space.data();
}

#ifdef SPECDEC_AMX
// Units [n0, n1) (groups of 8 output rows) of a Q4_K_X8, Q6_K_X8 or Q4_1_X8 weight on the tile unit, a pair of
// groups at a time (amx.h); a group left alone runs AVX-512's tiles (the same bits). `path`: AVX-512's.
void amx_part(const MatRef& m, int64_t rows, int64_t blocks, int64_t act_bytes, int64_t n0, int64_t n1, int64_t path) {
  const int64_t unit_bytes = m.row_bytes * X8_ROWS;
  uint8_t* u = unpack_space(m.type == Q4_1_X8 ? blocks * AMX_Q41_BLOCK : AMX_UNPACKED);  // Q4_1: a pair's blocks
  bool configured = false;
  for (int64_t n = n0; n < n1;) {
    if (n + 1 < n1) {
      if (!configured) amx_configure(m.type, static_cast<int>(std::min<int64_t>(rows, AMX_TILE_ROWS)));
      configured = true;
      amx_pair(m.type, m.w + n * unit_bytes, m.w + (n + 1) * unit_bytes, blocks, m.xq, act_bytes, rows,
               m.y + n * X8_ROWS, m.ldy, u);
      n += 2;
      continue;
    }
    const void* tile[MR_WIDE];
    for (int64_t m0 = 0, r; m0 < rows; m0 += r) {
      r = std::min<int64_t>(MR_WIDE, rows - m0);
      for (int64_t j = 0; j < r; ++j) tile[j] = m.xq + (m0 + j) * act_bytes;
      specdec::x8_tile(r, path, m.type, m.w + n * unit_bytes, blocks, tile, m.y + m0 * m.ldy + n * X8_ROWS, m.ldy);
    }
    n += 1;
  }
  if (configured) _tile_release();
}
#endif

// y = x @ w.T for every weight of `mats`, `rows` activation rows, one threaded loop over all their output rows.
// A row's results depend neither on `rows`, nor on how the weights are grouped, nor on which thread takes a part
// (each output is one tile call).
// The loop runs over units: a weight row, or a group of 8 rows for the interleaved types (rows_per_unit).
void mm_many(const std::vector<MatRef>& mats, int64_t rows, int64_t path) {
  const bool amx = path == AMX;
  if (amx) path = AVX512;  // the tiles of every product amx.h does not take
  // Q4_K_X8, Q6_K_X8 and Q4_1_X8 on the tile unit, from amx_min_rows activation rows, two groups of 8 output rows
  // at a time
  const auto on_amx = [&](const MatRef& m) { return amx && rows >= amx_min_rows(m.type); };
  std::vector<int64_t> first{0};  // first[i]: index of mats[i]'s first unit in the joint range
  std::vector<int64_t> bytes_before{0};  // bytes of the weights before mats[i]
  int64_t widest = 1;
  for (const MatRef& m : mats) {
    const int64_t unit = rows_per_unit(m.type);
    first.push_back(first.back() + m.out / unit), widest = std::max(widest, m.row_bytes * unit);
    bytes_before.push_back(bytes_before.back() + m.out * m.row_bytes);
  }
  if (first.back() == 0 || rows == 0) return;
  // Weight units in chunks that stay in L2 while every tile of activation rows passes over them.
  const int64_t chunk = std::max<int64_t>(1, (64 << 10) / widest);
  // Parts of equal bytes rather than equal units: an interleaved unit is 8 rows, a file-layout one 1, and q, k, v
  // with v in Q6_K (half the 1.5B's layers) split by units gave one thread 6x the other's bytes.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t parts = threads * parts_per_thread(rows);
  std::vector<int64_t> bound(parts + 1, first.back());  // bound[p]: the first unit of part p
  for (int64_t p = 0, i = 0; p < parts; ++p) {
    const int64_t at_byte = bytes_before.back() * p / parts;
    while (bytes_before[i + 1] <= at_byte) ++i;
    const int64_t unit_bytes = mats[i].row_bytes * rows_per_unit(mats[i].type);
    bound[p] = first[i] + (at_byte - bytes_before[i] + unit_bytes - 1) / unit_bytes;
    if (on_amx(mats[i])) bound[p] = std::min(first[i + 1], first[i] + (bound[p] - first[i] + 1) / 2 * 2);  // pairs
  }
  const auto run_part = [&](int64_t n0, int64_t n1) {  // units [n0, n1) of the joint range
    if (n0 >= n1) return;
    size_t i = std::upper_bound(first.begin(), first.end(), n0) - first.begin() - 1;
    for (int64_t seg = n0; seg < n1; ++i) {  // the parts of [n0, n1) in each weight
      const MatRef& m = mats[i];
      const int64_t seg_end = std::min(n1, first[i + 1]);
      const bool k = is_k_quant(m.type), x8 = is_x8(m.type);
      const int64_t act_bytes = activation_row_bytes(k, m.in), unit = rows_per_unit(m.type);
      const int64_t unit_bytes = m.row_bytes * unit;
      const int64_t mr = x8 ? specdec::x8_tile_rows(path, m.type) : specdec::tile_rows(path);
      // The interleaved types' rows in tiles of near-equal widths (6 rows in tiles of at most 5: 3 and 3, not 5 and
      // 1): as many tiles, none a lone row re-reading the weights. Products of 5 and 9 rows in tiles of at most 4
      // measured the same either way (Q6_K_X8, Q4_1_X8; thirty-fifth pass).
      const int64_t tiles = (rows + mr - 1) / mr;
      TypeInfo info;
      type_info(m.type, &info);
      const int64_t blocks = m.in / info.block_values;
#ifdef SPECDEC_AMX
      if (on_amx(m)) {
        amx_part(m, rows, blocks, act_bytes, seg - first[i], seg_end - first[i], path);
        seg = seg_end;
        continue;
      }
#endif
      // With several tiles, the first writes a unit's values unpacked into `unpacked`, the others read them there
      // (x8_unpacked_bytes)
      const int64_t unpacked_unit = x8 && tiles > 1 ? specdec::x8_unpacked_bytes(path, m.type) * blocks : 0;
      uint8_t* unpacked = unpacked_unit ? unpack_space(chunk * unpacked_unit) : nullptr;
      const void* tile[MR_WIDE];
      for (int64_t nc = seg; nc < seg_end; nc += chunk) {
        const int64_t nend = std::min(seg_end, nc + chunk);
        for (int64_t t = 0, m0 = 0, r; m0 < rows; ++t, m0 += r) {
          r = x8 ? (rows - m0 + tiles - t - 1) / (tiles - t) : std::min<int64_t>(mr, rows - m0);
          for (int64_t j = 0; j < r; ++j) tile[j] = m.xq + (m0 + j) * act_bytes;
          for (int64_t n = nc - first[i]; n < nend - first[i]; ++n) {
            const uint8_t* w = m.w + n * unit_bytes;
            float* y = m.y + m0 * m.ldy + n * unit;
            if (unpacked_unit)
              specdec::x8_tile_unpacked(r, path, m.type, w, unpacked + (n + first[i] - nc) * unpacked_unit, t == 0,
                                        blocks, tile, y, m.ldy);
            else if (x8)
              specdec::x8_tile(r, path, m.type, w, blocks, tile, y, m.ldy);
            else if (k)
              specdec::k_tile(r, path, m.type, w, blocks, info.block_bytes, tile, y, m.ldy);
            else
              specdec::legacy_tile(r, path, m.type, w, blocks, tile, y, m.ldy);
          }
        }
      }
      seg = seg_end;
    }
  };
  std::atomic<int64_t> next{0};  // the next part not taken yet: a thread that finishes early takes more
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t part = next++; part < parts; part = next++) run_part(bound[part], bound[part + 1]);
  });
}

// The file's rows [out, blocks * file bytes] <-> groups of 8 [out, blocks * interleaved bytes per row], threaded.
void interleave_rows(const uint8_t* w, int64_t type, int64_t out, int64_t blocks, uint8_t* dst, bool inverse) {
  // a block of one row, and of a group of 8 rows
  const int64_t file = block_bytes(type), group = X8_ROWS * block_bytes(x8_of(type));
  at::parallel_for(0, out / X8_ROWS, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* from = w + g * blocks * (inverse ? group : X8_ROWS * file);
      uint8_t* to = dst + g * blocks * (inverse ? X8_ROWS * file : group);
      if (type == Q4_K)
        inverse ? deinterleave_group(from, blocks, to) : interleave_group(from, blocks, to);
      else if (type == Q5_K)
        inverse ? deinterleave_group_q5_k(from, blocks, to) : interleave_group_q5_k(from, blocks, to);
      else if (type == Q6_K)
        inverse ? deinterleave_group_q6_k(from, blocks, to) : interleave_group_q6_k(from, blocks, to);
      else if (type == Q8_0)
        inverse ? deinterleave_group_q8_0(from, blocks, to) : interleave_group_q8_0(from, blocks, to);
      else if (type == Q3_K)
        inverse ? deinterleave_group_q3_k(from, blocks, to) : interleave_group_q3_k(from, blocks, to);
      else if (type == IQ4_XS)
        inverse ? deinterleave_group_iq4_xs(from, blocks, to) : interleave_group_iq4_xs(from, blocks, to);
      else if (type == Q2_K)
        inverse ? deinterleave_group_q2_k(from, blocks, to) : interleave_group_q2_k(from, blocks, to);
      else
        inverse ? deinterleave_group_q4_1(from, blocks, to) : interleave_group_q4_1(from, blocks, to);
    }
  });
}

}  // namespace specdec
