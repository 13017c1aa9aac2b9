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

#include "aten_ops.h"

#include <limits>

#include "common.h"

namespace {

constexpr int64_t MAX_GROUP = 64;  // query heads sharing a kv head (grouped-query attention): 6-7 in Qwen2.5

// One item: query row i of a sequence against one kv head, for the `group` query heads that share it (its keys
// and values read once for them). q[g]: the query rows; kb, vb: the head's keys and values, `ks` and `vs` floats
// apart; p: scratch of group * n floats, acc: of group * dim; out[g]: where query head g's output row goes.
struct Item {
  const float* const* q;
  const float *kb, *vb;
  int64_t ks, vs, seen, dim, group, n;
  float s;
  float *p, *acc, *m, *l;
  float* const* out;
};

// The rule in plain C++, the reference every path matches bit for bit.
inline void attend_portable(const Item& t) {
  for (int64_t g = 0; g < t.group; ++g) t.m[g] = -std::numeric_limits<float>::infinity(), t.l[g] = 0.0f;
  for (int64_t j = 0; j < t.seen; ++j)
    for (int64_t g = 0; g < t.group; ++g) {
      const float score = dot_lanes(t.q[g], t.kb + j * t.ks, t.dim) * t.s;
      t.p[g * t.n + j] = score;
      t.m[g] = std::max(t.m[g], score);
    }
  for (int64_t g = 0; g < t.group; ++g)
    for (int64_t j = 0; j < t.seen; ++j) {
      const float e = std::exp(t.p[g * t.n + j] - t.m[g]);
      t.p[g * t.n + j] = e;
      t.l[g] += e;
    }
  std::fill(t.acc, t.acc + t.group * t.dim, 0.0f);
  for (int64_t j = 0; j < t.seen; ++j)
    for (int64_t g = 0; g < t.group; ++g) {
      const float w = t.p[g * t.n + j];
      const float* vj = t.vb + j * t.vs;
      float* a = t.acc + g * t.dim;
      for (int64_t d = 0; d < t.dim; ++d) a[d] += w * vj[d];
    }
  for (int64_t g = 0; g < t.group; ++g)
    for (int64_t d = 0; d < t.dim; ++d) t.out[g][d] = t.acc[g * t.dim + d] / t.l[g];
}

using AttendFn = void (*)(const Item&);

#ifdef SPECDEC_AVX2
constexpr int64_t KEY_BLOCK = 16;  // keys whose values (16 * dim floats) stay in L1 while every head sums them

// The same operations per output value, in the same order, as attend_portable, for G query heads (a compile-time
// count, so their accumulators stay in registers) and dim a multiple of 64:
// - scores: the G dot products of a key side by side, lane l summing the products of values l mod 8 and hsum
//   adding the lanes in lane_sum's order, so each equals dot_lanes; their chains of additions overlap, where
//   one dot alone waits on its own chain;
// - weighted values: value d of head g still sums w_j * v_j[d] over j = 0, 1, ..., but 64 values of one head at
//   a time in registers over a block of keys, where the loop above loads and stores each of them for every key.
// exp stays std::exp. On the Zen 3 of benchmarks/RESULTS.md (two threads, per layer of the 1.5B, old -> this):
// 1 row over 200 keys 66-75 -> 32-37 us, over 1500 keys 426-430 -> 180-190 us, a 4-row verification over 200
// keys 233-242 -> 103-109 us, a 60-row cache-off pass 744 -> 329-342 us; the 0.5B's 1 row over 200 keys 52-60 ->
// 25-33 us. What is left is mostly std::exp (one call per score).
template <int G>
void attend_avx2(const Item& t) {
  float m[G], l[G];
  for (int g = 0; g < G; ++g) m[g] = -std::numeric_limits<float>::infinity(), l[g] = 0.0f;
  const int64_t dim = t.dim, n = t.n, seen = t.seen;
  for (int64_t j = 0; j < seen; ++j) {
    const float* kj = t.kb + j * t.ks;
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dim; i += 8) {
      const __m256 k = _mm256_loadu_ps(kj + i);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_add_ps(acc[g], _mm256_mul_ps(_mm256_loadu_ps(t.q[g] + i), k));
    }
    for (int g = 0; g < G; ++g) {
      const float score = hsum(acc[g]) * t.s;
      t.p[g * n + j] = score;
      m[g] = std::max(m[g], score);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t j = 0; j < seen; ++j) {
      const float e = std::exp(t.p[g * n + j] - m[g]);
      t.p[g * n + j] = e;
      l[g] += e;
    }
  std::fill(t.acc, t.acc + G * dim, 0.0f);
  for (int64_t j0 = 0; j0 < seen; j0 += KEY_BLOCK) {
    const int64_t j1 = std::min(seen, j0 + KEY_BLOCK);
    for (int g = 0; g < G; ++g)
      for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        float* a = t.acc + g * dim + d0;
        __m256 sum[8];
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) sum[v] = _mm256_loadu_ps(a + 8 * v);
        for (int64_t j = j0; j < j1; ++j) {
          const __m256 w = _mm256_set1_ps(t.p[g * n + j]);
          const float* vj = t.vb + j * t.vs + d0;
#pragma GCC unroll 8
          for (int v = 0; v < 8; ++v) sum[v] = _mm256_add_ps(sum[v], _mm256_mul_ps(w, _mm256_loadu_ps(vj + 8 * v)));
        }
#pragma GCC unroll 8
        for (int v = 0; v < 8; ++v) _mm256_storeu_ps(a + 8 * v, sum[v]);
      }
  }
  for (int g = 0; g < G; ++g) {
    const __m256 lv = _mm256_set1_ps(l[g]);
    for (int64_t d = 0; d < dim; d += 8)
      _mm256_storeu_ps(t.out[g] + d, _mm256_div_ps(_mm256_loadu_ps(t.acc + g * dim + d), lv));
  }
}

// The AVX2 item for this group and dim, or the portable one.
inline AttendFn attend_for(int64_t group, int64_t dim) {
  if (dim % 64 != 0) return attend_portable;
  switch (group) {
    case 1: return attend_avx2<1>;
    case 2: return attend_avx2<2>;
    case 3: return attend_avx2<3>;
    case 4: return attend_avx2<4>;
    case 5: return attend_avx2<5>;
    case 6: return attend_avx2<6>;
    case 7: return attend_avx2<7>;
    case 8: return attend_avx2<8>;
    default: return attend_portable;
  }
}
#else
inline AttendFn attend_for(int64_t, int64_t) { return attend_portable; }
#endif

// q [batch, heads, rows, dim]; k, v [batch, kv heads, n, dim] (n >= rows, the last `rows` keys at the queries'
// positions; any strides with the last dimension contiguous, as a cache hands them out) -> [batch, rows, heads, dim].
// portable: the reference loops even where AVX2 is compiled in (tests).
at::Tensor attention_rows_path(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                               bool portable) {
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
  const AttendFn attend = portable ? attend_portable : attend_for(group, dim);
  at::parallel_for(0, batch * rows * kv_heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> p(group * n), acc(group * dim), m(group), l(group);
    const float* qrow[MAX_GROUP];
    float* orow[MAX_GROUP];
    for (int64_t item = first; item < last; ++item) {
      const int64_t b = item / (rows * kv_heads), i = item / kv_heads % rows, kvh = item % kv_heads;
      for (int64_t g = 0; g < group; ++g) {
        qrow[g] = qp + ((b * heads + kvh * group + g) * rows + i) * dim;
        orow[g] = op + ((b * rows + i) * heads + kvh * group + g) * dim;
      }
      attend({qrow, kp + b * kb_stride + kvh * kh_stride, vp + b * vb_stride + kvh * vh_stride, kj_stride, vj_stride,
              n - rows + i + 1, dim, group, n, s, p.data(), acc.data(), m.data(), l.data(), orow});
    }
  });
  return out;
}

at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  return attention_rows_path(q, k, v, scale, false);
}

at::Tensor attention_portable(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  return attention_rows_path(q, k, v, scale, true);
}

}  // namespace
