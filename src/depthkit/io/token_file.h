// Token-id input files for `depthkit forward`: a NumPy .npy integer array ([T] or [batch, T],
// C order), or text with whitespace-separated ids, one sequence per line (all of one length).
#pragma once
#include <ATen/core/Tensor.h>

#include <string>

namespace depthkit {

// Returns int64 [batch, T]. Malformed input is an Error naming the file and the problem.
at::Tensor read_token_file(const std::string& path);

}  // namespace depthkit
