#include "depthkit/util/error.h"

namespace depthkit {

std::string one_line(const std::exception& e) {
  std::string msg = e.what();
  // c10::Error appends "Exception raised from ..." and a backtrace after the first line.
  auto cut = msg.find('\n');
  if (cut != std::string::npos) msg.resize(cut);
  return msg;
}

}  // namespace depthkit
