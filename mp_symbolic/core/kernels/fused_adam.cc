// fused_adam_update(w0, g0, m0, v0, w1, g1, m1, v1, ...; lrs, wds, ...): MXNet's
// adam_update over many float32 parameters in one call, each weight written
// (the outputs, the weights themselves where out= names them) and its two
// moments updated in place. Each element takes the float arithmetic of
// adam_update's CPU kernel (src/operator/optimizer_op-inl.h at 1.9.1,
// AdamUpdateKernel) in its order, and each number reads its attribute string
// as MXNet's parameter parser does, so the results are adam_update's bit for
// bit; the loops are written so the compiler makes them vector operations
// (IEEE sqrt and division give the same bits a lane as one at a time).
// Built and loaded by mp_symbolic/core/kernels/__init__.py.
#include <cmath>
#include <cstdint>
#include <limits>
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

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// A decimal number read into a float the way MXNet 1.9.1's parameters read
// theirs (dmlc-core's strtonum.h, ParseFloat<float>), which is not always the
// nearest float: the digits before the point as an integer made a float; up
// to 19 digits after it as an integer divided by its power of ten in double,
// made a float and added; an exponent (at most 38) applied as a float scale
// of 1e8 and 10 steps. "inf" and "nan" as themselves. False where the text
// is not such a number.
bool ReadLikeMXNet(const std::string& text, float* out) {
  const char* p = text.c_str();
  bool negative = false;
  if (*p == '-' || *p == '+') negative = *p++ == '-';
  if (text.compare(p - text.c_str(), std::string::npos, "inf") == 0) {
    *out = negative ? -std::numeric_limits<float>::infinity()
                    : std::numeric_limits<float>::infinity();
    return true;
  }
  if (text.compare(p - text.c_str(), std::string::npos, "nan") == 0) {
    *out = std::numeric_limits<float>::quiet_NaN();
    return true;
  }
  const char* start = p;
  uint64_t whole = 0;
  for (; IsDigit(*p); ++p) whole = whole * 10u + static_cast<uint64_t>(*p - '0');
  float value = static_cast<float>(whole);
  if (*p == '.') {
    ++p;
    uint64_t digits = 0, scale = 1;
    for (int count = 0; IsDigit(*p); ++p, ++count) {
      if (count < 19) {
        digits = digits * 10u + static_cast<uint64_t>(*p - '0');
        scale *= 10u;
      }
    }
    value += static_cast<float>(static_cast<double>(digits) / static_cast<double>(scale));
  }
  if (p == start) return false;
  if (*p == 'e' || *p == 'E') {
    ++p;
    bool fraction = false;
    if (*p == '-' || *p == '+') fraction = *p++ == '-';
    if (!IsDigit(*p)) return false;
    unsigned exponent = 0;
    for (; IsDigit(*p); ++p) exponent = exponent * 10u + static_cast<unsigned>(*p - '0');
    if (exponent > 38u) exponent = 38u;
    if (exponent == 38u) {  // the largest significands at that exponent
      if (!fraction && value > 3.402823466f) value = 3.402823466f;
      if (fraction && value < 1.175494351f) value = 1.175494351f;
    }
    float power = 1.0f;
    for (; exponent >= 8u; exponent -= 8u) power *= 1e8f;
    for (; exponent > 0u; exponent -= 1u) power *= 10.0f;
    value = fraction ? value / power : value * power;
  }
  if (*p != '\0') return false;
  *out = negative ? -value : value;
  return true;
}

struct Settings {
  int64_t count = 0;
  float beta1 = 0.9f, beta2 = 0.999f, epsilon = 1e-8f, rescale_grad = 1.0f,
        clip_gradient = -1.0f;
  std::vector<float> lrs, wds;
};

// "(a, b, c)", "[a, b, c]" or "a,b,c" into floats
bool ReadList(const std::string& text, std::vector<float>* values) {
  values->clear();
  std::string item;
  for (char c : text + ",") {
    if (c == '(' || c == ')' || c == '[' || c == ']' || c == ' ') continue;
    if (c != ',') {
      item += c;
      continue;
    }
    if (item.empty()) continue;
    float value;
    if (!ReadLikeMXNet(item, &value)) return false;
    values->push_back(value);
    item.clear();
  }
  return true;
}

bool Read(const Attrs& attrs, Settings* s, bool lists) {
  for (const auto& kv : attrs) {
    const std::string& key = kv.first;
    bool ok = true;
    if (key == "num_weights") {
      s->count = 0;
      ok = !kv.second.empty() && kv.second.size() < 10;
      for (char c : kv.second) {
        ok = ok && IsDigit(c);
        s->count = s->count * 10 + (c - '0');
      }
    } else if (key == "beta1") {
      ok = ReadLikeMXNet(kv.second, &s->beta1);
    } else if (key == "beta2") {
      ok = ReadLikeMXNet(kv.second, &s->beta2);
    } else if (key == "epsilon") {
      ok = ReadLikeMXNet(kv.second, &s->epsilon);
    } else if (key == "rescale_grad") {
      ok = ReadLikeMXNet(kv.second, &s->rescale_grad);
    } else if (key == "clip_gradient") {
      ok = ReadLikeMXNet(kv.second, &s->clip_gradient);
    } else if (key == "lrs" || key == "wds") {
      if (lists) ok = ReadList(kv.second, key == "lrs" ? &s->lrs : &s->wds);
    } else if (key.compare(0, 2, "__") != 0) {
      MX_ERROR_MSG << "fused_adam_update: no argument named " << key;
      return false;
    }
    if (!ok) {
      MX_ERROR_MSG << "fused_adam_update: expected a number for " << key << ", found '"
                   << kv.second << "'";
      return false;
    }
  }
  if (s->count < 1) {
    MX_ERROR_MSG << "fused_adam_update: expected num_weights of at least 1";
    return false;
  }
  if (lists && (static_cast<int64_t>(s->lrs.size()) != s->count ||
                static_cast<int64_t>(s->wds.size()) != s->count)) {
    MX_ERROR_MSG << "fused_adam_update: expected " << s->count << " lrs and wds, found "
                 << s->lrs.size() << " and " << s->wds.size();
    return false;
  }
  return true;
}

// The moments' updates and the new weight of elements [0, n): adam_update's
// arithmetic, term by term, the new weight written over `weight` (kInPlace)
// or into `out`. kClip: clip the gradient to clip_gradient.
template <bool kClip, bool kInPlace>
void Update(int64_t n, float* __restrict__ weight, const float* __restrict__ grad,
            float* __restrict__ mean, float* __restrict__ var, float* __restrict__ out,
            const Settings& s, float lr, float wd) {
  const float b1 = s.beta1, b2 = s.beta2, rest1 = 1.f - s.beta1, rest2 = 1.f - s.beta2;
  for (int64_t i = 0; i < n; ++i) {
    const float w = weight[i];
    float g = grad[i] * s.rescale_grad + w * wd;
    if (kClip) g = g > s.clip_gradient ? s.clip_gradient
                   : (g < -s.clip_gradient ? -s.clip_gradient : g);
    const float m = b1 * mean[i] + rest1 * g;
    const float v = b2 * var[i] + rest2 * g * g;
    mean[i] = m;
    var[i] = v;
    (kInPlace ? weight : out)[i] = w - lr * m / (std::sqrt(v) + s.epsilon);
  }
}

}  // namespace

MXReturnValue AdamForward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                          std::vector<MXTensor>* outputs, const OpResource& res) {
  Settings s;
  if (!Read(attrs, &s, true)) return mxnet::ext::MX_FAIL;
  const bool clip = s.clip_gradient >= 0.f;
  for (int64_t k = 0; k < s.count; ++k) {
    MXTensor& w = inputs->at(4 * k);
    float* weight = w.data<float>();
    const float* grad = inputs->at(4 * k + 1).data<float>();
    float* mean = inputs->at(4 * k + 2).data<float>();
    float* var = inputs->at(4 * k + 3).data<float>();
    float* out = outputs->at(k).data<float>();
    const int64_t n = w.size();
    const float lr = s.lrs[k], wd = s.wds[k];
    if (out == weight) {
      if (clip) Update<true, true>(n, weight, grad, mean, var, nullptr, s, lr, wd);
      else Update<false, true>(n, weight, grad, mean, var, nullptr, s, lr, wd);
    } else {
      if (clip) Update<true, false>(n, weight, grad, mean, var, out, s, lr, wd);
      else Update<false, false>(n, weight, grad, mean, var, out, s, lr, wd);
    }
  }
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue AdamParseAttrs(const Attrs& attrs, int* num_in, int* num_out) {
  Settings s;
  if (!Read(attrs, &s, false)) return mxnet::ext::MX_FAIL;
  *num_in = static_cast<int>(4 * s.count);
  *num_out = static_cast<int>(s.count);
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue AdamInferType(const Attrs& attrs, std::vector<int>* in, std::vector<int>* out) {
  return mp_symbolic_kernels::Float32Only("fused_adam_update", "arrays", in, out);
}

MXReturnValue AdamInferShape(const Attrs& attrs, std::vector<std::vector<unsigned int>>* in,
                             std::vector<std::vector<unsigned int>>* out) {
  for (size_t k = 0; k < out->size(); ++k) {
    const auto& weight = in->at(4 * k);
    for (size_t j = 1; j < 4; ++j) {
      if (in->at(4 * k + j) != weight) {
        MX_ERROR_MSG << "fused_adam_update: expected the gradient and both moments of weight "
                     << k << " in its shape";
        return mxnet::ext::MX_FAIL;
      }
    }
    out->at(k) = weight;
  }
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue AdamMutateInputs(const Attrs& attrs, std::vector<int>* indices) {
  Settings s;
  if (!Read(attrs, &s, false)) return mxnet::ext::MX_FAIL;
  for (int64_t k = 0; k < s.count; ++k) {
    indices->push_back(static_cast<int>(4 * k + 2));
    indices->push_back(static_cast<int>(4 * k + 3));
  }
  return mxnet::ext::MX_SUCCESS;
}

REGISTER_OP(fused_adam_update)
.setForward(AdamForward, "cpu")
.setParseAttrs(AdamParseAttrs)
.setInferType(AdamInferType)
.setInferShape(AdamInferShape)
.setMutateInputs(AdamMutateInputs);
