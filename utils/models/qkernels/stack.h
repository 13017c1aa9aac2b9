// Every decoder layer of a pass in one op: for each layer attn_in, the new keys and values written into the
// cache's buffers, attention over what the buffers hold, attn_out_mlp. The same functions in the same order as
// utils/models/lean_forward.py's per-layer loop calls them one op at a time, so the bits are the same (tested);
// what goes is the Python between them: per layer a cache update, the attention wrapper's checks and three op
// calls, about 4 ms of a 22 ms drafter step and of a 72 ms target step on the Zen 3 of benchmarks/RESULTS.md.
#pragma once

#include "aten_ops.h"

#include "attention.h"
#include "layer.h"

namespace {

constexpr int64_t STACK_WEIGHTS = 7;  // q, k, v, o, gate, up, down: the order FusedLayer gathers them in

// x [1, kv heads, rows, dim] (attn_in's, contiguous) into positions [start, start + rows) of a cache buffer
// [1, kv heads, capacity, dim] (rows contiguous in dim): a copy per row, without a torch call.
void write_rows(const at::Tensor& x, const at::Tensor& room, int64_t start) {
  const int64_t heads = x.size(1), rows = x.size(2), dim = x.size(3);
  TORCH_CHECK(x.is_contiguous() && room.size(1) == heads && room.size(3) == dim && room.stride(3) == 1 &&
                  room.scalar_type() == at::kFloat,
              "decoder_stack: a cache buffer of float32 rows of ", dim);
  const int64_t head_stride = room.stride(1), row_stride = room.stride(2);
  const float* from = x.data_ptr<float>();
  float* to = room.data_ptr<float>();
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(to + h * head_stride + (start + r) * row_stride, from + (h * rows + r) * dim, dim * sizeof(float));
}

// hidden [1, rows, width]; cos, sin [1, rows, dim]; weights, types, biases: 7 per layer; norms, eps: 2 per layer
// (input, post-attention). keys, values: per layer the cache's buffer [1, kv heads, capacity, dim] whose first
// `start` positions are held, rows [start, start + rows) written here; empty lists for a pass without a cache.
// keep > 0: the last layer's queries, o projection and MLP only for the last `keep` rows (lean_pass's rule).
at::Tensor decoder_stack(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, at::TensorList weights,
                         at::IntArrayRef types, at::TensorList biases, at::TensorList norms, at::ArrayRef<double> eps,
                         int64_t heads, int64_t kv_heads, at::TensorList keys, at::TensorList values, int64_t start,
                         int64_t keep, double scale) {
  const int64_t layers = static_cast<int64_t>(norms.size()) / 2;
  TORCH_CHECK(layers > 0 && norms.size() == 2 * static_cast<size_t>(layers) && eps.size() == norms.size(),
              "decoder_stack: two norms and epsilons per layer");
  TORCH_CHECK(weights.size() == STACK_WEIGHTS * static_cast<size_t>(layers) && types.size() == weights.size() &&
                  biases.size() == weights.size(),
              "decoder_stack: seven weights, types and biases per layer");
  const bool cached = !keys.empty();
  TORCH_CHECK(!cached || (keys.size() == static_cast<size_t>(layers) && values.size() == keys.size()),
              "decoder_stack: one key and one value buffer per layer, or none");
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1, "decoder_stack: one sequence [1, rows, width]");
  const int64_t rows = hidden.size(1);
  TORCH_CHECK(keep >= 0 && keep <= rows, "decoder_stack: keep ", keep, " of ", rows, " rows");
  TORCH_CHECK(start >= 0, "decoder_stack: start ", start, " is negative");  // write_rows writes from it
  at::Tensor h = hidden;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t w = STACK_WEIGHTS * l;
    auto [q, k, v] = attn_in(h, norms[2 * l], eps[2 * l], weights.slice(w, 3), types.slice(w, 3), biases.slice(w, 3),
                             cos, sin, heads, kv_heads);  // [1, heads or kv heads, rows, dim]
    if (cached) {
      const at::Tensor& room_k = keys[l];
      const at::Tensor& room_v = values[l];
      TORCH_CHECK(room_k.dim() == 4 && room_k.size(0) == 1 && room_k.size(2) >= start + rows &&
                      room_v.sizes() == room_k.sizes(),
                  "decoder_stack: layer ", l, "'s buffers hold fewer than ", start + rows, " positions");
      write_rows(k, room_k, start);
      write_rows(v, room_v, start);
      k = room_k.narrow(2, 0, start + rows);
      v = room_v.narrow(2, 0, start + rows);
    }
    if (l == layers - 1 && keep > 0 && keep < rows) {
      q = q.narrow(2, rows - keep, keep);
      h = h.narrow(1, rows - keep, keep).contiguous();
    }
    const at::Tensor out = attention_rows(q, k, v, scale);  // [1, rows or keep, heads, dim]
    h = attn_out_mlp(h, out, weights.slice(w + 3, 4), types.slice(w + 3, 4), biases.slice(w + 3, 4),
                     norms[2 * l + 1], eps[2 * l + 1]);
  }
  return h;
}

}  // namespace
