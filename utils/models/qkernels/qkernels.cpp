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

#include "common.h"
#include "kquants.h"
#include "legacy.h"

namespace {

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
