// Integer matrix kernels for GGUF blocks on CPU: y = x @ w.T with w kept as the file's own blocks.
//
// Activations are quantised once per row to 8 bits, q = round(x / d) with d = max|x| / 127, as llama.cpp does:
// in blocks of 32 for the legacy types (`quantize_q8`: a weight block of 32 is unsigned integers u with
// w = a * u + b, its dot product an exact integer sum, floats once per block), in blocks of 256 with sums per 16
// for the K-quants (`quantize_q8k`: the sub-block scales apply in integer arithmetic, floats once per
// super-block, the minimums folded in from the activation sums).
//
// Four paths compute the same numbers, bit for bit: a portable one (plain C++), AVX2 (maddubs + madd), and
// AVX-VNNI (dpbusd, 256-bit, legacy types) where the compiler targets it, and AVX-512 VNNI (tiles of up to 8 rows;
// the K-quants' wide tiles take two 32-value steps per 512-bit instruction, avx512.h). Each float operation is defined per
// lane: lane l of a block holds the integer sum of its bytes 4l..4l+3 (what both madd and dpbusd produce), is
// widened to float and fused-multiply-added into accumulator lane l (the K-quants' offsets too, per lane); the 8
// lanes are summed in one fixed order at the end. The portable path mirrors that with std::fma, and the file is
// compiled with -ffp-contract=off so no compiler fuses anything on its own. Consequences: a row's result does
// not depend on how many rows share its call (batch invariance, which greedy speculative decoding needs), nor on
// which path ran it.
//
// The K-quants, IQ4_XS, Q4_1 and Q8_0 can also run from layouts of ours with 8 rows interleaved (Q3_K_X8 and so
// on, interleaved.h; converted once when a model is prepared): their rows' results are the same on every path
// and width, but not the same bits as the file layout's.
//
// Files: common.h (types, layouts, float16), legacy.h, kquants.h and interleaved.h (the tiles of each path), matmul.h
// (quantisation, one threaded loop over one or several weights), layer.h (a decoder layer's two fused halves),
// attention.h (causal attention row by row), stack.h (every layer of a pass in one op), embedding.h (looked-up
// rows of an embedding table decoded), requantize.h (a drafter's weights re-quantised to Q4_1 when prepared).
// Layouts from ggml-common.h / ggml-quants.c (facts, not code): see the `walk_*` and `k_values` functions.

#include "attention.h"
#include "embedding.h"
#include "layer.h"
#include "matmul.h"
#include "requantize.h"
#include "stack.h"

namespace {

// -- ops -------------------------------------------------------------------------------------------------------

at::Tensor quantize(const at::Tensor& x, bool k, int64_t path) {
  const char* name = k ? "quantize_q8k" : "quantize_q8";
  const int block = k ? QK_K : QK;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, ": expected a 2-D float32 tensor");
  TORCH_CHECK(x.size(1) % block == 0, name, ": the row length must be a multiple of ", block, ", got ", x.size(1));
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({xc.size(0), activation_row_bytes(k, xc.size(1))}, x.options().dtype(at::kByte));
  quantize_rows(xc.data_ptr<float>(), xc.size(0), xc.size(1), xc.size(1), k, out.data_ptr<uint8_t>(),
                path == PORTABLE);
  return out;
}

// path: PORTABLE quantises in plain C++ (tests: the same bytes as the vector form), any other the build's best
at::Tensor quantize_q8(const at::Tensor& x, int64_t path) { return quantize(x, false, path); }
at::Tensor quantize_q8k(const at::Tensor& x, int64_t path) { return quantize(x, true, path); }

at::Tensor gguf_mm(const at::Tensor& xq, const at::Tensor& w, int64_t type, int64_t in_features, int64_t path) {
  TypeInfo info;
  TORCH_CHECK(type_info(type, &info), "gguf_mm: no kernel for GGML type ", type);
  const bool k = is_k_quant(type);
  TORCH_CHECK(in_features % info.block_values == 0, "gguf_mm: in_features ", in_features,
              " is not a multiple of the type's block of ", info.block_values);
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kByte && xq.is_contiguous() &&
                  xq.size(1) == activation_row_bytes(k, in_features),
              "gguf_mm: activations must come from ", k ? "quantize_q8k" : "quantize_q8", " over rows of ",
              in_features);
  const std::vector<int64_t> paths = available_paths();
  if (path < 0) path = best_path();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "gguf_mm: path ", path,
              " is not compiled in for this CPU");
  at::Tensor y = at::empty({xq.size(0), w.size(0)}, xq.options().dtype(at::kFloat));
  mm_many({mat_ref(w, type, in_features, xq.data_ptr<uint8_t>(), y.data_ptr<float>(), w.size(0))}, xq.size(0), path);
  return y;
}

// The file's K-quant, IQ4_XS, Q4_1 or Q8_0 blocks [out, row bytes] (`type`: the file's type) ->
// groups of 8 rows (interleaved.h), [out, in / 256 * 114] for Q3_K, 148 for Q4_K, 180 for Q5_K, 138 for IQ4_XS
// and the same shape for the others; or back (`inverse`).
at::Tensor interleave_any(const at::Tensor& w, int64_t type, bool inverse) {
  const char* name = inverse ? "deinterleave" : "interleave";
  TORCH_CHECK(is_x8(x8_of(type)), name,
              ": Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), Q6_K (14), IQ4_XS (23), Q4_1 (3) or Q8_0 (8) only, ",
              "not type ", type);
  // bytes a block of a row (Q3_K, Q4_K and Q5_K keep their scales decoded, 4 bytes more, IQ4_XS 2)
  const int64_t file = block_bytes(type), grouped = block_bytes(x8_of(type));
  const int64_t from = inverse ? grouped : file, to = inverse ? file : grouped;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) % from == 0 && w.size(0) % 8 == 0, name,
              ": expected uint8 blocks [8k, n * ", from, "]");
  const at::Tensor wc = w.contiguous();
  const int64_t blocks = wc.size(1) / from;
  at::Tensor out = at::empty({wc.size(0), blocks * to}, wc.options());
  interleave_rows(wc.data_ptr<uint8_t>(), type, wc.size(0), blocks, out.data_ptr<uint8_t>(), inverse);
  return out;
}

at::Tensor interleave_op(const at::Tensor& w, int64_t type) { return interleave_any(w, type, false); }
at::Tensor deinterleave_op(const at::Tensor& w, int64_t type) { return interleave_any(w, type, true); }

// Rows `ids` (any shape, int64) of an embedding table kept as the file's blocks [vocab, cols / block * bytes] ->
// float32 [ids.numel(), cols] (embedding.h).
at::Tensor embedding_rows(const at::Tensor& table, int64_t type, int64_t cols, const at::Tensor& ids) {
  TypeInfo info;
  TORCH_CHECK(has_row_decoder(type) && type_info(type, &info), "embedding_rows: no decoder for GGML type ", type);
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kByte && cols > 0 && cols % info.block_values == 0 &&
                  table.size(1) == cols / info.block_values * info.block_bytes,
              "embedding_rows: expected uint8 rows of ", cols, " values in blocks of ", info.block_values);
  TORCH_CHECK(ids.scalar_type() == at::kLong, "embedding_rows: ids must be int64");
  // rows read where they lie (a row's bytes contiguous): a copy of the table would be tens of MB a lookup
  TORCH_CHECK(table.stride(1) == 1 || table.size(1) <= 1, "embedding_rows: each row's bytes must be contiguous");
  const at::Tensor flat = ids.reshape({-1}).contiguous();
  const int64_t n = flat.size(0), vocab = table.size(0);
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(id[r] >= 0 && id[r] < vocab, "embedding_rows: index ", id[r], " is out of range for ", vocab, " rows");
  at::Tensor out = at::empty({n, cols}, table.options().dtype(at::kFloat));
  decode_rows(type, table.data_ptr<uint8_t>(), table.stride(0), cols, id, n, out.data_ptr<float>());
  return out;
}

// A weight kept as the file's blocks [out, cols / block * bytes] -> the same values re-quantised to Q4_1 blocks
// [out, cols / 32 * 20] (requantize.h).
at::Tensor requantize_q4_1(const at::Tensor& blocks, int64_t type, int64_t cols) {
  TypeInfo info;
  TORCH_CHECK(has_row_decoder(type) && type_info(type, &info), "requantize_q4_1: no decoder for GGML type ", type);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && cols > 0 && cols % info.block_values == 0 &&
                  cols % QK == 0 && blocks.size(1) == cols / info.block_values * info.block_bytes,
              "requantize_q4_1: expected uint8 rows of ", cols, " values in blocks of ", info.block_values);
  const at::Tensor w = blocks.contiguous();
  at::Tensor out = at::empty({w.size(0), cols / QK * Q4_1_BLOCK_BYTES}, w.options());
  requantize_rows_q4_1(type, w.data_ptr<uint8_t>(), w.size(1), w.size(0), cols, out.data_ptr<uint8_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("quantize_q8(Tensor x, int path=-1) -> Tensor");
  m.def("quantize_q8k(Tensor x, int path=-1) -> Tensor");
  m.def("gguf_mm(Tensor xq, Tensor w, int type, int in_features, int path=-1) -> Tensor");
  m.def("paths() -> int[]", &available_paths);
  m.def("path_flags() -> str[]", &path_flags);
  m.def("interleave(Tensor w, int type) -> Tensor");
  m.def("deinterleave(Tensor w, int type) -> Tensor");
  m.def("embedding_rows(Tensor table, int type, int cols, Tensor ids) -> Tensor");
  m.def("requantize_q4_1(Tensor blocks, int type, int cols) -> Tensor");
  m.def("attn_in(Tensor hidden, Tensor norm, float eps, Tensor[] weights, int[] types, Tensor[] biases, Tensor cos, "
        "Tensor sin, int heads, int kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("attn_out_mlp(Tensor hidden, Tensor attn, Tensor[] weights, int[] types, Tensor[] biases, Tensor norm, "
        "float eps) -> Tensor");
  m.def("attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("attention_portable(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("decoder_stack(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] types, Tensor[] biases, "
        "Tensor[] norms, float[] eps, int heads, int kv_heads, Tensor(a!)[] keys, Tensor(b!)[] values, int start, "
        "int keep, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("quantize_q8", &quantize_q8);
  m.impl("quantize_q8k", &quantize_q8k);
  m.impl("gguf_mm", &gguf_mm);
  m.impl("interleave", &interleave_op);
  m.impl("deinterleave", &deinterleave_op);
  m.impl("embedding_rows", &embedding_rows);
  m.impl("requantize_q4_1", &requantize_q4_1);
  m.impl("attn_in", &attn_in);
  m.impl("attn_out_mlp", &attn_out_mlp);
  m.impl("attention", &attention_rows);
  m.impl("attention_portable", &attention_portable);
  m.impl("decoder_stack", &decoder_stack);
}
