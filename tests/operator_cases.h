// One case per fused operator (tests/test_fused.cpp, operator_cases): the operator's C++ function
// and its reference composition on the same inputs. FusedKernels.GradientsDoNotDependOnTheThreadCount
// runs every case's fused side on 1, 2 and 3 threads; OperatorChecklist (test_operator_checklist.cpp)
// requires a case for every operator registered in the depthkit namespace, holds its fused side to
// its reference in float64, and checks that the fused side does run depthkit::<op> (and its
// backward operator).
#pragma once
#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "op_checks.h"

namespace depthkit::test {

struct OperatorCase {
  std::string op;                  // the registered operator depthkit::<op>, which `fused` runs
  OutputsFn fused, reference;      // fused::<op> and reference::<op> on the inputs: their outputs
  std::vector<at::Tensor> inputs;  // the differentiable inputs (float32), large enough that every
                                   // kernel splits its tokens across threads
};

std::vector<OperatorCase> operator_cases();

}  // namespace depthkit::test
