#include "common/kernel_source.h"

#include <fstream>
#include <sstream>
#include <stdexcept>

namespace mlx_knorm {

namespace {

constexpr const char* kSharedHeader = "knorm_defines.h";

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) {
    throw std::runtime_error(
        "mlx_knorm: no mlx_knorm.metallib and no kernel source " + path.string());
  }
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

} // namespace

std::string metal_kernel_source(
    const std::filesystem::path& metal_dir,
    const std::string& name) {
  std::string source = read_text(metal_dir / (name + ".metal"));
  const std::string include_line = std::string("#include \"") + kSharedHeader + "\"";
  const size_t at = source.find(include_line);
  if (at == std::string::npos) {
    throw std::runtime_error(
        "mlx_knorm: " + name + ".metal does not include " + kSharedHeader);
  }
  source.replace(at, include_line.size(), read_text(metal_dir / kSharedHeader));
  return source;
}

} // namespace mlx_knorm
