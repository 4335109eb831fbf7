// fused_layer_norm(x, gamma, beta, eps): LayerNorm over the last axis of a
// float32 array, forward and backward each one pass over a row's values with
// the row's mean and reciprocal deviation recomputed in the backward (nothing
// kept between the passes). A custom operator for MXNet 1.9.1's library API
// (third_party/mxnet/lib_api.cc, the wheel's mxnet/lib_api.h), built and
// loaded by bench/custom_ops.py.
#include <cmath>
#include <string>
#include <unordered_map>
#include <vector>

#include "mxnet/lib_api.h"

using mxnet::ext::MXReturnValue;
using mxnet::ext::MXTensor;
using mxnet::ext::OpResource;
using Attrs = std::unordered_map<std::string, std::string>;

namespace {

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

// a row's mean and reciprocal deviation
void Moments(const float* x, int64_t C, float eps, float* mean, float* rstd) {
  float sum = 0.f;
  for (int64_t c = 0; c < C; ++c) sum += x[c];
  const float m = sum / C;
  float squares = 0.f;
  for (int64_t c = 0; c < C; ++c) {
    const float d = x[c] - m;
    squares += d * d;
  }
  *mean = m;
  *rstd = 1.f / std::sqrt(squares / C + eps);
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
  for (int64_t c = 0; c < C; ++c) dgamma[c] = dbeta[c] = 0.f;
  std::vector<float> normed(C);
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * C;
    const float* dyr = dy + r * C;
    float* dxr = dx + r * C;
    float mean, rstd;
    Moments(xr, C, eps, &mean, &rstd);
    float sum = 0.f, dot = 0.f;  // over the row: dy gamma, and dy gamma times the normed x
    for (int64_t c = 0; c < C; ++c) {
      const float h = (xr[c] - mean) * rstd;
      const float t = dyr[c] * gamma[c];
      normed[c] = h;
      sum += t;
      dot += t * h;
      dgamma[c] += dyr[c] * h;
      dbeta[c] += dyr[c];
    }
    sum /= C;
    dot /= C;
    for (int64_t c = 0; c < C; ++c) dxr[c] = rstd * (dyr[c] * gamma[c] - sum - normed[c] * dot);
  }
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue ParseAttrs(const Attrs& attrs, int* num_in, int* num_out) {
  *num_in = 3;
  *num_out = 1;
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue InferType(const Attrs& attrs, std::vector<int>* in, std::vector<int>* out) {
  for (size_t i = 0; i < in->size(); ++i) {
    if (in->at(i) != mxnet::ext::kFloat32) {
      MX_ERROR_MSG << "fused_layer_norm: expected float32 inputs, found type " << in->at(i)
                   << " at input " << i;
      return mxnet::ext::MX_FAIL;
    }
  }
  out->at(0) = in->at(0);
  return mxnet::ext::MX_SUCCESS;
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
