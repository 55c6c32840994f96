// Wire tensors of random FP32 values for server tests (finite, in [-1, 1], so
// a valid request also computes through Forward).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "attnserve/v1/attention.pb.h"

namespace attnserve {

inline void SetRandomTensor(v1::Tensor* t, const std::vector<int64_t>& shape, std::mt19937* rng) {
  t->set_dtype(v1::FP32);
  t->clear_shape();
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(n));
  for (float& v : values) v = dist(*rng);
  t->mutable_data()->assign(reinterpret_cast<const char*>(values.data()), values.size() * 4);
}

}  // namespace attnserve
