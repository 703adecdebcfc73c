// Crash-safe file output: every file depthkit writes goes to a temporary name, is fsynced,
// then renamed into place, so a reader never sees a half-written file.
#pragma once
#include <filesystem>
#include <string>
#include <string_view>

namespace depthkit {

namespace fs = std::filesystem;

// Writes `bytes` to `path` atomically (temp file in the same directory, fsync, rename, fsync dir).
void write_file_atomic(const fs::path& path, std::string_view bytes);
// Renames `from` over `to` and fsyncs the parent directory.
void rename_durable(const fs::path& from, const fs::path& to);
void fsync_path(const fs::path& path);
std::string read_file(const fs::path& path);

}  // namespace depthkit
