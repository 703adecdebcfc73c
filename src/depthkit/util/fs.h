// Crash-safe file output: every file depthkit writes goes to a temporary name, is fsynced,
// then renamed into place, so a reader never sees a half-written file.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace depthkit {

namespace fs = std::filesystem;

// A file written in pieces that appears at `path`, complete, only at commit(): the pieces go to a
// temporary in the same directory, which commit() fsyncs and renames into place. Destroyed before
// commit() (an error, an exception's unwinding), it removes the temporary and leaves `path` as it was.
class AtomicFile {
 public:
  explicit AtomicFile(const fs::path& path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(std::string_view bytes);
  void commit();

 private:
  fs::path path_, tmp_;
  int fd_ = -1;
};

// Writes `bytes` to `path` atomically (temp file in the same directory, fsync, rename, fsync dir).
void write_file_atomic(const fs::path& path, std::string_view bytes);
// Renames `from` over `to` and fsyncs the parent directory.
void rename_durable(const fs::path& from, const fs::path& to);
void fsync_path(const fs::path& path);
// Reads a whole regular file. A directory, a device (/dev/zero), a FIFO or a file over
// `max_bytes` is refused with a message naming the path, before anything is read.
constexpr uintmax_t kMaxReadBytes = uintmax_t(1) << 30;
std::string read_file(const fs::path& path, uintmax_t max_bytes = kMaxReadBytes);
// The size of a regular file, with the same checks as read_file (`what` names its role).
uintmax_t regular_file_size(const fs::path& path, uintmax_t max_bytes = UINTMAX_MAX);

// What is at `path`, for messages: "a regular file", "a directory", "a FIFO", "a socket", "a
// character device", "a block device", "a symbolic link to nothing", or "nothing".
std::string path_kind(const fs::path& path);
// Refuses anything but an existing directory at `path`, in one line naming it and what is there
// instead; `role` is what it should be ("a run directory").
void require_directory(const fs::path& path, const std::string& role);

// Whether `inner` is `outer` or lies below it, by their absolute, normalised paths (symbolic
// links resolved where they exist).
bool is_within(const fs::path& inner, const fs::path& outer);

// Replacing a directory depthkit wrote (--force) without touching anything else:
//
// An output directory as given to `option`, normalised ("out/" is "out"); ".", ".." and "/" are
// refused, since the output is replaced as a whole.
fs::path output_directory(const std::string& given, const std::string& option);
// A new, empty directory beside `path`, "<path>.<tag>-XXXXXX" (mkdtemp: a name nobody had), in
// which a replacement is built; its parent is created if need be.
fs::path make_sibling_dir(const fs::path& path, const std::string& tag);
// The names of the regular files a command writes into its output directory.
using OwnedNames = std::function<bool(const std::string&)>;
// Refuses, naming the first other entry, unless everything directly in the directory `dir` is a
// regular file whose name `owned` accepts: what a command's --force may remove is only what it
// wrote (`what` says what that is, for the message).
void check_only_owned(const fs::path& dir, const OwnedNames& owned, const std::string& what);
// Puts the finished directory `built` at `out`. An existing `out` (checked with check_only_owned
// by the caller) is swapped with `built` in one step (renameat2 RENAME_EXCHANGE), so a crash
// leaves one of the two at `out`; the old one is then checked again and removed, unless something
// not owned appeared in it meanwhile: then it is kept, and a line says where.
void replace_directory(const fs::path& built, const fs::path& out, const OwnedNames& owned);
// Removes a directory this process made (make_sibling_dir) when it goes out of scope, unless
// release() was called: a failed command leaves nothing half-written behind.
class TemporaryDirectory {
 public:
  explicit TemporaryDirectory(fs::path dir) : dir_(std::move(dir)) {}
  ~TemporaryDirectory();
  TemporaryDirectory(const TemporaryDirectory&) = delete;
  TemporaryDirectory& operator=(const TemporaryDirectory&) = delete;
  const fs::path& path() const { return dir_; }
  void release() { dir_.clear(); }

 private:
  fs::path dir_;
};

// An exclusive flock(2) on a directory for this object's life: one process at a time may own a
// run directory. The lock is on the directory itself, so taking it writes nothing there, and the
// kernel drops it when the process dies (kill -9 included). A second taker fails at once with a
// message naming the holder's PID (from /proc/locks).
class DirectoryLock {
 public:
  explicit DirectoryLock(const fs::path& dir);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace depthkit
