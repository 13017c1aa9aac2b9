// The legacy types' tiles (legacy.h: Q4_0 to Q8_0, IQ4_NL), one weight row at a time, and their dispatch per
// path: tiles.h's legacy_tile. A translation unit of its own so that ninja compiles it beside the others.

#include "tiles.h"

#include "legacy.h"

namespace {

template <int R>
void run_tile(int64_t path, int64_t type, const uint8_t* w, int64_t blocks32, const BlockQ8* const* x, float* y,
              int64_t ldy) {
#ifdef SPECDEC_AVX512
  // 256-bit dpbusd, but tiles of up to 8 rows in AVX-512's 32 registers: measured faster than 512-bit steps
  // over pairs of blocks (benchmarks/RESULTS.md)
  if (path == AVX512) return tile_avx2<R, true>(type, w, blocks32, x, y, ldy);
#endif
#ifdef SPECDEC_AVX2
#ifdef SPECDEC_VNNI
  if (path == VNNI) return tile_avx2<R, true>(type, w, blocks32, x, y, ldy);
#endif
  if (path == AVX2) return tile_avx2<R, false>(type, w, blocks32, x, y, ldy);
#endif
  tile_portable<R>(type, w, blocks32, x, y, ldy);
}


// A tile of `rows` (1..MR_WIDE) activation rows against one weight row of a legacy type.
template <int R = MR_WIDE>
void run_legacy_rows(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t blocks32,
                     const BlockQ8* const* x, float* y, int64_t ldy) {
  if constexpr (R > 1) {
    if (rows < R) return run_legacy_rows<R - 1>(rows, path, type, w, blocks32, x, y, ldy);
  }
  run_tile<R>(path, type, w, blocks32, x, y, ldy);
}

}  // namespace

namespace specdec {

void legacy_tile(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t blocks32, const void* const* x,
                 float* y, int64_t ldy) {
  run_legacy_rows(rows, path, type, w, blocks32, reinterpret_cast<const BlockQ8* const*>(x), y, ldy);
}

}  // namespace specdec
