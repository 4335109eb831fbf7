// fused_layer_norm(x, gamma, beta, eps): LayerNorm over the last axis of a
// float32 array, forward and backward each one pass over a row's values with
// the row's mean and reciprocal deviation recomputed in the backward (nothing
// kept between the passes). A custom operator for MXNet 1.9.1's library API
// (third_party/lib_api.cc, the wheel's mxnet/lib_api.h), built and
// loaded by mp_symbolic/core/kernels/__init__.py.
#include <cmath>
#include <string>
#include <unordered_map>
#include <vector>

#include "mxnet/lib_api.h"
#include "float32_only.h"

using mxnet::ext::MXReturnValue;
using mxnet::ext::MXTensor;
using mxnet::ext::OpResource;
using Attrs = std::unordered_map<std::string, std::string>;

namespace {

// Sums over a row run in kLanes independent partial sums, added together at
// the row's end: the compiler makes each step one vector operation (no
// reordering of the float arithmetic written here is needed for that).
constexpr int64_t kLanes = 16;

float Epsilon(const Attrs& attrs) {
  auto it = attrs.find("eps");
  return it == attrs.end() ? 1e-5f : std::stof(it->second);
}

// rows R and their length C of an array whose last axis is normalised
void RowsOf(const std::vector<int64_t>& shape, int64_t* rows, int64_t* length) {
  *length = shape.back();
  *rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) *rows *= shape[i];
}

float Total(const float* lanes) {
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// a row's mean and reciprocal deviation
void Moments(const float* x, int64_t C, float eps, float* mean, float* rstd) {
  float lanes[kLanes] = {0.f};
  int64_t c = 0;
  for (; c + kLanes <= C; c += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += x[c + l];
  float sum = Total(lanes);
  for (; c < C; ++c) sum += x[c];
  const float m = sum / C;
  float squares_lanes[kLanes] = {0.f};
  c = 0;
  for (; c + kLanes <= C; c += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      const float d = x[c + l] - m;
      squares_lanes[l] += d * d;
    }
  float squares = Total(squares_lanes);
  for (; c < C; ++c) squares += (x[c] - m) * (x[c] - m);
  *mean = m;
  *rstd = 1.f / std::sqrt(squares / C + eps);
}

// One row's share of the backward pass: x's gradient, and the row's terms
// added to the parameters' gradients, in two passes over the row after its
// moments: the first sums dy gamma and dy gamma (x - mean) in lanes and adds
// the parameters' terms, the second writes dx = rstd (dy gamma - mean(dy
// gamma) - h mean(dy gamma h)), h = (x - mean) rstd. No array overlaps
// another (__restrict__), so that the compiler vectorises every loop.
void RowBackward(const float* __restrict__ x, const float* __restrict__ dy,
                 const float* __restrict__ gamma, int64_t C, float eps,
                 float* __restrict__ dx, float* __restrict__ gamma_sum,
                 float* __restrict__ beta_sum) {
  float mean, rstd;
  Moments(x, C, eps, &mean, &rstd);
  float sum_lanes[kLanes] = {0.f}, dot_lanes[kLanes] = {0.f};
  int64_t c = 0;
  for (; c + kLanes <= C; c += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      const float d = x[c + l] - mean, g = dy[c + l];
      const float scaled = g * gamma[c + l];
      sum_lanes[l] += scaled;
      dot_lanes[l] += scaled * d;
      gamma_sum[c + l] += g * (d * rstd);
      beta_sum[c + l] += g;
    }
  float sum = Total(sum_lanes), dot = Total(dot_lanes);
  for (; c < C; ++c) {
    const float d = x[c] - mean, g = dy[c];
    const float scaled = g * gamma[c];
    sum += scaled;
    dot += scaled * d;
    gamma_sum[c] += g * (d * rstd);
    beta_sum[c] += g;
  }
  const float shift = sum / C, slope = dot * rstd / C;
  for (c = 0; c < C; ++c)
    dx[c] = rstd * (dy[c] * gamma[c] - shift - (x[c] - mean) * rstd * slope);
}

}  // namespace

MXReturnValue Forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                      std::vector<MXTensor>* outputs, const OpResource& res) {
  const float* x = inputs->at(0).data<float>();
  const float* gamma = inputs->at(1).data<float>();
  const float* beta = inputs->at(2).data<float>();
  float* y = outputs->at(0).data<float>();
  int64_t R, C;
  RowsOf(inputs->at(0).shape, &R, &C);
  const float eps = Epsilon(attrs);
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * C;
    float* yr = y + r * C;
    float mean, rstd;
    Moments(xr, C, eps, &mean, &rstd);
    for (int64_t c = 0; c < C; ++c) yr[c] = (xr[c] - mean) * rstd * gamma[c] + beta[c];
  }
  return mxnet::ext::MX_SUCCESS;
}

// inputs: the output's gradient, then x, gamma, beta (and the output);
// outputs: the gradients of x, gamma and beta
MXReturnValue Backward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                       std::vector<MXTensor>* outputs, const OpResource& res) {
  const float* dy = inputs->at(0).data<float>();
  const float* x = inputs->at(1).data<float>();
  const float* gamma = inputs->at(2).data<float>();
  float* dx = outputs->at(0).data<float>();
  float* dgamma = outputs->at(1).data<float>();
  float* dbeta = outputs->at(2).data<float>();
  int64_t R, C;
  RowsOf(inputs->at(1).shape, &R, &C);
  const float eps = Epsilon(attrs);
  // the parameters' gradients summed over the rows, then written once
  std::vector<float> gamma_sum(C, 0.f), beta_sum(C, 0.f);
  for (int64_t r = 0; r < R; ++r)
    RowBackward(x + r * C, dy + r * C, gamma, C, eps, dx + r * C, gamma_sum.data(),
                beta_sum.data());
  for (int64_t c = 0; c < C; ++c) {
    dgamma[c] = gamma_sum[c];
    dbeta[c] = beta_sum[c];
  }
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue ParseAttrs(const Attrs& attrs, int* num_in, int* num_out) {
  *num_in = 3;
  *num_out = 1;
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue InferType(const Attrs& attrs, std::vector<int>* in, std::vector<int>* out) {
  return mp_symbolic_kernels::Float32Only("fused_layer_norm", "inputs", in, out);
}

MXReturnValue InferShape(const Attrs& attrs, std::vector<std::vector<unsigned int>>* in,
                         std::vector<std::vector<unsigned int>>* out) {
  const auto& x = in->at(0);
  for (int k = 1; k < 3; ++k) {  // gamma and beta, where their shapes are known
    const auto& p = in->at(k);
    if (!x.empty() && !p.empty() && (p.size() != 1 || p[0] != x.back())) {
      MX_ERROR_MSG << "fused_layer_norm: expected gamma and beta of the input's last axis ("
                   << x.back() << ",)";
      return mxnet::ext::MX_FAIL;
    }
  }
  out->at(0) = x;
  return mxnet::ext::MX_SUCCESS;
}

REGISTER_OP(fused_layer_norm)
.setForward(Forward, "cpu")
.setBackward(Backward, "cpu")
.setParseAttrs(ParseAttrs)
.setInferType(InferType)
.setInferShape(InferShape);

MXReturnValue initialize(int version) {
  return version >= 10900 ? mxnet::ext::MX_SUCCESS : mxnet::ext::MX_FAIL;
}
