#include "depthkit/util/fs.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>

#include "depthkit/util/error.h"

namespace depthkit {

void fsync_path(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail(path.string(), ": cannot open to sync: ", std::strerror(errno));
  ::fsync(fd);
  ::close(fd);
}

void rename_durable(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) fail(to.string(), ": cannot rename from ", from.string(), ": ", ec.message());
  fsync_path(to.parent_path().empty() ? fs::path(".") : to.parent_path());
}

void write_file_atomic(const fs::path& path, std::string_view bytes) {
  fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(dir.string(), ": cannot create directory: ", ec.message());
  std::random_device rd;
  fs::path tmp = dir / (path.filename().string() + ".tmp" + std::to_string(rd() % 1000000));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail(tmp.string(), ": cannot create: ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      int err = errno;
      ::close(fd);
      fs::remove(tmp, ec);
      fail(tmp.string(), ": write failed: ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    fs::remove(tmp, ec);
    fail(tmp.string(), ": fsync/close failed: ", std::strerror(errno));
  }
  rename_durable(tmp, path);
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path.string(), ": cannot open for reading");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

}  // namespace depthkit
