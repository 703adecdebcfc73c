#include "depthkit/data/shards.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

namespace depthkit {

void write_shard(const std::string& path, const std::vector<uint32_t>& tokens, int64_t vocab_size) {
  const bool wide = vocab_size > 65536;
  std::string bytes(kShardHeaderBytes, '\0');
  int32_t header[3] = {wide ? kShardMagicU32 : kShardMagicU16,
                       wide ? kShardVersionU32 : kShardVersionU16, 0};
  if (tokens.size() > size_t(INT32_MAX)) fail(path, ": a shard holds at most 2^31-1 tokens");
  header[2] = static_cast<int32_t>(tokens.size());
  std::memcpy(bytes.data(), header, sizeof header);
  const size_t width = wide ? 4 : 2;
  bytes.resize(kShardHeaderBytes + tokens.size() * width);
  char* body = bytes.data() + kShardHeaderBytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= uint64_t(vocab_size))
      fail(path, ": token id ", tokens[i], " at position ", i, " is >= vocab_size ", vocab_size);
    if (wide) std::memcpy(body + 4 * i, &tokens[i], 4);
    else {
      uint16_t t = static_cast<uint16_t>(tokens[i]);
      std::memcpy(body + 2 * i, &t, 2);
    }
  }
  write_file_atomic(path, bytes);
}

Shard::Shard(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) fail(path, ": cannot open shard: ", std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  const int64_t file_bytes = st.st_size;
  if (file_bytes < kShardHeaderBytes) {
    ::close(fd);
    fail(path, ": truncated shard: ", file_bytes, " bytes, smaller than the 1024-byte header");
  }
  map_bytes_ = static_cast<size_t>(file_bytes);
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    fail(path, ": mmap failed: ", std::strerror(errno));
  }
  int32_t header[3];
  std::memcpy(header, map_, sizeof header);
  auto bad = [&](const std::string& what) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    fail(path, ": ", what);
  };
  if (header[0] == kShardMagicU16) {
    token_bytes_ = 2;
    if (header[1] != kShardVersionU16)
      bad(cat("unsupported version ", header[1], " for magic ", kShardMagicU16, " (expected ", kShardVersionU16, ")"));
  } else if (header[0] == kShardMagicU32) {
    token_bytes_ = 4;
    if (header[1] != kShardVersionU32)
      bad(cat("unsupported version ", header[1], " for magic ", kShardMagicU32, " (expected ", kShardVersionU32, ")"));
  } else {
    bad(cat("wrong magic ", header[0], ": not an llm.c token shard (expected ", kShardMagicU16,
            " or ", kShardMagicU32, ")"));
  }
  if (header[2] < 0) bad(cat("negative token count ", header[2], " in header"));
  tokens_ = header[2];
  const int64_t expect = kShardHeaderBytes + tokens_ * token_bytes_;
  if (file_bytes < expect)
    bad(cat("truncated shard: header says ", tokens_, " tokens (", expect, " bytes) but the file has ", file_bytes, " bytes"));
  if (file_bytes > expect)
    bad(cat("wrong size: header says ", tokens_, " tokens (", expect, " bytes) but the file has ", file_bytes, " bytes"));
  body_ = static_cast<const char*>(map_) + kShardHeaderBytes;
  ::madvise(map_, map_bytes_, MADV_RANDOM);
}

Shard::Shard(Shard&& o) noexcept
    : path_(std::move(o.path_)), map_(o.map_), map_bytes_(o.map_bytes_), body_(o.body_),
      tokens_(o.tokens_), token_bytes_(o.token_bytes_) {
  o.map_ = nullptr;
}

Shard::~Shard() {
  if (map_) ::munmap(map_, map_bytes_);
}

std::vector<uint32_t> read_shard(const std::string& path) {
  Shard s(path);
  std::vector<uint32_t> out(s.size());
  for (int64_t i = 0; i < s.size(); ++i) out[i] = s[i];
  return out;
}

}  // namespace depthkit
