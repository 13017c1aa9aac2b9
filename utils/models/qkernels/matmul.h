// Matrix products against GGUF blocks, as the glue (qkernels.cpp, layer.h) calls them: the paths this build has,
// 8-bit activation quantisation, and one threaded loop over the output rows of one or several weights that read
// the same activations. Defined in matmul.cpp, which calls the tiles (tiles.h); neither needs torch's tensor
// headers, so ninja compiles them beside the glue (measured in benchmarks/RESULTS.md: one 39 s compile became two
// side by side on the Zen 3, then five in the thirty-third pass).
#pragma once

#include <string>

#include "common.h"

namespace specdec {

std::vector<int64_t> available_paths();
int64_t best_path();
std::vector<std::string> path_flags();

// Rows [rows, in] of x (row stride ldx) quantised to 8-bit activation blocks, for the K-quants (`k`) or the
// legacy types, into dst [rows, activation_row_bytes(k, in)]. AVX2 where compiled, else (or `portable`) plain C++:
// the same bytes either way.
void quantize_rows(const float* x, int64_t rows, int64_t in, int64_t ldx, bool k, uint8_t* dst,
                   bool portable = false);

// One weight of a product: its blocks [out, row_bytes], its activations (quantised rows for its format) and where
// its outputs go (y[m * ldy + n] for activation row m and output n).
struct MatRef {
  const uint8_t* w;
  int64_t type, in, out, row_bytes;
  const uint8_t* xq;
  float* y;
  int64_t ldy;
};

// y = x @ w.T for every weight of `mats`, `rows` activation rows, one threaded loop over all their output rows;
// a row's results depend neither on `rows` nor on how the weights are grouped.
void mm_many(const std::vector<MatRef>& mats, int64_t rows, int64_t path);

// The file's K-quant, IQ4_XS, Q4_1 or Q8_0 (`type`) blocks of `out` rows (a multiple of 8), `blocks` a row
// -> Q3_K_X8 and so on (interleaved.h), or back with `inverse`.
void interleave_rows(const uint8_t* w, int64_t type, int64_t out, int64_t blocks, uint8_t* dst, bool inverse);

}  // namespace specdec

namespace {

// Bytes of one quantised activation row of `in` values for weights of K-quant (k) or legacy type.
inline int64_t activation_row_bytes(bool k, int64_t in) {
  return k ? in / QK_K * static_cast<int64_t>(sizeof(BlockQ8K)) : in / QK * static_cast<int64_t>(sizeof(BlockQ8));
}

}  // namespace

using specdec::available_paths;
using specdec::best_path;
using specdec::path_flags;
using specdec::interleave_rows;
using specdec::MatRef;
using specdec::mm_many;
using specdec::quantize_rows;
