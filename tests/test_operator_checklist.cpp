// What every fused operator must have (docs/design.md, "Adding a pathway or an operator"), checked
// for every operator registered in the depthkit namespace, listed from the dispatcher itself: an
// operator added to the library is held to the list without anyone naming it here.
//   - its case in operator_cases() (tests/test_fused.cpp), which is its thread-count case and its
//     reference: the case's fused side must run depthkit::<op> and equal reference::<op>
//     (forward and every gradient, float64 within 1e-10);
//   - its Python check, `def check_<op>(` in tests/test_python_ops.py;
//   - its case in `depthkit bench --ops` (bench_op_names, bench/op_bench.h).
// A backward operator, <op>_backward, is covered by its forward's case and check: the forward's
// Autograd kernel calls it, and the case's fused side must be seen to run it (below; the Python
// test checks the same of its checks). And a name in any of those lists must be a registered
// operator.
//
// Why a checklist rather than one declaration from which the schema string, the fused:: function
// and the reference's signature would follow: C++ cannot derive one from another without a macro
// language of its own. The schema and the C++ signatures are not the same list: the fused::
// functions take an absent input as an undefined tensor where the schema has `Tensor?`, fixed
// arrays where it has `int[]`, and return fewer outputs (rms_norm's inverse RMS and mhc_pre's
// projection are kept for the backward only) or structs (DarRead); the backward schemas carry
// alias annotations (`Tensor(a!)[]`) that no C++ type says. torch's inferred schemas
// (m.def(name, fn)) drop the argument names and the annotations. A table of X-macros mapping each
// argument's schema type to its C++ types would hide the signatures that the headers document, and
// still leave the kernels, the references and the tests to be written by hand; what goes wrong
// in practice (docs/design.md once claimed checks that did not exist) is a missing test, which
// this catches.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/ones_like.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "depthkit/bench/op_bench.h"
#include "helpers.h"
#include "op_checks.h"
#include "operator_cases.h"

namespace depthkit::test {

namespace {

const std::string kNamespace = "depthkit::";
const std::string kBackward = "_backward";

bool is_backward(const std::string& op) {
  return op.size() > kBackward.size() && op.compare(op.size() - kBackward.size(), kBackward.size(), kBackward) == 0;
}

// Every operator registered in the depthkit namespace (without the namespace), from the dispatcher.
std::set<std::string> registered_operators() {
  std::set<std::string> ops;
  for (const c10::OperatorName& name : c10::Dispatcher::singleton().getAllOpNames())
    if (name.name.rfind(kNamespace, 0) == 0) ops.insert(name.name.substr(kNamespace.size()));
  return ops;
}

// The forward operators; a failure when there are none (the library did not register them), so
// that no check below passes by running over an empty list.
std::vector<std::string> forward_operators() {
  std::vector<std::string> forward;
  for (const std::string& op : registered_operators())
    if (!is_backward(op)) forward.push_back(op);
  EXPECT_FALSE(forward.empty()) << "no operator registered in the depthkit namespace";
  return forward;
}

// The depthkit operators dispatched while fn runs: every call through the dispatcher (the autograd
// engine's calls of the backward operators included) runs the RecordFunction callbacks with the
// operator's name.
std::mutex dispatched_mutex;
std::set<std::string> dispatched;

std::unique_ptr<at::ObserverContext> record_depthkit_call(const at::RecordFunction& fn) {
  const std::string name = fn.name();
  if (name.rfind(kNamespace, 0) == 0) {
    std::lock_guard<std::mutex> lock(dispatched_mutex);
    dispatched.insert(name.substr(kNamespace.size()));
  }
  return nullptr;
}

std::set<std::string> operators_dispatched(const std::function<void()>& fn) {
  {
    std::lock_guard<std::mutex> lock(dispatched_mutex);
    dispatched.clear();
  }
  struct Callback {
    at::CallbackHandle handle = at::addGlobalCallback(
        at::RecordFunctionCallback(record_depthkit_call).scopes({at::RecordScope::FUNCTION}));
    ~Callback() { at::removeCallback(handle); }
  } callback;
  fn();
  std::lock_guard<std::mutex> lock(dispatched_mutex);
  return dispatched;
}

// Fails for each name of `listed` (what `list` holds) that is no registered forward operator.
void expect_registered(const std::vector<std::string>& listed, const std::string& list) {
  const std::vector<std::string> forward = forward_operators();
  for (const std::string& op : listed)
    EXPECT_NE(std::find(forward.begin(), forward.end(), op), forward.end())
        << list << " names " << op << ", which is no registered forward operator";
}

// The operators that tests/test_python_ops.py checks: its `def check_<op>(` lines.
std::vector<std::string> python_checks() {
  const std::string path = (std::filesystem::path(source_dir()) / "tests" / "test_python_ops.py").string();
  const std::string prefix = "def check_";
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::vector<std::string> ops;
  for (std::string line; std::getline(in, line);)
    if (line.rfind(prefix, 0) == 0) ops.push_back(line.substr(prefix.size(), line.find('(') - prefix.size()));
  return ops;
}

}  // namespace

// The list the other checks run over: the library is loaded and registers its operators, and every
// backward operator has its forward (whose checks cover it).
TEST(OperatorChecklist, EveryBackwardOperatorHasItsForward) {
  const std::set<std::string> ops = registered_operators();
  ASSERT_FALSE(forward_operators().empty()) << "no operator registered in the depthkit namespace";
  for (const std::string& op : ops)
    if (is_backward(op)) {
      EXPECT_TRUE(ops.count(op.substr(0, op.size() - kBackward.size())))
          << "depthkit::" << op << " has no forward operator, whose checks would cover it";
    }
}

// Each operator's case: it exists, its fused side runs the operator and its backward, and equals
// the reference it names (in float64, so that the comparison is of the functions, not of rounding).
TEST(OperatorChecklist, EveryOperatorHasItsReferenceAndThreadCountCase) {
  const std::set<std::string> ops = registered_operators();
  const std::vector<OperatorCase> cases = operator_cases();
  std::map<std::string, const OperatorCase*> by_name;
  std::vector<std::string> names;
  for (const OperatorCase& c : cases) {
    EXPECT_TRUE(by_name.emplace(c.op, &c).second) << "two cases of " << c.op;
    names.push_back(c.op);
  }
  expect_registered(names, "operator_cases() (tests/test_fused.cpp)");
  for (const std::string& op : forward_operators()) {
    SCOPED_TRACE("depthkit::" + op);
    const auto found = by_name.find(op);
    if (found == by_name.end()) {
      ADD_FAILURE() << "depthkit::" << op << " has no case in operator_cases() (tests/test_fused.cpp): no "
                    << "reference is held to it and FusedKernels.GradientsDoNotDependOnTheThreadCount skips it";
      continue;
    }
    const OperatorCase& c = *found->second;
    std::vector<at::Tensor> inputs;
    for (const at::Tensor& t : c.inputs) inputs.push_back(t.to(at::kDouble));
    compare(inputs, c.fused, c.reference, 1e-10, {}, {}, /*seed=*/7);
    // What the fused side dispatches alone, forward and backward.
    const std::set<std::string> ran = operators_dispatched([&] {
      std::vector<at::Tensor> leaves;
      for (const at::Tensor& t : inputs) leaves.push_back(t.detach().clone().requires_grad_());
      std::vector<at::Tensor> outs = c.fused(leaves), cotangents;
      for (const at::Tensor& o : outs) cotangents.push_back(at::ones_like(o));
      torch::autograd::backward(outs, cotangents);
    });
    EXPECT_TRUE(ran.count(op)) << "the case's fused side never ran depthkit::" << op;
    if (ops.count(op + kBackward)) {
      EXPECT_TRUE(ran.count(op + kBackward)) << "the case's backward never ran depthkit::" << op << kBackward;
    }
  }
}

TEST(OperatorChecklist, EveryOperatorHasItsPythonCheck) {
  const std::vector<std::string> checked = python_checks();
  expect_registered(checked, "tests/test_python_ops.py");
  for (const std::string& op : forward_operators())
    EXPECT_NE(std::find(checked.begin(), checked.end(), op), checked.end())
        << "depthkit::" << op << " has no `def check_" << op << "(` in tests/test_python_ops.py";
}

TEST(OperatorChecklist, EveryOperatorHasItsBenchCase) {
  const std::vector<std::string> benched = bench_op_names();
  expect_registered(benched, "depthkit bench --ops (bench/op_bench.cpp)");
  for (const std::string& op : forward_operators())
    EXPECT_NE(std::find(benched.begin(), benched.end(), op), benched.end())
        << "depthkit::" << op << " has no case in `depthkit bench --ops` (bench/op_bench.cpp)";
}

}  // namespace depthkit::test
