// The references of depth_read and depth_merge (reference.h): the depth-attention primitive
// (depth_attention.h) once per target, in the fused operators' flat layout.
#include <ATen/ops/stack.h>

#include "depthkit/ops/reference/depth_attention.h"
#include "depthkit/ops/reference/reference.h"

namespace depthkit::reference {

std::tuple<at::Tensor, at::Tensor> depth_read(const at::Tensor& queries, at::TensorList key_list,
                                              at::TensorList value_list, double eps) {
  const at::Tensor keys = at::stack(key_list), values = value_list.empty() ? keys : at::stack(value_list);
  std::vector<at::Tensor> outs, lses;
  for (int64_t m = 0; m < queries.size(0); ++m) {  // one read per target (A.1–A.5)
    DepthRead r = depthkit::depth_read(queries[m], keys, values, eps);
    outs.push_back(r.out);
    lses.push_back(r.log_partition);
  }
  return {at::stack(outs), at::stack(lses)};
}

at::Tensor depth_merge(const at::Tensor& out, const at::Tensor& log_partition, const at::Tensor& query,
                       const at::Tensor& key_part, const at::Tensor& value_part, double eps) {
  return merge_partial(DepthRead{out, log_partition}, query, key_part, value_part.defined() ? value_part : key_part,
                       eps);  // (A.6–A.10)
}

}  // namespace depthkit::reference
