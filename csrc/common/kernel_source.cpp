#include "common/kernel_source.h"

#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

namespace mlx_knorm {

namespace {

// Every kernel source must reach this header, directly or through another.
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

// `source` with each line `#include "<name>"` replaced by the text of
// metal_dir/<name>, itself inlined the same way. A header already inlined
// becomes an empty line, as its include guard would leave it.
std::string inline_headers(
    const std::filesystem::path& metal_dir,
    const std::string& source,
    std::set<std::string>& inlined) {
  const std::string prefix = "#include \"";
  std::string out;
  size_t line_begin = 0;
  while (line_begin < source.size()) {
    size_t line_end = source.find('\n', line_begin);
    line_end = line_end == std::string::npos ? source.size() : line_end + 1;
    const std::string line = source.substr(line_begin, line_end - line_begin);
    const size_t name_end = line.find('"', prefix.size());
    if (line.rfind(prefix, 0) == 0 && name_end != std::string::npos) {
      const std::string name = line.substr(prefix.size(), name_end - prefix.size());
      if (inlined.insert(name).second) {
        out += inline_headers(metal_dir, read_text(metal_dir / name), inlined);
      }
      out += line.substr(name_end + 1);
    } else {
      out += line;
    }
    line_begin = line_end;
  }
  return out;
}

} // namespace

std::string metal_kernel_source(
    const std::filesystem::path& metal_dir,
    const std::string& name) {
  std::set<std::string> inlined;
  std::string source =
      inline_headers(metal_dir, read_text(metal_dir / (name + ".metal")), inlined);
  if (inlined.count(kSharedHeader) == 0) {
    throw std::runtime_error(
        "mlx_knorm: " + name + ".metal does not include " + kSharedHeader);
  }
  return source;
}

} // namespace mlx_knorm
