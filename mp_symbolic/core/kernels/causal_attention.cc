// causal_attention(q, k, v, head_dim, scale): multi-head causal self-attention
// of queries, keys and values (N, T, C), C = h head_dim, each head's
// features read in place through the rows' stride (no transpose of the
// heads): out[n, t, head] = sum_{s <= t} softmax_s(scale q[n, t, head] .
// k[n, s, head]) v[n, s, head], scale head_dim^-1/2 unless given. One output,
// the result, which MXNet's library API keeps for the backward pass (and the
// next layer keeps as its input anyway); the backward recomputes each head's
// probabilities from q and k, so that no (N, h, T, T) array outlives the
// op. The entries above the diagonal are neither computed nor read. The
// products and softmaxes are small_kernels.h's loops: float32 sums in
// another order than batch_dot's and softmax's, equal to the same attention
// of MXNet's ops to float32 rounding. Built and loaded by
// mp_symbolic/core/kernels/__init__.py.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "mxnet/lib_api.h"
#include "float32_only.h"
#include "small_kernels.h"

using mxnet::ext::MXReturnValue;
using mxnet::ext::MXTensor;
using mxnet::ext::OpResource;
using Attrs = std::unordered_map<std::string, std::string>;
using mp_symbolic_kernels::Band;
using mp_symbolic_kernels::Chosen;

namespace causal_attention {

// head_dim, or 0 where it is missing or not a whole number from 1 to 2^20
int64_t HeadDim(const Attrs& attrs) {
  auto it = attrs.find("head_dim");
  if (it == attrs.end() || it->second.empty() || it->second.size() > 7) return 0;
  for (char c : it->second)
    if (c < '0' || c > '9') return 0;
  const int64_t dim = std::strtoll(it->second.c_str(), nullptr, 10);
  return dim <= (int64_t{1} << 20) ? dim : 0;
}

// scale as written (true), or head_dim^-1/2 where it is not given; false where it
// is not a finite number
bool Scale(const Attrs& attrs, int64_t head_dim, float* scale) {
  auto it = attrs.find("scale");
  if (it == attrs.end() || it->second.empty() || it->second == "None") {
    *scale = 1.f / std::sqrt(static_cast<float>(head_dim));
    return true;
  }
  char* end = nullptr;
  *scale = std::strtof(it->second.c_str(), &end);
  return end != it->second.c_str() && *end == '\0' && std::isfinite(*scale);
}

int64_t Up16(int64_t x) { return (x + 15) / 16 * 16; }

// One head of one sequence: the T rows of its D features start at base and are
// C apart; Rows() gives them as a product's b operand (rows of stride ldb,
// a multiple of 16 floats wide): in place where D is a multiple of 16, else
// copied into a buffer of rows Up16(D) wide.
struct Head {
  int64_t T, C, D, DP;
  std::vector<float> copy;
  Head(int64_t T_, int64_t C_, int64_t D_) : T(T_), C(C_), D(D_), DP(Up16(D_)) {
    if (DP != D) copy.assign(T * DP, 0.f);
  }
  const float* Rows(const float* base, int64_t* ldb) {
    if (DP == D) {
      *ldb = C;
      return base;
    }
    for (int64_t t = 0; t < T; ++t) std::memcpy(&copy[t * DP], base + t * C, D * sizeof(float));
    *ldb = DP;
    return copy.data();
  }
};

// the head's rows transposed: D rows of T (stride TP, the tail 0)
void Transposed(const float* base, int64_t T, int64_t C, int64_t D, int64_t TP, float* out) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) out[d * TP + t] = base[t * C + d];
}

// p (T rows of TP) = the softmax of the head's scores scale q k^T, causal
void Probabilities(const float* qh, const float* kh, int64_t T, int64_t C, int64_t D,
                   int64_t TP, float scale, float* kt, float* p) {
  Transposed(kh, T, C, D, TP, kt);
  Chosen().product(qh, C, 1, kt, TP, p, TP, T, D, T, TP, mp_symbolic_kernels::kRowsFromCol);
  Chosen().softmax(p, T, TP, scale);
}

struct Shape {
  int64_t N, T, C, D, TP;
};

// the queries' shape and the scale, as ParseAttrs and InferShape have checked them
MXReturnValue ShapeOf(const Attrs& attrs, const std::vector<int64_t>& shape, Shape* s,
                      float* scale) {
  s->D = HeadDim(attrs);
  if (shape.size() != 3 || s->D <= 0 || shape[2] % s->D != 0 || !Scale(attrs, s->D, scale)) {
    MX_ERROR_MSG << "causal_attention: expected (N, T, C) inputs, C a multiple of head_dim";
    return mxnet::ext::MX_FAIL;
  }
  s->N = shape[0];
  s->T = shape[1];
  s->C = shape[2];
  s->TP = Up16(s->T);
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue Forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                      std::vector<MXTensor>* outputs, const OpResource& res) {
  Shape s;
  float scale;
  if (ShapeOf(attrs, inputs->at(0).shape, &s, &scale) != mxnet::ext::MX_SUCCESS)
    return mxnet::ext::MX_FAIL;
  const float* q = inputs->at(0).data<float>();
  const float* k = inputs->at(1).data<float>();
  const float* v = inputs->at(2).data<float>();
  float* out = outputs->at(0).data<float>();
  // zeros where no loop writes: the triangle above the diagonal that no product computes
  std::vector<float> p(s.T * s.TP, 0.f), kt(s.D * s.TP, 0.f);
  Head values(s.T, s.C, s.D);
  for (int64_t n = 0; n < s.N; ++n)
    for (int64_t h = 0; h < s.C / s.D; ++h) {
      const int64_t at = n * s.T * s.C + h * s.D;
      Probabilities(q + at, k + at, s.T, s.C, s.D, s.TP, scale, kt.data(), p.data());
      int64_t ldb;
      const float* vh = values.Rows(v + at, &ldb);
      Chosen().product(p.data(), s.TP, 1, vh, ldb, out + at, s.C, s.T, s.T, s.D, values.DP,
                       mp_symbolic_kernels::kInnerToRow);
    }
  return mxnet::ext::MX_SUCCESS;
}

// inputs: the output's gradient, then q, k, v (and the output); outputs: the
// gradients of q, k and v
MXReturnValue Backward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                       std::vector<MXTensor>* outputs, const OpResource& res) {
  Shape s;
  float scale;
  if (ShapeOf(attrs, inputs->at(1).shape, &s, &scale) != mxnet::ext::MX_SUCCESS)
    return mxnet::ext::MX_FAIL;
  const float* dout = inputs->at(0).data<float>();
  const float* q = inputs->at(1).data<float>();
  const float* k = inputs->at(2).data<float>();
  const float* v = inputs->at(3).data<float>();
  float* dq = outputs->at(0).data<float>();
  float* dk = outputs->at(1).data<float>();
  float* dv = outputs->at(2).data<float>();
  std::vector<float> p(s.T * s.TP, 0.f), g(s.T * s.TP, 0.f), t(s.D * s.TP, 0.f);
  Head grads(s.T, s.C, s.D), keys(s.T, s.C, s.D), queries(s.T, s.C, s.D);
  const Band above = mp_symbolic_kernels::kInnerFromRow, below = mp_symbolic_kernels::kInnerToRow;
  for (int64_t n = 0; n < s.N; ++n)
    for (int64_t h = 0; h < s.C / s.D; ++h) {
      const int64_t at = n * s.T * s.C + h * s.D;
      Probabilities(q + at, k + at, s.T, s.C, s.D, s.TP, scale, t.data(), p.data());
      // g = the probabilities' gradient dout v^T, then the scores' (scale included)
      Transposed(v + at, s.T, s.C, s.D, s.TP, t.data());
      Chosen().product(dout + at, s.C, 1, t.data(), s.TP, g.data(), s.TP, s.T, s.D, s.T, s.TP,
                       mp_symbolic_kernels::kRowsFromCol);
      Chosen().softmax_grad(p.data(), g.data(), s.T, s.TP, scale);
      int64_t ldb;
      const float* rows = grads.Rows(dout + at, &ldb);  // dv = p^T dout
      Chosen().product(p.data(), 1, s.TP, rows, ldb, dv + at, s.C, s.T, s.T, s.D, grads.DP, above);
      rows = keys.Rows(k + at, &ldb);  // dq = g k
      Chosen().product(g.data(), s.TP, 1, rows, ldb, dq + at, s.C, s.T, s.T, s.D, grads.DP, below);
      rows = queries.Rows(q + at, &ldb);  // dk = g^T q
      Chosen().product(g.data(), 1, s.TP, rows, ldb, dk + at, s.C, s.T, s.T, s.D, grads.DP, above);
    }
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue ParseAttrs(const Attrs& attrs, int* num_in, int* num_out) {
  if (HeadDim(attrs) <= 0) {
    auto it = attrs.find("head_dim");
    MX_ERROR_MSG << "causal_attention: expected head_dim, a whole number from 1 to 1048576, "
                 << "found " << (it == attrs.end() ? std::string("none") : "'" + it->second + "'");
    return mxnet::ext::MX_FAIL;
  }
  float scale;
  if (!Scale(attrs, HeadDim(attrs), &scale)) {
    MX_ERROR_MSG << "causal_attention: expected scale, a finite number, found '"
                 << attrs.at("scale") << "'";
    return mxnet::ext::MX_FAIL;
  }
  *num_in = 3;
  *num_out = 1;
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue InferType(const Attrs& attrs, std::vector<int>* in, std::vector<int>* out) {
  return mp_symbolic_kernels::Float32Only("causal_attention", "inputs", in, out);
}

std::string Text(const std::vector<unsigned int>& shape) {
  std::string text = "(";
  for (size_t i = 0; i < shape.size(); ++i)
    text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + (shape.size() == 1 ? ",)" : ")");
}

MXReturnValue InferShape(const Attrs& attrs, std::vector<std::vector<unsigned int>>* in,
                         std::vector<std::vector<unsigned int>>* out) {
  const auto& q = in->at(0);
  for (int i = 0; i < 3; ++i)
    if (in->at(i) != q || q.size() != 3) {
      MX_ERROR_MSG << "causal_attention: expected queries, keys and values of one shape "
                   << "(N, T, C), found " << Text(q) << ", " << Text(in->at(1)) << " and "
                   << Text(in->at(2));
      return mxnet::ext::MX_FAIL;
    }
  const int64_t D = HeadDim(attrs);
  if (q[2] % D != 0) {
    MX_ERROR_MSG << "causal_attention: expected C a multiple of head_dim " << D << ", found C "
                 << q[2];
    return mxnet::ext::MX_FAIL;
  }
  out->at(0) = q;
  return mxnet::ext::MX_SUCCESS;
}

}  // namespace causal_attention

REGISTER_OP(causal_attention)
.setForward(causal_attention::Forward, "cpu")
.setBackward(causal_attention::Backward, "cpu")
.setParseAttrs(causal_attention::ParseAttrs)
.setInferType(causal_attention::InferType)
.setInferShape(causal_attention::InferShape);
