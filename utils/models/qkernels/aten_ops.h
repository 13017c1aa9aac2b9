// The ATen pieces the ops use (tensors, empty, empty_like, silu_, parallel_for), instead of <ATen/ATen.h> and its
// declarations of every operator: the first start's compile of qkernels.cpp parses headers for 12 s instead of
// 18 s on the Zen 3 of benchmarks/RESULTS.md (thirty-fourth pass). An op missing here fails the build, not a run.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>

// Elements a thread takes at least in an elementwise loop: torch's own grain (at::internal::GRAIN_SIZE, declared in
// TensorIterator.h, which would bring most of <ATen/ATen.h> back).
constexpr int64_t ELEMENTWISE_GRAIN = 32768;
