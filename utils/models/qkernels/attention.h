// Causal attention query row by query row (utils/models/rowwise_attention.py's rule) in one op, for float32
// activations on CPU: the Python loop of one scaled_dot_product_attention call per query row cost a 60-row
// cache-off pass of the 1.5B 2.5 ms a layer (71 ms of ~700) and a 4-row verification 0.37 ms a layer (10 ms).
//
// Query row i of a pass sees the keys [0, n - rows + i] and is computed alone, in one fixed order: scores
// s_j = dot(q, k_j) * scale (the dot in eight lanes summed as lane_sum does), m = max s_j, p_j = exp(s_j - m)
// summed j = 0, 1, ... into l, out = (sum_j p_j * v_j) / l. So a row's result depends neither on its pass's width
// nor on the threads: a one-token decoding step and the same position inside a verification or a cache-off pass
// give the same bits (batch invariance), as torch's attention called row by row did. Not the same bits as torch's
// kernel (its softmax and sums run in another order).
#pragma once

#include <ATen/ATen.h>

#include <limits>

#include "common.h"

namespace {

constexpr int64_t MAX_GROUP = 64;  // query heads sharing a kv head (grouped-query attention): 6-7 in Qwen2.5

// q [batch, heads, rows, dim]; k, v [batch, kv heads, n, dim] (n >= rows, the last `rows` keys at the queries'
// positions; any strides with the last dimension contiguous, as a cache hands them out) -> [batch, rows, heads, dim].
at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attention: 4-D query, key and value");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attention: float32 tensors");
  const int64_t batch = q.size(0), heads = q.size(1), rows = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k.size(1), n = k.size(2);
  TORCH_CHECK(k.size(0) == batch && v.sizes() == k.sizes() && k.size(3) == dim, "attention: key and value shapes");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && n >= rows, "attention: heads a multiple of kv heads, n >= rows");
  TORCH_CHECK(heads / kv_heads <= MAX_GROUP, "attention: at most ", MAX_GROUP, " query heads per kv head");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "attention: keys and values contiguous in their last dimension");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty({batch, rows, heads, dim}, q.options());
  const int64_t group = heads / kv_heads;
  const float* qp = qc.data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  // strides read once, outside the loops: Tensor::stride is a call into the tensor's implementation
  const int64_t kb_stride = k.stride(0), kh_stride = k.stride(1), kj_stride = k.stride(2);
  const int64_t vb_stride = v.stride(0), vh_stride = v.stride(1), vj_stride = v.stride(2);
  // one item: a row of one sequence against one kv head, for the query heads that share it (read once for them)
  at::parallel_for(0, batch * rows * kv_heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> p(group * n), acc(group * dim), m(group), l(group);
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / (rows * kv_heads), i = item / kv_heads % rows, kvh = item % kv_heads;
      const int64_t seen = n - rows + i + 1;
      const float* kb = kp + b * kb_stride + kvh * kh_stride;
      const float* vb = vp + b * vb_stride + kvh * vh_stride;
      const float* qrow[MAX_GROUP];
      for (int64_t g = 0; g < group; ++g) qrow[g] = qp + ((b * heads + kvh * group + g) * rows + i) * dim;
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      for (int64_t j = 0; j < seen; ++j) {
        const float* kj = kb + j * kj_stride;
        for (int64_t g = 0; g < group; ++g) {
          const float score = dot_lanes(qrow[g], kj, dim) * s;
          p[g * n + j] = score;
          m[g] = std::max(m[g], score);
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < seen; ++j) {
          const float e = std::exp(p[g * n + j] - m[g]);
          p[g * n + j] = e;
          l[g] += e;
        }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < seen; ++j) {
        const float* vj = vb + j * vj_stride;
        for (int64_t g = 0; g < group; ++g) {
          const float w = p[g * n + j];
          float* a = acc.data() + g * dim;
          for (int64_t d = 0; d < dim; ++d) a[d] += w * vj[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* o = op + ((b * rows + i) * heads + kvh * group + g) * dim;
        const float* a = acc.data() + g * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = a[d] / l[g];
      }
    }
  });
  return out;
}

}  // namespace
