// The K-quant and IQ tiles of the file's layout (kquants.h, avx512.h), one weight row at a time, and their dispatch
// per path: tiles.h's k_tile. A translation unit of its own so that ninja compiles it beside the others.

#include "tiles.h"

#include "avx512.h"
#include "kquants.h"

namespace {

template <int R>
void run_k_tile(int64_t path, int64_t type, const uint8_t* w, int64_t supers, int64_t bytes, const BlockQ8K* const* x,
                float* y, int64_t ldy) {
#ifdef SPECDEC_AVX512
  // 512-bit steps at every width: with the weights prefetched, as fast as the AVX2 tile at 1-3 rows, faster from
  // 4 (benchmarks/RESULTS.md)
  // (the IQ grid types: their grid lookups are AVX2's, 256 bits at a time, on every vector path)
  if (path == AVX512 && !is_grid_type(type)) return tile_k_avx512<R>(type, w, supers, bytes, x, y, ldy);
#endif
#ifdef SPECDEC_AVX2
  if (path != PORTABLE) return tile_k_avx2<R>(type, w, supers, bytes, x, y, ldy);  // VNNI adds nothing here
#endif
  tile_k_portable<R>(type, w, supers, bytes, x, y, ldy);
}


// A tile of `rows` (1..MR_WIDE) activation rows against one weight row of a K-quant.
template <int R = MR_WIDE>
void run_k_rows(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t supers, int64_t bytes,
                const BlockQ8K* const* x, float* y, int64_t ldy) {
  if constexpr (R > 1) {
    if (rows < R) return run_k_rows<R - 1>(rows, path, type, w, supers, bytes, x, y, ldy);
  }
  run_k_tile<R>(path, type, w, supers, bytes, x, y, ldy);
}

#ifdef SPECDEC_AVX2
// An IQ grid type's rows on a vector path at a width without a tile of its own (`grid_tile_width`): the next
// wider tile, its extra rows reading the first row's activations, into a scratch output. Each row's result is the
// same bits (a row's accumulator sees only its own activations), at the cost of the extra rows' products.
void padded_grid_tile(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t supers, int64_t bytes,
                      const BlockQ8K* const* x, float* y, int64_t ldy) {
  const int64_t wide = rows <= 4 ? 4 : MR_WIDE;
  const BlockQ8K* padded[MR_WIDE];
  for (int64_t m = 0; m < wide; ++m) padded[m] = x[m < rows ? m : 0];
  float out[MR_WIDE];
  run_k_rows(wide, path, type, w, supers, bytes, padded, out, 1);
  for (int64_t m = 0; m < rows; ++m) y[m * ldy] = out[m];
}
#endif

}  // namespace

namespace specdec {

void k_tile(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t supers, int64_t bytes,
            const void* const* x, float* y, int64_t ldy) {
  const auto* rows_x = reinterpret_cast<const BlockQ8K* const*>(x);
#ifdef SPECDEC_AVX2
  if (path != PORTABLE && is_grid_type(type) && !grid_tile_width(rows))
    return padded_grid_tile(rows, path, type, w, supers, bytes, rows_x, y, ldy);
#endif
  run_k_rows(rows, path, type, w, supers, bytes, rows_x, y, ldy);
}

}  // namespace specdec
