// The type inference of the project's operators: every input float32, the
// outputs of the first input's type; a one-line refusal naming the op.
#ifndef MP_SYMBOLIC_KERNELS_FLOAT32_ONLY_H_
#define MP_SYMBOLIC_KERNELS_FLOAT32_ONLY_H_

#include <vector>

#include "mxnet/lib_api.h"

namespace mp_symbolic_kernels {

// what: the inputs' word in the message ("inputs", "arrays")
inline mxnet::ext::MXReturnValue Float32Only(const char* op, const char* what,
                                             std::vector<int>* in, std::vector<int>* out) {
  for (size_t i = 0; i < in->size(); ++i) {
    if (in->at(i) != mxnet::ext::kFloat32) {
      MX_ERROR_MSG << op << ": expected float32 " << what << ", found type " << in->at(i)
                   << " at input " << i;
      return mxnet::ext::MX_FAIL;
    }
  }
  for (size_t i = 0; i < out->size(); ++i) out->at(i) = in->at(0);
  return mxnet::ext::MX_SUCCESS;
}

}  // namespace mp_symbolic_kernels

#endif  // MP_SYMBOLIC_KERNELS_FLOAT32_ONLY_H_
