#include "depthkit/util/fs.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

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

AtomicFile::AtomicFile(const fs::path& path) : path_(path) {
  fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::error_code ec;
  if (fs::is_directory(path, ec)) fail(path.string(), ": is a directory, expected a file path to write");
  // The rename at commit() would put a regular file in place of a device or FIFO (/dev/null, for
  // one, when run as root): only a regular file, or nothing, is replaced.
  if (const fs::file_status st = fs::status(path, ec); fs::exists(st) && !fs::is_regular_file(st))
    fail(path.string(), ": is ", path_kind(path), ", not a regular file to write");
  fs::create_directories(dir, ec);
  if (ec) fail(dir.string(), ": cannot create directory: ", ec.message());
  // A name nobody has (O_EXCL): a file that happens to have it is never overwritten.
  std::random_device rd;
  for (int attempt = 0; fd_ < 0; ++attempt) {
    tmp_ = dir / (path.filename().string() + ".tmp" + std::to_string(rd() % 1000000));
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0 && (errno != EEXIST || attempt == 100)) fail(tmp_.string(), ": cannot create: ", std::strerror(errno));
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFile::write(std::string_view bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(tmp_.string(), ": write failed: ", std::strerror(errno));
    done += static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  const int fd = fd_;
  fd_ = -1;
  const int synced = ::fsync(fd), sync_err = errno;
  const int closed = ::close(fd), close_err = errno;
  if (synced != 0 || closed != 0) {
    ::unlink(tmp_.c_str());
    fail(tmp_.string(), ": fsync/close failed: ", std::strerror(synced != 0 ? sync_err : close_err));
  }
  try {
    rename_durable(tmp_, path_);
  } catch (...) {
    ::unlink(tmp_.c_str());  // never leave the temporary behind
    throw;
  }
}

void write_file_atomic(const fs::path& path, std::string_view bytes) {
  AtomicFile file(path);
  file.write(bytes);
  file.commit();
}

uintmax_t regular_file_size(const fs::path& path, uintmax_t max_bytes) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) fail(path.string(), ": cannot open: not found");
  if (fs::is_directory(st)) fail(path.string(), ": is a directory, expected a file");
  if (!fs::is_regular_file(st)) fail(path.string(), ": not a regular file (a device, FIFO or socket)");
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) fail(path.string(), ": cannot read its size: ", ec.message());
  if (size > max_bytes) fail(path.string(), ": ", size, " bytes, more than the ", max_bytes, " this file may have");
  return size;
}

std::string read_file(const fs::path& path, uintmax_t max_bytes) {
  const uintmax_t size = regular_file_size(path, max_bytes);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path.string(), ": cannot open for reading");
  std::string out(size, '\0');
  in.read(out.data(), std::streamsize(size));
  if (in.gcount() != std::streamsize(size)) fail(path.string(), ": changed size while being read");
  return out;
}

bool is_within(const fs::path& inner, const fs::path& outer) {
  std::error_code ec;
  const fs::path a = fs::weakly_canonical(fs::absolute(inner, ec), ec);
  const fs::path b = fs::weakly_canonical(fs::absolute(outer, ec), ec);
  const fs::path rel = a.lexically_relative(b);
  return !rel.empty() && *rel.begin() != "..";
}

fs::path output_directory(const std::string& given, const std::string& option) {
  fs::path out = fs::path(given).lexically_normal();
  if (!out.empty() && !out.has_filename()) out = out.parent_path();  // "out/" is "out"
  const std::string name = out.filename().string();
  if (out.empty() || name.empty() || name == "." || name == ".." || out == out.root_path())
    fail(option, " '", printable(given), "': name an output directory of its own (it is replaced as a whole), "
         "not '.', '..' or '/'");
  return out;
}

fs::path make_sibling_dir(const fs::path& path, const std::string& tag) {
  const fs::path parent = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  std::error_code ec;
  fs::create_directories(parent, ec);
  if (ec) fail(parent.string(), ": cannot create directory: ", ec.message());
  std::string name = (parent / (path.filename().string() + "." + tag + "-XXXXXX")).string();
  if (!::mkdtemp(name.data())) fail(name, ": cannot create a directory: ", std::strerror(errno));
  // mkdtemp makes it 0700; renamed into place, it is an output like any other (0777 less umask).
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::chmod(name.c_str(), 0777 & ~mask);
  return name;
}

namespace {

// The first entry of `dir` that is not a regular file `owned` accepts, or "".
std::string first_unowned(const fs::path& dir, const OwnedNames& owned) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!fs::is_regular_file(fs::symlink_status(e.path(), ec)) || !owned(name)) return name;
  }
  if (ec) fail(dir.string(), ": cannot list: ", ec.message());
  return "";
}

}  // namespace

void check_only_owned(const fs::path& dir, const OwnedNames& owned, const std::string& what) {
  if (const std::string name = first_unowned(dir, owned); !name.empty())
    fail(dir.string(), ": --force replaces only ", what, ", and '", printable(name),
         "' is not part of it (move it away, or choose another output)");
}

void replace_directory(const fs::path& built, const fs::path& out, const OwnedNames& owned) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(out, ec))) {
    rename_durable(built, out);
    return;
  }
  // One step: the two swap names, so `out` always holds one of them; the old one is then at
  // `built`'s name. (A file system without RENAME_EXCHANGE: the old one is renamed aside first.)
  fs::path old = built;
  if (::renameat2(AT_FDCWD, built.c_str(), AT_FDCWD, out.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_path(out.parent_path().empty() ? fs::path(".") : out.parent_path());
  } else if (errno == EINVAL || errno == ENOSYS) {
    std::random_device rd;
    do old = cat(out.string(), ".old-", rd() % 1000000);
    while (fs::exists(fs::symlink_status(old, ec)));
    rename_durable(out, old);
    try {
      rename_durable(built, out);
    } catch (...) {
      rename_durable(old, out);  // put the old one back
      throw;
    }
  } else {
    fail(out.string(), ": cannot replace it with ", built.string(), ": ", std::strerror(errno));
  }
  // Checked again: a file that appeared in the old output since the caller's check stays.
  if (const std::string name = first_unowned(old, owned); !name.empty()) {
    std::fprintf(stderr, "depthkit: the replaced %s is kept as %s: '%s' appeared in it meanwhile\n", out.c_str(),
                 old.c_str(), printable(name).c_str());
    return;
  }
  fs::remove_all(old, ec);
}

TemporaryDirectory::~TemporaryDirectory() {
  std::error_code ec;
  if (!dir_.empty()) fs::remove_all(dir_, ec);
}

std::string path_kind(const fs::path& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  switch (st.type()) {
    case fs::file_type::regular: return "a regular file";
    case fs::file_type::directory: return "a directory";
    case fs::file_type::fifo: return "a FIFO";
    case fs::file_type::socket: return "a socket";
    case fs::file_type::character: return "a character device";
    case fs::file_type::block: return "a block device";
    case fs::file_type::not_found:
      return fs::is_symlink(fs::symlink_status(path, ec)) ? "a symbolic link to nothing" : "nothing";
    default: return "an unreadable entry";
  }
}

void require_directory(const fs::path& path, const std::string& role) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return;
  const std::string kind = path_kind(path);
  if (kind == "nothing") fail(path.string(), ": not found (expected ", role, ")");
  fail(path.string(), ": is ", kind, ", not ", role);
}

namespace {

// The PID holding a flock on the file `st` names, from /proc/locks ("1: FLOCK ADVISORY WRITE <pid>
// <major>:<minor>:<inode> 0 EOF", major and minor in hex); 0 if none is listed.
long flock_holder(const struct stat& st) {
  std::ifstream locks("/proc/locks");
  for (std::string line; std::getline(locks, line);) {
    std::istringstream in(line);
    std::string id, kind, mode, access, device;
    long pid = 0;
    if (!(in >> id >> kind >> mode >> access >> pid >> device) || kind != "FLOCK") continue;
    unsigned major_id = 0, minor_id = 0;
    unsigned long inode = 0;
    if (std::sscanf(device.c_str(), "%x:%x:%lu", &major_id, &minor_id, &inode) == 3 && inode == st.st_ino &&
        major_id == major(st.st_dev) && minor_id == minor(st.st_dev))
      return pid;
  }
  return 0;
}

}  // namespace

DirectoryLock::DirectoryLock(const fs::path& dir) {
  fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) fail(dir.string(), ": cannot open the directory to lock it: ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) return;
  const int err = errno;
  struct stat st {};
  ::fstat(fd_, &st);
  ::close(fd_);
  fd_ = -1;
  if (err != EWOULDBLOCK) fail(dir.string(), ": cannot lock: ", std::strerror(err));
  const long pid = flock_holder(st);
  fail(dir.string(), ": in use by another run (process ", pid > 0 ? std::to_string(pid) : "unknown",
       " holds its lock); wait for it to finish or choose another --run-dir");
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor releases the lock
}

}  // namespace depthkit
