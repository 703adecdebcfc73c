// Precompiled header shared by every depthkit target: the narrow torch core plus the
// standard library. Op headers (<ATen/ops/*.h>) are included where they are used.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>
