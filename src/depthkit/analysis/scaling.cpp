#include "depthkit/analysis/scaling.h"

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit {

namespace {

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream ss(line);
  std::string cell;
  while (std::getline(ss, cell, ',')) {
    const auto b = cell.find_first_not_of(" \t\r"), e = cell.find_last_not_of(" \t\r");
    out.push_back(b == std::string::npos ? "" : cell.substr(b, e - b + 1));
  }
  return out;
}

double parse_number(const std::string& text, const std::string& where) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !std::isfinite(v)) fail(where, ": \"", text, "\" is not a number");
  return v;
}

std::vector<ScalingPoint> read_csv(const fs::path& file) {
  std::istringstream in(read_file(file, 256u << 20));
  std::string line;
  if (!std::getline(in, line)) fail(file.string(), ": empty file");
  const auto header = split_csv(line);
  int col[3] = {-1, -1, -1};
  const char* names[3] = {"method", "compute", "loss"};
  for (int k = 0; k < 3; ++k) {
    for (size_t i = 0; i < header.size(); ++i)
      if (header[i] == names[k]) col[k] = int(i);
    if (col[k] < 0) fail(file.string(), ": header has no column '", names[k], "' (expected method,compute,loss)");
  }
  std::vector<ScalingPoint> points;
  for (int64_t row = 2; std::getline(in, line); ++row) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto cells = split_csv(line);
    const std::string where = cat(file.string(), ": line ", row);
    for (int k = 0; k < 3; ++k)
      if (col[k] >= int(cells.size())) fail(where, ": no value for '", names[k], "'");
    points.push_back({cells[col[0]], parse_number(cells[col[1]], where + " compute"),
                      parse_number(cells[col[2]], where + " loss")});
  }
  return points;
}

std::vector<ScalingPoint> read_json(const fs::path& file) {
  auto j = nlohmann::json::parse(read_file(file), nullptr, false);
  if (j.is_discarded()) fail(file.string(), ": not valid JSON");
  if (j.is_object() && j.contains("points")) j = j["points"];
  if (!j.is_array()) fail(file.string(), ": expected an array of {method, compute, loss} (or {\"points\": [...]})");
  std::vector<ScalingPoint> points;
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& p = j[i];
    const std::string where = cat(file.string(), ": point ", i);
    if (!p.is_object() || !p.contains("method") || !p["method"].is_string() || !p.contains("compute") ||
        !p["compute"].is_number() || !p.contains("loss") || !p["loss"].is_number())
      fail(where, ": needs \"method\" (string), \"compute\" and \"loss\" (numbers)");
    points.push_back({p["method"].get<std::string>(), p["compute"].get<double>(), p["loss"].get<double>()});
  }
  return points;
}

}  // namespace

std::vector<ScalingPoint> read_scaling_points(const fs::path& file) {
  if (!fs::exists(file)) fail(file.string(), ": not found");
  auto points = file.extension() == ".json" ? read_json(file) : read_csv(file);
  if (points.empty()) fail(file.string(), ": no points");
  return points;
}

std::vector<ScalingFit> fit_scaling(const std::vector<ScalingPoint>& points, double E, const std::string& baseline) {
  std::vector<std::string> order;
  std::map<std::string, std::vector<const ScalingPoint*>> by_method;
  for (const ScalingPoint& p : points) {
    if (!(p.compute > 0)) fail("method ", p.method, ": compute ", p.compute, " is not positive");
    if (!(p.loss > E))
      fail("method ", p.method, " at compute ", p.compute, ": loss ", p.loss, " is not above the irreducible loss ", E);
    if (!by_method.count(p.method)) order.push_back(p.method);
    by_method[p.method].push_back(&p);
  }
  if (!by_method.count(baseline)) fail("baseline method '", baseline, "' has no points");

  std::vector<ScalingFit> fits;
  for (const std::string& method : order) {
    const auto& ps = by_method[method];
    // y = log(L − E) = log A − β x, x = log C.
    double sx = 0, sy = 0;
    for (auto* p : ps) {
      sx += std::log(p->compute);
      sy += std::log(p->loss - E);
    }
    const double n = double(ps.size()), mx = sx / n, my = sy / n;
    double sxx = 0, sxy = 0, syy = 0;
    for (auto* p : ps) {
      const double x = std::log(p->compute) - mx, y = std::log(p->loss - E) - my;
      sxx += x * x;
      sxy += x * y;
      syy += y * y;
    }
    if (ps.size() < 2 || sxx <= 0) fail("method ", method, ": needs points at two or more distinct computes to fit");
    ScalingFit f;
    f.method = method;
    f.points = int64_t(ps.size());
    const double slope = sxy / sxx;
    f.beta = -slope;
    f.A = std::exp(my - slope * mx);
    f.r2 = syy > 0 ? sxy * sxy / (sxx * syy) : 1.0;
    fits.push_back(f);
  }
  const ScalingFit* base = nullptr;
  for (auto& f : fits)
    if (f.method == baseline) base = &f;
  if (!(base->beta > 0)) fail("baseline method '", baseline, "': fitted β = ", base->beta, " is not positive (loss does not fall with compute)");
  for (auto& f : fits) {
    double sum = 0;
    for (auto* p : by_method[f.method]) {
      const double c_base = std::pow(base->A / (p->loss - E), 1.0 / base->beta);  // baseline's compute at this loss
      f.speedups.push_back(c_base / p->compute);
      sum += f.speedups.back();
    }
    f.speedup = sum / double(f.speedups.size());
  }
  return fits;
}

}  // namespace depthkit
