// The two halves of a decoder layer (Qwen2, Llama) around attention, for GGUF weights: one op each instead of
// some thirty small torch calls from Python, which cost as much as the layer's integer products at one row.
//
// attn_in:      RMSNorm -> 8-bit activations -> q, k, v products (one threaded loop) -> biases -> rotary embedding
// attn_out_mlp: o product -> residual -> RMSNorm -> gate and up products (one loop) -> silu(gate) * up -> down
//               product -> residual
//
// The arithmetic is transformers' (Qwen2RMSNorm, apply_rotary_pos_emb, SiLU MLP) with one difference: the norm's
// sum of squares runs in eight fixed lanes here. Every step works row by row in one fixed order, so a row's
// result does not depend on the width of its pass (batch invariance, which greedy speculative decoding needs).
#pragma once

#include "aten_ops.h"
#include <torch/library.h>

#include "matmul.h"

namespace {

// One weight of a product from its tensor, checked: what the ops hand to mm_many.
inline MatRef mat_ref(const at::Tensor& w, int64_t type, int64_t in, const uint8_t* xq, float* y, int64_t ldy) {
  TypeInfo info;
  TORCH_CHECK(type_info(type, &info), "gguf_mm: no kernel for GGML type ", type);
  TORCH_CHECK(in > 0 && in % info.block_values == 0, "gguf_mm: in_features ", in,
              " is not a positive multiple of the type's block of ", info.block_values);
  const int64_t row_bytes = in / info.block_values * info.block_bytes;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == row_bytes,
              "gguf_mm: expected weight blocks [out, ", row_bytes, "] uint8, contiguous");
  TORCH_CHECK(w.size(0) % rows_per_unit(type) == 0, "gguf_mm: interleaved weights need a multiple of 8 rows");
  return {w.data_ptr<uint8_t>(), type, in, w.size(0), row_bytes, xq, y, ldy};
}

// transformers' RMSNorm of one row: w * (x * rsqrt(mean(x^2) + eps)).
void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  const float inverse = 1.0f / std::sqrt(dot_lanes(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inverse);
}

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& w, double eps) {  // x [rows, n] contiguous
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(w.numel() == n && w.scalar_type() == at::kFloat && w.is_contiguous(), "norm weight of ", n, " floats");
  at::Tensor out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * n, wp, static_cast<float>(eps), n, op + r * n);
  });
  return out;
}

// One float input [rows, in] quantised once for each activation format its weights read.
struct Quantised {
  at::Tensor k, legacy;
  const uint8_t* rows_for(int64_t type) const {
    return (is_k_quant(type) ? k : legacy).data_ptr<uint8_t>();
  }
};

Quantised quantise_for(const at::Tensor& x, at::IntArrayRef types) {  // x [rows, in] float32, contiguous
  Quantised q;
  const int64_t rows = x.size(0), in = x.size(1);
  for (int64_t type : types) {
    at::Tensor& slot = is_k_quant(type) ? q.k : q.legacy;
    if (slot.defined()) continue;
    const bool k = is_k_quant(type);
    TORCH_CHECK(in % (k ? QK_K : QK) == 0, "fused layer: ", in, " inputs do not fill blocks of ", k ? QK_K : QK);
    slot = at::empty({rows, activation_row_bytes(k, in)}, x.options().dtype(at::kByte));
    quantize_rows(x.data_ptr<float>(), rows, in, in, k, slot.data_ptr<uint8_t>());
  }
  return q;
}

// The products of `x` with the weights w[first..first+count), into the given outputs (each [rows, out], contiguous).
void products(const at::Tensor& x, at::TensorList w, at::IntArrayRef types, int64_t first, int64_t count,
              const std::vector<at::Tensor>& outputs) {
  const at::IntArrayRef mine = types.slice(first, count);
  const Quantised q = quantise_for(x, mine);
  std::vector<MatRef> mats;
  for (int64_t i = 0; i < count; ++i) {
    // mm_many writes a weight's every output row into its output: a weight of other rows than the output's
    // columns wrote past it (or left columns unwritten)
    TORCH_CHECK(outputs[i].size(0) == x.size(0) && outputs[i].size(1) == w[first + i].size(0), "fused layer: weight ",
                first + i, " has ", w[first + i].size(0), " output rows where ", outputs[i].size(1), " are expected");
    mats.push_back(mat_ref(w[first + i], mine[i], x.size(1), q.rows_for(mine[i]), outputs[i].data_ptr<float>(),
                           outputs[i].size(1)));
  }
  mm_many(mats, x.size(0), best_path());
}

// y [rows, out] += bias [out]; no bias: an empty tensor. Loops of ours rather than Tensor::add_ and +: seven
// small torch calls a layer (biases, residuals, cache writes) took ~3% of a one-row drafter op (twenty-fourth
// pass, benchmarks/RESULTS.md). Each value is one float addition either way, the same bits; wide passes share
// the work out from torch's grain, as its element-wise ops did.
void add_bias(at::Tensor& y, const at::Tensor& bias) {
  if (bias.numel() == 0) return;
  const int64_t out = y.size(1), rows = y.size(0);
  TORCH_CHECK(bias.numel() == out && bias.scalar_type() == at::kFloat && y.is_contiguous(), "bias of ", out, " floats");
  const at::Tensor b = bias.contiguous();
  const float* bp = b.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, ELEMENTWISE_GRAIN / out), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t i = 0; i < out; ++i) yp[r * out + i] += bp[i];
  });
}

// a + b of two float tensors of n values each (contiguous), into a new tensor shaped as `shape_of`.
at::Tensor add_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& shape_of) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.numel() == b.numel(), "residual: two equal contiguous rows");
  at::Tensor out = at::empty(shape_of.sizes(), a.options());
  const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, a.numel(), ELEMENTWISE_GRAIN, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) op[i] = ap[i] + bp[i];
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attn_in(const at::Tensor& hidden, const at::Tensor& norm, double eps,
                                                       at::TensorList w, at::IntArrayRef types, at::TensorList bias,
                                                       const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                                                       int64_t kv_heads) {
  TORCH_CHECK(w.size() == 3 && types.size() == 3 && bias.size() == 3, "attn_in: q, k and v weights, types, biases");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat, "attn_in: float32 hidden states");
  const int64_t width = hidden.size(-1), rows = hidden.numel() / width;
  const int64_t dim = cos.size(-1), half = dim / 2;
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim && dim % 2 == 0, "attn_in: cos, sin [rows, dim]");
  const at::Tensor x = rms_norm_rows(hidden.reshape({rows, width}).contiguous(), norm, eps);
  const int64_t outs[3] = {heads * dim, kv_heads * dim, kv_heads * dim};
  std::vector<at::Tensor> y;
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK(w[i].size(0) == outs[i], "attn_in: weight ", i, " has ", w[i].size(0), " rows, expected ", outs[i]);
    y.push_back(at::empty({rows, outs[i]}, hidden.options()));
  }
  products(x, w, types, 0, 3, y);
  for (int i = 0; i < 3; ++i) add_bias(y[i], bias[i]);
  // [rows, heads * dim] -> [1, heads, rows, dim], rotated (q, k) as transformers: x * cos + rotate_half(x) * sin
  const at::Tensor c = cos.reshape({rows, dim}).contiguous(), s = sin.reshape({rows, dim}).contiguous();
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  std::vector<at::Tensor> result;
  for (int i = 0; i < 3; ++i) {
    const int64_t n = outs[i] / dim;
    at::Tensor t = at::empty({1, n, rows, dim}, hidden.options());
    const float* src = y[i].data_ptr<float>();
    float* dst = t.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < n; ++h) {
        const float* a = src + r * outs[i] + h * dim;
        float* b = dst + (h * rows + r) * dim;
        if (i == 2) {
          std::memcpy(b, a, dim * sizeof(float));
          continue;
        }
        const float *cr = cp + r * dim, *sr = sp + r * dim;
        for (int64_t j = 0; j < half; ++j) b[j] = a[j] * cr[j] + (-a[j + half]) * sr[j];
        for (int64_t j = half; j < dim; ++j) b[j] = a[j] * cr[j] + a[j - half] * sr[j];
      }
    result.push_back(t);
  }
  return {result[0], result[1], result[2]};
}

at::Tensor attn_out_mlp(const at::Tensor& hidden, const at::Tensor& attn, at::TensorList w, at::IntArrayRef types,
                        at::TensorList bias, const at::Tensor& norm, double eps) {
  TORCH_CHECK(w.size() == 4 && types.size() == 4 && bias.size() == 4,
              "attn_out_mlp: o, gate, up and down weights, types, biases");
  const int64_t width = hidden.size(-1), rows = hidden.numel() / width, inner = w[1].size(0);
  const at::Tensor a = attn.reshape({rows, attn.numel() / rows}).contiguous();  // [rows, heads * dim]
  at::Tensor o = at::empty({rows, width}, hidden.options());
  products(a, w, types, 0, 1, {o});
  add_bias(o, bias[0]);
  const at::Tensor h = add_rows(hidden.reshape({rows, width}).contiguous(), o, o);  // the stream after attention
  const at::Tensor x = rms_norm_rows(h, norm, eps);
  at::Tensor gate = at::empty({rows, inner}, hidden.options()), up = at::empty({rows, inner}, hidden.options());
  products(x, w, types, 1, 2, {gate, up});
  add_bias(gate, bias[1]);
  add_bias(up, bias[2]);
  at::silu_(gate).mul_(up);  // the kernels transformers' SiLU MLP calls
  at::Tensor down = at::empty({rows, width}, hidden.options());
  products(gate, w, types, 3, 1, {down});
  add_bias(down, bias[3]);
  return add_rows(h, down, hidden);
}

}  // namespace
