// small_batch_dot(a, b, transpose_a, transpose_b): MXNet's batch_dot (the
// same attributes, arrays of 3 or more axes, the leading ones the batch) for
// the small matrices of attention. MXNet 1.9.1's batch_dot calls BLAS's gemm
// once a batch item, and at attention's sizes (64 x 16 by 16 x 64 at the
// language model's width 64) the call costs more than its arithmetic. Here
// each item is one product in registers (small_kernels.h: op(b) copied only
// where transposed or of a width not a multiple of 16), by the loop the CPU
// runs fastest of those compiled for AVX-512, AVX2 with FMA and the
// baseline (small_batch_dot_kernel names it). The products are float32 sums
// in another order than BLAS's: equal to batch_dot's to float32 rounding,
// not bit for bit. Built and loaded by mp_symbolic/core/kernels/__init__.py.
#include <cstdint>
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

namespace small_batch_dot {

bool Flag(const Attrs& attrs, const char* name) {
  auto it = attrs.find(name);
  return it != attrs.end() && (it->second == "True" || it->second == "true" || it->second == "1");
}

// C[n] = op(A[n]) . op(B[n]) for each of the batch's items
void Product(const float* A, const float* B, float* C, int64_t batch, int64_t M, int64_t K,
             int64_t N, bool ta, bool tb) {
  const int64_t NP = (N + 15) / 16 * 16;
  const bool pack = tb || NP != N;
  std::vector<float> bp(pack ? K * NP : 0, 0.f);
  const int64_t rs = ta ? 1 : K, ks = ta ? M : 1;
  for (int64_t n = 0; n < batch; ++n) {
    const float* b = B + n * K * N;
    if (tb) {  // b is N x K
      for (int64_t q = 0; q < N; ++q)
        for (int64_t k = 0; k < K; ++k) bp[k * NP + q] = b[q * K + k];
    } else if (pack) {
      for (int64_t k = 0; k < K; ++k) std::memcpy(&bp[k * NP], b + k * N, N * sizeof(float));
    }
    mp_symbolic_kernels::Chosen().product(A + n * M * K, rs, ks, pack ? bp.data() : b,
                                          pack ? NP : N, C + n * M * N, N, M, K, N, NP,
                                          mp_symbolic_kernels::kFull);
  }
}

// the batch (the leading axes' product) and the shapes of op(a) (M x K) and op(b) (K x N)
void Dims(const std::vector<int64_t>& a, const std::vector<int64_t>& b, bool ta, bool tb,
          int64_t* batch, int64_t* M, int64_t* K, int64_t* N) {
  const size_t n = a.size();
  *batch = 1;
  for (size_t i = 0; i + 2 < n; ++i) *batch *= a[i];
  *M = ta ? a[n - 1] : a[n - 2];
  *K = ta ? a[n - 2] : a[n - 1];
  *N = tb ? b[n - 2] : b[n - 1];
}

MXReturnValue Forward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                      std::vector<MXTensor>* outputs, const OpResource& res) {
  const bool ta = Flag(attrs, "transpose_a"), tb = Flag(attrs, "transpose_b");
  int64_t batch, M, K, N;
  Dims(inputs->at(0).shape, inputs->at(1).shape, ta, tb, &batch, &M, &K, &N);
  Product(inputs->at(0).data<float>(), inputs->at(1).data<float>(),
          outputs->at(0).data<float>(), batch, M, K, N, ta, tb);
  return mxnet::ext::MX_SUCCESS;
}

// inputs: the output's gradient g, then a and b; outputs: the gradients of a and b
MXReturnValue Backward(const Attrs& attrs, std::vector<MXTensor>* inputs,
                       std::vector<MXTensor>* outputs, const OpResource& res) {
  const bool ta = Flag(attrs, "transpose_a"), tb = Flag(attrs, "transpose_b");
  const float* g = inputs->at(0).data<float>();
  const float* a = inputs->at(1).data<float>();
  const float* b = inputs->at(2).data<float>();
  int64_t batch, M, K, N;
  Dims(inputs->at(1).shape, inputs->at(2).shape, ta, tb, &batch, &M, &K, &N);
  // C = op(a) op(b), g = dC (M x N)
  // d op(a) = g op(b)^T (M x K); da = ta ? (g op(b)^T)^T = op(b) g^T : g op(b)^T
  // d op(b) = op(a)^T g (K x N); db = tb ? g^T op(a) : op(a)^T g
  float* da = outputs->at(0).data<float>();
  float* db = outputs->at(1).data<float>();
  if (!ta) Product(g, b, da, batch, M, N, K, false, !tb);      // g . op(b)^T
  else Product(b, g, da, batch, K, N, M, tb, true);            // op(b) . g^T
  if (!tb) Product(a, g, db, batch, K, M, N, !ta, false);      // op(a)^T . g
  else Product(g, a, db, batch, N, M, K, true, ta);            // g^T . op(a)
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue ParseAttrs(const Attrs& attrs, int* num_in, int* num_out) {
  *num_in = 2;
  *num_out = 1;
  return mxnet::ext::MX_SUCCESS;
}

MXReturnValue InferType(const Attrs& attrs, std::vector<int>* in, std::vector<int>* out) {
  return mp_symbolic_kernels::Float32Only("small_batch_dot", "inputs", in, out);
}

MXReturnValue InferShape(const Attrs& attrs, std::vector<std::vector<unsigned int>>* in,
                         std::vector<std::vector<unsigned int>>* out) {
  const auto& a = in->at(0);
  const auto& b = in->at(1);
  const size_t n = a.size();
  bool batch = n >= 3 && b.size() == n;
  for (size_t i = 0; batch && i + 2 < n; ++i) batch = a[i] == b[i];
  if (!batch) {
    MX_ERROR_MSG << "small_batch_dot: expected two arrays of 3 or more axes, the same but "
                 << "the last two, found " << n << " and " << b.size() << " axes";
    return mxnet::ext::MX_FAIL;
  }
  const bool ta = Flag(attrs, "transpose_a"), tb = Flag(attrs, "transpose_b");
  const unsigned M = ta ? a[n - 1] : a[n - 2], K = ta ? a[n - 2] : a[n - 1];
  const unsigned Kb = tb ? b[n - 1] : b[n - 2], N = tb ? b[n - 2] : b[n - 1];
  if (K != Kb) {
    MX_ERROR_MSG << "small_batch_dot: expected the products' inner axes equal, found " << K
                 << " and " << Kb;
    return mxnet::ext::MX_FAIL;
  }
  std::vector<unsigned int> shape(a.begin(), a.end() - 2);
  shape.push_back(M);
  shape.push_back(N);
  out->at(0) = shape;
  return mxnet::ext::MX_SUCCESS;
}

}  // namespace small_batch_dot

REGISTER_OP(small_batch_dot)
.setForward(small_batch_dot::Forward, "cpu")
.setBackward(small_batch_dot::Backward, "cpu")
.setParseAttrs(small_batch_dot::ParseAttrs)
.setInferType(small_batch_dot::InferType)
.setInferShape(small_batch_dot::InferShape);
