// Token shards in the llm.c / modded-nanogpt `.bin` format, so that shards prepared by those
// tools (e.g. FineWeb-Edu) train here too:
//   header: 256 × int32 little-endian: [0] magic, [1] version, [2] token count, rest zero;
//   body:   token ids, uint16 (magic 20240520, version 1, the GPT-2 layout), or
//           uint32 (magic 20240801, version 7, llm.c's layout for vocabularies over 65,536).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace depthkit {

constexpr int32_t kShardMagicU16 = 20240520;
constexpr int32_t kShardVersionU16 = 1;
constexpr int32_t kShardMagicU32 = 20240801;
constexpr int32_t kShardVersionU32 = 7;
constexpr int64_t kShardHeaderBytes = 256 * 4;

// Writes a shard atomically with 2-byte tokens if every id < 65,536 would fit `vocab_size`,
// else 4-byte tokens.
void write_shard(const std::string& path, const std::vector<uint32_t>& tokens, int64_t vocab_size);

// One shard written as its tokens arrive, so that memory does not hold it: the tokens go to a
// temporary beside `path` ("<path>.tmp-XXXXXX"); commit() writes the header's count, fsyncs and
// renames it into place, so a shard is visible only complete. Destroyed before commit() (an
// error, an exception's unwinding), it removes the temporary.
class ShardWriter {
 public:
  ShardWriter(std::string path, int64_t vocab_size);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;
  void append(const uint32_t* ids, size_t count);
  int64_t size() const { return tokens_; }
  const std::string& path() const { return path_; }
  void commit();

 private:
  void flush();
  std::string path_, tmp_;
  int fd_ = -1;
  int64_t vocab_size_;
  bool wide_;
  int64_t tokens_ = 0;
  std::string buffer_;
};

// A read-only shard. Opening validates the header and the file size. Tokens are read with
// pread(2), not through a memory map: a shard that shrinks or is rewritten while a run reads it
// then fails with a message naming it, where a mapped page past the new end would kill the
// process with SIGBUS.
class Shard {
 public:
  explicit Shard(const std::string& path);
  ~Shard();
  Shard(Shard&& o) noexcept;
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;
  Shard& operator=(Shard&&) = delete;

  int64_t size() const { return tokens_; }
  int token_bytes() const { return token_bytes_; }
  const std::string& path() const { return path_; }
  // Tokens [start, start + count) into dst. Throws, naming the shard, if the file no longer
  // holds them (it was truncated or replaced since it was opened).
  void read(int64_t start, int64_t count, uint32_t* dst) const;

 private:
  std::string path_;
  int fd_ = -1;
  int64_t tokens_ = 0;
  int token_bytes_ = 2;
};

std::vector<uint32_t> read_shard(const std::string& path);

}  // namespace depthkit
