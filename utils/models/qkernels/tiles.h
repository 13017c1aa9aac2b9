// The tiles as mm_many (matmul.cpp) calls them, one call per tile: defined in tiles_k.cpp (K-quants and IQ types in
// the file's layout), tiles_legacy.cpp (the legacy types) and tiles_x8.cpp (the interleaved layouts). Separate
// translation units so that ninja compiles them side by side: the first start's build waits for the longest
// compile instead of their sum (benchmarks/RESULTS.md, thirty-third pass). A call per tile costs nothing
// measurable: a tile covers at least a weight row.
#pragma once

#include "common.h"

namespace specdec {

// Activation rows per tile on a path: 8 on every vector path, 4 in portable C++. With AVX2's 16 registers the
// rows' float accumulators of an 8-row tile spill, but the weights are unpacked half as often: on the Zen 3 of
// benchmarks/RESULTS.md, weights in L3, 8 and 16 rows took 5-9% less time than in tiles of 4, 4 rows the same
// (AVX-VNNI without AVX-512, also 16 registers, was not measured).
inline int64_t tile_rows(int64_t path) { return path == PORTABLE ? MR : MR_WIDE; }
// The same for the interleaved layouts of `type` (tiles_x8.cpp).
int64_t x8_tile_rows(int64_t path, int64_t type);

// A tile of `rows` (1..tile_rows(path)) activation rows against one weight row of the file's layout: a K-quant or
// IQ type's `supers` blocks of `bytes` (activations: BlockQ8K rows), or a legacy type's `blocks32` blocks (BlockQ8
// rows), into y[m * ldy] for activation row m.
void k_tile(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t supers, int64_t bytes,
            const void* const* x, float* y, int64_t ldy);
void legacy_tile(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t blocks32, const void* const* x,
                 float* y, int64_t ldy);

// A tile of `rows` (1..x8_tile_rows(path, type)) activation rows against one group of 8 interleaved rows of `type` (an X8
// type of common.h), into y[m * ldy + l] for activation row m and output row l of the group.
void x8_tile(int64_t rows, int64_t path, int64_t type, const uint8_t* w, int64_t blocks, const void* const* x,
             float* y, int64_t ldy);

// The bytes a block of 8 interleaved rows of `type` takes unpacked for `path`'s tiles (0: they read the layout
// only). x8_tile_unpacked is x8_tile (the same bits) that writes the `blocks` blocks' values to `unpacked` as well
// (`write`), or reads them from there, written by an earlier call on the same weights.
int64_t x8_unpacked_bytes(int64_t path, int64_t type);
void x8_tile_unpacked(int64_t rows, int64_t path, int64_t type, const uint8_t* w, uint8_t* unpacked, bool write,
                      int64_t blocks, const void* const* x, float* y, int64_t ldy);

}  // namespace specdec
