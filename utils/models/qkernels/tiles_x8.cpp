// The tiles of the interleaved layouts (interleaved.h, avx512.h), a group of 8 weight rows at a time, and their
// dispatch per path: tiles.h's x8_tile. A translation unit of its own so that ninja compiles it beside the others.

#include "tiles.h"

#include "avx512.h"
#include "interleaved.h"

namespace {

// A tile of `rows` (1..x8_tile_rows(path, type)) activation rows against one group of 8 interleaved rows (common.h's
// X8 types). AVX-512 runs its own tiles (avx512.h) but Q4_K's and Q5_K's at one row, where the weights' memory
// bounds both and the AVX2 tile measured 0.9-1.0x the time (nineteenth pass, Zen 5: Q4_K); VNNI the AVX2 tiles with
// dpbusd (Q6_K's, Q3_K's and Q2_K's plain AVX2 tiles: a dpbusd one for Q6_K, 8 multiplies a group of 16 values and row
// against 10 instructions, is not built), AVX2 the AVX2 tiles. Every tile gives the same bits.
template <int R = MR_WIDE>
void run_x8_rows(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t blocks, const void* const* x,
                 float* y, int64_t ldy) {
  if constexpr (R > 1) {
    if (rows < R) return run_x8_rows<R - 1>(rows, path, type, w, blocks, x, y, ldy);
  }
  const auto xk = reinterpret_cast<const BlockQ8K* const*>(x);
  const auto x8 = reinterpret_cast<const BlockQ8* const*>(x);
  const bool five = type == Q5_K_X8;
#ifdef SPECDEC_AVX512
  if (path == AVX512 && type == Q4_1_X8) return tile_x8_q4_1_avx512<R>(w, blocks, x8, y, ldy);
  if (path == AVX512 && type == Q8_0_X8) return tile_x8_q8_0_avx512<R>(w, blocks, x8, y, ldy);
  if (path == AVX512 && type == Q6_K_X8) return tile_x8_q6_k_avx512<R>(w, blocks, xk, y, ldy);
  if (path == AVX512 && type == Q3_K_X8) return tile_x8_small_avx512<R, Q3x8Avx512>(w, blocks, xk, y, ldy);
  if (path == AVX512 && type == Q2_K_X8) return tile_x8_small_avx512<R, Q2x8Avx512>(w, blocks, xk, y, ldy);
  if (path == AVX512 && type == IQ4_XS_X8) return tile_x8_iq4_xs_avx512<R>(w, blocks, xk, y, ldy);
  if (path == AVX512 && R > 1)
    return five ? tile_x8_avx512<R, true>(w, blocks, xk, y, ldy) : tile_x8_avx512<R>(w, blocks, xk, y, ldy);
#endif
  if constexpr (R > MR_X8) {
#ifdef SPECDEC_AVX2
    if constexpr (R == MR_X8_FIVE) {
      if (path == AVX2 && type == Q4_K_X8) return tile_x8_avx2<R>(w, blocks, xk, y, ldy);
      if (path == AVX2 && type == Q4_1_X8) return tile_x8_q4_1_avx2<R>(w, blocks, x8, y, ldy);
    }
#endif
    std::abort();  // wider tiles are AVX-512's, and AVX2's Q4_K_X8 and Q4_1_X8 (x8_tile_rows)
  } else {
#ifdef SPECDEC_AVX2
    if (path != PORTABLE && type == Q6_K_X8) return tile_x8_q6_k_avx2<R>(w, blocks, xk, y, ldy);  // VNNI too
    if (path != PORTABLE && type == Q3_K_X8) return tile_x8_small_avx2<R, Q3x8Avx2>(w, blocks, xk, y, ldy);  // VNNI too
    if (path != PORTABLE && type == Q2_K_X8) return tile_x8_small_avx2<R, Q2x8Avx2>(w, blocks, xk, y, ldy);  // VNNI too
#endif
#ifdef SPECDEC_VNNI
    if (path == VNNI && type == Q8_0_X8) return tile_x8_q8_0_avx2<R, true>(w, blocks, x8, y, ldy);
    if (path == VNNI && type == IQ4_XS_X8) return tile_x8_iq4_xs_avx2<R, true>(w, blocks, xk, y, ldy);
#endif
#ifdef SPECDEC_AVX2
    if (path != PORTABLE && type == Q8_0_X8) return tile_x8_q8_0_avx2<R>(w, blocks, x8, y, ldy);
    if (path != PORTABLE && type == IQ4_XS_X8) return tile_x8_iq4_xs_avx2<R>(w, blocks, xk, y, ldy);
#endif
#ifdef SPECDEC_VNNI
    if (path == VNNI)
      return type == Q4_K_X8 ? tile_x8_avx2<R, true>(w, blocks, xk, y, ldy)
             : five          ? tile_x8_avx2<R, true, true>(w, blocks, xk, y, ldy)
                             : tile_x8_q4_1_avx2<R, true>(w, blocks, x8, y, ldy);
#endif
#ifdef SPECDEC_AVX2
    if (path != PORTABLE)
      return type == Q4_K_X8 ? tile_x8_avx2<R>(w, blocks, xk, y, ldy)
             : five          ? tile_x8_avx2<R, false, true>(w, blocks, xk, y, ldy)
                             : tile_x8_q4_1_avx2<R>(w, blocks, x8, y, ldy);
#endif
    if (type == Q4_K_X8)
      tile_x8_portable<R>(w, blocks, xk, y, ldy);
    else if (five)
      tile_x8_portable<R, true>(w, blocks, xk, y, ldy);
    else if (type == Q6_K_X8)
      tile_x8_k16_portable<R, X8_Q6K_BYTES, 32, q6x8_value>(w, blocks, xk, y, ldy);
    else if (type == Q8_0_X8)
      tile_x8_q8_0_portable<R>(w, blocks, x8, y, ldy);
    else if (type == Q3_K_X8)
      tile_x8_k16_portable<R, X8_Q3K_BYTES, 4, q3x8_value>(w, blocks, xk, y, ldy);
    else if (type == IQ4_XS_X8)
      tile_x8_iq4_xs_portable<R>(w, blocks, xk, y, ldy);
    else if (type == Q2_K_X8)
      tile_x8_q2_k_portable<R>(w, blocks, xk, y, ldy);
    else
      tile_x8_q4_1_portable<R>(w, blocks, x8, y, ldy);
  }
}

#ifdef SPECDEC_AVX2
template <int R = MR_WIDE>
void run_x8_unpacked_rows(int64_t rows, int64_t path, int64_t type, const uint8_t* w, uint8_t* unpacked, bool write,
                          int64_t blocks, const void* const* x, float* y, int64_t ldy) {
  if constexpr (R > 1) {
    if (rows < R) return run_x8_unpacked_rows<R - 1>(rows, path, type, w, unpacked, write, blocks, x, y, ldy);
  }
  if (type != Q6_K_X8) std::abort();  // x8_unpacked_bytes says which types unpack
  const auto xk = reinterpret_cast<const BlockQ8K* const*>(x);
#ifdef SPECDEC_AVX512
  if (path == AVX512)
    return write ? tile_x8_q6_k_avx512<R, Unpack::write>(w, blocks, xk, y, ldy, unpacked)
                 : tile_x8_q6_k_avx512<R, Unpack::read>(w, blocks, xk, y, ldy, unpacked);
#endif
  if constexpr (R <= MR_X8) {
    return write ? tile_x8_q6_k_avx2<R, Unpack::write>(w, blocks, xk, y, ldy, unpacked)
                 : tile_x8_q6_k_avx2<R, Unpack::read>(w, blocks, xk, y, ldy, unpacked);
  }
  std::abort();  // AVX2's and VNNI's tiles take at most MR_X8 rows (x8_tile_rows)
}
#endif

}  // namespace

namespace specdec {

// Q6_K_X8's tiles on every vector path: AVX2's, which the VNNI path shares (interleaved.h), and AVX-512's. On an
// Intel host (benchmarks/RESULTS.md) unpacking once took 0.78x the time of unpacking in every tile at 60 rows on
// the AVX2/VNNI tiles (thirty-seventh pass), 0.89-0.91x on AVX-512's (thirty-eighth), 0.95x at 9 rows.
int64_t x8_unpacked_bytes(int64_t path, int64_t type) {
#ifdef SPECDEC_AVX2
  if ((path == AVX2 || path == VNNI) && type == Q6_K_X8) return X8_UNPACKED_BYTES;
#endif
#ifdef SPECDEC_AVX512
  if (path == AVX512 && type == Q6_K_X8) return X8_UNPACKED_BYTES;
#endif
  return 0;
}

void x8_tile_unpacked(int64_t rows, int64_t path, int64_t type, const uint8_t* w, uint8_t* unpacked, bool write,
                      int64_t blocks, const void* const* x, float* y, int64_t ldy) {
#ifdef SPECDEC_AVX2
  return run_x8_unpacked_rows(rows, path, type, w, unpacked, write, blocks, x, y, ldy);
#endif
  std::abort();
}

// Activation rows per tile of the interleaved types: AVX-512's 32 registers hold the sums of 8 rows, AVX2's 16 those
// of 4, or 5 for Q4_K_X8 and Q4_1_X8 (interleaved.h's MR_X8_FIVE; the VNNI path's dpbusd tiles keep 4: no machine
// with AVX-VNNI and without AVX-512 was at hand to measure 5 on).
int64_t x8_tile_rows(int64_t path, int64_t type) {
  if (path == AVX512) return MR_WIDE;
  return path == AVX2 && (type == Q4_K_X8 || type == Q4_1_X8) ? MR_X8_FIVE : MR_X8;
}

void x8_tile(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t blocks, const void* const* x,
             float* y, int64_t ldy) {
  run_x8_rows(rows, path, type, w, blocks, x, y, ldy);
}

}  // namespace specdec
