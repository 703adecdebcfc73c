#include "depthkit/data/shards.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
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

ShardWriter::ShardWriter(std::string path, int64_t vocab_size)
    : path_(std::move(path)), vocab_size_(vocab_size), wide_(vocab_size > 65536) {
  tmp_ = path_ + ".tmp-XXXXXX";
  fd_ = ::mkstemp(tmp_.data());
  if (fd_ < 0) fail(path_, ": cannot create its temporary: ", std::strerror(errno));
  ::fchmod(fd_, 0644);  // as every file depthkit writes (mkstemp makes it 0600)
  buffer_.assign(size_t(kShardHeaderBytes), '\0');  // the header, written again with the count at commit()
}

ShardWriter::~ShardWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void ShardWriter::append(const uint32_t* ids, size_t count) {
  if (tokens_ + int64_t(count) > int64_t(INT32_MAX)) fail(path_, ": a shard holds at most 2^31-1 tokens");
  const size_t width = wide_ ? 4 : 2;
  const size_t at = buffer_.size();
  buffer_.resize(at + count * width);
  char* body = buffer_.data() + at;
  for (size_t i = 0; i < count; ++i) {
    if (ids[i] >= uint64_t(vocab_size_))
      fail(path_, ": token id ", ids[i], " at position ", tokens_ + int64_t(i), " is >= vocab_size ", vocab_size_);
    if (wide_) std::memcpy(body + 4 * i, &ids[i], 4);
    else {
      const uint16_t t = static_cast<uint16_t>(ids[i]);
      std::memcpy(body + 2 * i, &t, 2);
    }
  }
  tokens_ += int64_t(count);
  if (buffer_.size() >= (size_t(4) << 20)) flush();
}

void ShardWriter::flush() {
  const char* p = buffer_.data();
  size_t left = buffer_.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path_, ": write failed: ", std::strerror(errno));
    p += n;
    left -= size_t(n);
  }
  buffer_.clear();
}

void ShardWriter::commit() {
  flush();
  const int32_t header[3] = {wide_ ? kShardMagicU32 : kShardMagicU16, wide_ ? kShardVersionU32 : kShardVersionU16,
                             static_cast<int32_t>(tokens_)};
  if (::pwrite(fd_, header, sizeof header, 0) != ssize_t(sizeof header))
    fail(path_, ": cannot write the header: ", std::strerror(errno));
  if (::fsync(fd_) != 0) fail(path_, ": fsync failed: ", std::strerror(errno));
  ::close(fd_);
  fd_ = -1;
  rename_durable(tmp_, path_);
}

namespace {

// Reads exactly `bytes` at `offset`; false if the file ends first.
bool pread_all(int fd, void* dst, size_t bytes, int64_t offset) {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    ssize_t n = ::pread(fd, p, bytes, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= size_t(n);
    offset += n;
  }
  return true;
}

}  // namespace

Shard::Shard(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open shard: ", std::strerror(errno));
  auto bad = [&](const std::string& what) {
    ::close(fd);
    fail(path, ": ", what);
  };
  struct stat st {};
  if (::fstat(fd, &st) != 0) bad(cat("cannot stat: ", std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) bad("not a regular file");
  const int64_t file_bytes = st.st_size;
  if (file_bytes < kShardHeaderBytes)
    bad(cat("truncated shard: ", file_bytes, " bytes, smaller than the 1024-byte header"));
  int32_t header[3];
  if (!pread_all(fd, header, sizeof header, 0)) bad("cannot read the header");
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
  fd_ = fd;
}

Shard::Shard(Shard&& o) noexcept
    : path_(std::move(o.path_)), fd_(o.fd_), tokens_(o.tokens_), token_bytes_(o.token_bytes_) {
  o.fd_ = -1;
}

Shard::~Shard() {
  if (fd_ >= 0) ::close(fd_);
}

void Shard::read(int64_t start, int64_t count, uint32_t* dst) const {
  if (start < 0 || count < 0 || start + count > tokens_)
    fail(path_, ": tokens [", start, ", ", start + count, ") outside the shard's ", tokens_);
  const int64_t offset = kShardHeaderBytes + start * token_bytes_;
  bool ok;
  if (token_bytes_ == 4) {
    ok = pread_all(fd_, dst, size_t(count) * 4, offset);
  } else {
    // Read the uint16 ids into the back half of dst, then widen in place from the front.
    auto* narrow = reinterpret_cast<uint16_t*>(dst + count) - count;
    ok = pread_all(fd_, narrow, size_t(count) * 2, offset);
    for (int64_t i = 0; ok && i < count; ++i) dst[i] = narrow[i];
  }
  if (!ok) {
    struct stat st {};
    ::fstat(fd_, &st);
    fail(path_, ": shard changed while in use: it now has ", int64_t(st.st_size), " bytes, ",
         kShardHeaderBytes + tokens_ * token_bytes_, " when opened (do not rewrite shards during a run)");
  }
}

std::vector<uint32_t> read_shard(const std::string& path) {
  Shard s(path);
  std::vector<uint32_t> out(s.size());
  s.read(0, s.size(), out.data());
  return out;
}

}  // namespace depthkit
