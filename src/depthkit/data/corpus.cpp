#include "depthkit/data/corpus.h"

#include <fcntl.h>
#include <glob.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>

#include "depthkit/data/utf8.h"
#include "depthkit/util/error.h"
#include "depthkit/util/fs.h"

#ifdef DEPTHKIT_WITH_ARROW
#include <arrow/array.h>
#include <arrow/io/file.h>
#include <arrow/record_batch.h>
#include <parquet/arrow/reader.h>
#include <parquet/exception.h>
#include <parquet/file_reader.h>
#include <parquet/properties.h>
#endif

namespace depthkit {

namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The format by name: [name].jsonl[.gz|.zst], [name].parquet, anything else text ([.gz|.zst]).
void classify(CorpusFile& f) {
  std::string name = f.path.filename().string();
  if (ends_with(name, ".gz")) {
    f.compression = Compression::gzip;
    name.resize(name.size() - 3);
  } else if (ends_with(name, ".zst")) {
    f.compression = Compression::zstd;
    name.resize(name.size() - 4);
  }
  if (ends_with(name, ".jsonl")) f.format = CorpusFormat::jsonl;
  else if (ends_with(name, ".parquet") && f.compression == Compression::none) f.format = CorpusFormat::parquet;
  else f.format = CorpusFormat::text;
}

bool has_glob_characters(const std::string& s) { return s.find_first_of("*?[") != std::string::npos; }

}  // namespace

std::vector<CorpusFile> list_corpus_files(const std::vector<std::string>& inputs) {
  std::vector<CorpusFile> files;
  std::map<fs::path, std::string> seen;  // canonical path → the input that named it
  auto add = [&](const fs::path& path, const std::string& key, const std::string& input) {
    const fs::path canonical = fs::canonical(path);
    if (auto [it, fresh] = seen.emplace(canonical, input); !fresh)
      fail(path.string(), ": named twice (by --input '", it->second, "' and by '", input,
           "'); each file is read once: drop one of them");
    CorpusFile f;
    f.path = path;
    f.key = key;
    f.bytes = fs::file_size(path);
    classify(f);
    files.push_back(std::move(f));
  };
  auto add_directory = [&](const fs::path& dir, const std::string& input) {
    std::vector<fs::path> found;
    for (auto it = fs::recursive_directory_iterator(dir); it != fs::recursive_directory_iterator(); ++it) {
      const fs::directory_entry& e = *it;
      if (e.is_symlink() && e.is_directory())
        fail(e.path().string(), ": a symbolic link to a directory inside --input '", input,
             "' (not followed; name it as an --input of its own)");
      if (e.is_directory()) continue;
      if (!e.is_regular_file())
        fail(e.path().string(), ": is ", path_kind(e.path()), " inside --input '", input,
             "', not a document file (data prepare reads regular files; remove it, or name the files to read)");
      found.push_back(e.path());
    }
    if (found.empty()) fail(input, ": input directory holds no files");
    std::sort(found.begin(), found.end());
    for (const fs::path& p : found) add(p, fs::relative(p, dir).generic_string(), input);
  };
  auto add_input = [&](const fs::path& path, const std::string& input) {
    std::error_code ec;
    if (fs::is_regular_file(path, ec)) add(path, path.filename().string(), input);
    else if (fs::is_directory(path, ec)) add_directory(path, input);
    else {
      const std::string kind = path_kind(path);
      if (kind == "nothing") fail(path.string(), ": input not found");
      fail(path.string(), ": is ", kind, ", not a document file or a directory of them");
    }
  };
  for (const auto& in : inputs) {
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(in, ec)) && has_glob_characters(in)) {
      glob_t g{};
      const int rc = ::glob(in.c_str(), GLOB_ERR, nullptr, &g);
      std::vector<std::string> matches(g.gl_pathv, g.gl_pathv + g.gl_pathc);
      ::globfree(&g);
      if (rc == GLOB_NOMATCH) fail("--input '", in, "': the pattern matches no file");
      if (rc != 0) fail("--input '", in, "': cannot expand the pattern (a directory on its way is unreadable)");
      std::sort(matches.begin(), matches.end());
      for (const auto& m : matches) add_input(m, in);
    } else {
      add_input(in, in);
    }
  }
  if (files.empty()) fail("data prepare: no --input given");
  return files;
}

namespace {

// A file's bytes, decompressed where it is compressed.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Up to n bytes into dst; 0 at the end. Fails naming the file on a read or decompression error.
  virtual size_t read(char* dst, size_t n) = 0;
  virtual uintmax_t position() const = 0;
};

class PlainSource : public ByteSource {
 public:
  explicit PlainSource(const fs::path& path) : path_(path.string()) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) fail(path_, ": cannot open: ", std::strerror(errno));
  }
  ~PlainSource() override { ::close(fd_); }
  size_t read(char* dst, size_t n) override {
    for (;;) {
      const ssize_t got = ::read(fd_, dst, n);
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) fail(path_, ": read failed: ", std::strerror(errno));
      position_ += uintmax_t(got);
      return size_t(got);
    }
  }
  uintmax_t position() const override { return position_; }

 private:
  std::string path_;
  int fd_ = -1;
  uintmax_t position_ = 0;
};

class GzipSource : public ByteSource {
 public:
  explicit GzipSource(const fs::path& path) : path_(path.string()) {
    gz_ = ::gzopen(path_.c_str(), "rb");
    if (!gz_) fail(path_, ": cannot open: ", std::strerror(errno));
    ::gzbuffer(gz_, 1 << 18);
  }
  ~GzipSource() override { ::gzclose(gz_); }
  size_t read(char* dst, size_t n) override {
    const int got = ::gzread(gz_, dst, unsigned(std::min<size_t>(n, 1u << 30)));
    int err = Z_OK;
    const char* msg = ::gzerror(gz_, &err);
    if (got < 0 || (err != Z_OK && err != Z_STREAM_END))
      fail(path_, ": not a valid gzip file (", msg ? msg : "read error", ") after ", ::gzoffset(gz_),
           " compressed bytes");
    return size_t(got);
  }
  uintmax_t position() const override { return uintmax_t(::gzoffset(gz_)); }

 private:
  std::string path_;
  gzFile gz_ = nullptr;
};

class ZstdSource : public ByteSource {
 public:
  explicit ZstdSource(const fs::path& path) : file_(path), path_(path.string()), in_(ZSTD_DStreamInSize()) {
    dctx_ = ZSTD_createDCtx();
    if (!dctx_) fail(path.string(), ": cannot start zstd decompression");
  }
  ~ZstdSource() override { ZSTD_freeDCtx(dctx_); }
  size_t read(char* dst, size_t n) override {
    ZSTD_outBuffer out{dst, n, 0};
    while (out.pos == 0) {
      if (buffer_.pos == buffer_.size) {
        const size_t got = file_.read(in_.data(), in_.size());
        if (got == 0) {
          if (!frame_done_)
            fail(path(), ": truncated zstd file (the last frame ends early, after ", file_.position(), " bytes)");
          return 0;
        }
        buffer_ = {in_.data(), got, 0};
      }
      const size_t rc = ZSTD_decompressStream(dctx_, &out, &buffer_);
      if (ZSTD_isError(rc))
        fail(path(), ": not a valid zstd file (", ZSTD_getErrorName(rc), ") after ", file_.position(),
             " compressed bytes");
      frame_done_ = rc == 0;
    }
    return out.pos;
  }
  uintmax_t position() const override { return file_.position(); }

 private:
  const std::string& path() const { return path_; }
  PlainSource file_;
  std::string path_;
  std::vector<char> in_;
  ZSTD_inBuffer buffer_{nullptr, 0, 0};
  ZSTD_DCtx* dctx_ = nullptr;
  bool frame_done_ = true;
};

std::unique_ptr<ByteSource> open_bytes(const CorpusFile& f) {
  switch (f.compression) {
    case Compression::gzip: return std::make_unique<GzipSource>(f.path);
    case Compression::zstd: return std::make_unique<ZstdSource>(f.path);
    case Compression::none: break;
  }
  return std::make_unique<PlainSource>(f.path);
}

std::string too_long(const CorpusFile& f, const std::string& where) {
  return cat(f.path.string(), where, ": longer than ", kMaxDocumentBytes >> 20,
             " MiB; data prepare holds each document in memory whole (split it)");
}

// A reader of a file's (decompressed) bytes: JSONL lines, or a text file whole.
class ByteRecordReader : public RecordReader {
 public:
  ByteRecordReader(const CorpusFile& f, uint32_t index) : file_(f), index_(index), source_(open_bytes(f)) {}
  uintmax_t position() const override { return source_->position(); }

 protected:
  const CorpusFile& file_;
  uint32_t index_;
  std::unique_ptr<ByteSource> source_;
};

// JSONL: one record a line. "\r\n" endings are taken as "\n".
class LineReader : public ByteRecordReader {
 public:
  LineReader(const CorpusFile& f, uint32_t index) : ByteRecordReader(f, index), buffer_(1 << 20) {}
  bool next(Record& r) override {
    r.file = index_;
    r.is_null = false;
    r.bytes.clear();
    for (;;) {
      if (pos_ == end_) {
        end_ = source_->read(buffer_.data(), buffer_.size());
        pos_ = 0;
        if (end_ == 0) {
          if (r.bytes.empty() && !partial_) return false;
          partial_ = false;
          break;  // the last line, without a newline
        }
      }
      const char* start = buffer_.data() + pos_;
      const void* nl = std::memchr(start, '\n', end_ - pos_);
      const size_t take = nl ? size_t(static_cast<const char*>(nl) - start) : end_ - pos_;
      if (r.bytes.size() + take > kMaxDocumentBytes) fail(too_long(file_, cat(" line ", line_ + 1)));
      r.bytes.append(start, take);
      pos_ += take;
      partial_ = true;
      if (nl) {
        ++pos_;
        partial_ = false;
        break;
      }
    }
    if (!r.bytes.empty() && r.bytes.back() == '\r') r.bytes.pop_back();
    r.row = ++line_;
    return true;
  }

 private:
  std::vector<char> buffer_;
  size_t pos_ = 0, end_ = 0;
  int64_t line_ = 0;
  bool partial_ = false;
};

// A text file: one record, the whole file.
class WholeFileReader : public ByteRecordReader {
 public:
  using ByteRecordReader::ByteRecordReader;
  bool next(Record& r) override {
    if (done_) return false;
    done_ = true;
    r.file = index_;
    r.row = 0;
    r.is_null = false;
    r.bytes.clear();
    char buf[1 << 16];
    while (size_t got = source_->read(buf, sizeof buf)) {
      if (r.bytes.size() + got > kMaxDocumentBytes) fail(too_long(file_, ""));
      r.bytes.append(buf, got);
    }
    return true;
  }

 private:
  bool done_ = false;
};

#ifdef DEPTHKIT_WITH_ARROW
// A parquet file, the --text-key column, row group by row group in batches of rows: memory holds
// one batch of the column (and the pages it is decoded from), never the file.
class ParquetReader : public RecordReader {
 public:
  ParquetReader(const CorpusFile& f, uint32_t index, const std::string& text_key) : file_(f), index_(index) {
    const std::string path = f.path.string();
    try {
      parquet::ReaderProperties props = parquet::default_reader_properties();
      props.enable_buffered_stream();  // read pages as they are decoded, not whole column chunks
      props.set_buffer_size(1 << 20);
      parquet::ArrowReaderProperties arrow_props;
      arrow_props.set_batch_size(1024);
      arrow_props.set_pre_buffer(false);
      parquet::arrow::FileReaderBuilder builder;
      check(builder.OpenFile(path, false, props), "cannot read it as parquet");
      builder.properties(arrow_props);
      auto reader = builder.Build();
      check(reader.status(), "cannot read it as parquet");
      reader_ = std::move(*reader);
      std::shared_ptr<arrow::Schema> schema;
      check(reader_->GetSchema(&schema), "cannot read its schema");
      const int column = schema->GetFieldIndex(text_key);
      if (column < 0) {
        std::string names;
        for (const auto& field : schema->fields()) names += (names.empty() ? "" : ", ") + field->name();
        fail(path, ": no column '", text_key, "' (--text-key); its columns: ", names);
      }
      const auto type = schema->field(column)->type()->id();
      if (type != arrow::Type::STRING && type != arrow::Type::LARGE_STRING && type != arrow::Type::STRING_VIEW)
        fail(path, ": column '", text_key, "' holds ", schema->field(column)->type()->ToString(),
             ", not strings (--text-key names the text column)");
      const int groups = reader_->num_row_groups();
      std::vector<int> all(groups);
      for (int g = 0; g < groups; ++g) all[g] = g;
      // Progress: the compressed bytes of the row groups finished (the file's metadata knows them).
      auto meta = reader_->parquet_reader()->metadata();
      for (int g = 0; g < groups; ++g) group_bytes_.push_back(uintmax_t(meta->RowGroup(g)->total_compressed_size()));
      for (int g = 0; g < groups; ++g) group_rows_.push_back(meta->RowGroup(g)->num_rows());
      auto batches = reader_->GetRecordBatchReader(all, {column});
      check(batches.status(), "cannot read its rows");
      batches_ = std::move(*batches);
    } catch (const parquet::ParquetException& e) {
      fail(path, ": cannot read it as parquet: ", one_line(e));
    }
  }
  bool next(Record& r) override {
    try {
      while (!batch_ || at_ >= batch_->num_rows()) {
        std::shared_ptr<arrow::RecordBatch> b;
        check(batches_->ReadNext(&b), "a row group is unreadable");
        if (!b) return false;
        batch_ = b;
        column_ = b->column(0);
        at_ = 0;
      }
    } catch (const parquet::ParquetException& e) {
      fail(file_.path.string(), ": a row group is unreadable: ", one_line(e));
    }
    r.file = index_;
    r.row = row_++;
    r.is_null = column_->IsNull(at_);
    std::string_view v;
    if (!r.is_null) {
      switch (column_->type_id()) {
        case arrow::Type::STRING: v = static_cast<const arrow::StringArray&>(*column_).GetView(at_); break;
        case arrow::Type::LARGE_STRING: v = static_cast<const arrow::LargeStringArray&>(*column_).GetView(at_); break;
        default: v = static_cast<const arrow::StringViewArray&>(*column_).GetView(at_); break;
      }
    }
    if (v.size() > kMaxDocumentBytes) fail(too_long(file_, cat(" row ", r.row)));
    r.bytes.assign(v.data(), v.size());
    ++at_;
    return true;
  }
  uintmax_t position() const override {
    uintmax_t done = 0;
    int64_t rows = 0;
    for (size_t g = 0; g < group_rows_.size() && rows + group_rows_[g] <= row_; ++g) {
      rows += group_rows_[g];
      done += group_bytes_[g];
    }
    return std::min(done, file_.bytes);
  }

 private:
  void check(const arrow::Status& s, const char* what) const {
    if (!s.ok()) fail(file_.path.string(), ": ", what, ": ", printable(s.ToString()));
  }
  const CorpusFile& file_;
  uint32_t index_;
  std::unique_ptr<parquet::arrow::FileReader> reader_;
  std::unique_ptr<arrow::RecordBatchReader> batches_;
  std::shared_ptr<arrow::RecordBatch> batch_;
  std::shared_ptr<arrow::Array> column_;
  int64_t at_ = 0, row_ = 0;
  std::vector<uintmax_t> group_bytes_;
  std::vector<int64_t> group_rows_;
};
#endif

}  // namespace

bool parquet_supported() {
#ifdef DEPTHKIT_WITH_ARROW
  return true;
#else
  return false;
#endif
}

std::unique_ptr<RecordReader> open_records(const CorpusFile& file, uint32_t index, const std::string& text_key) {
  switch (file.format) {
    case CorpusFormat::jsonl: return std::make_unique<LineReader>(file, index);
    case CorpusFormat::text: return std::make_unique<WholeFileReader>(file, index);
    case CorpusFormat::parquet:
#ifdef DEPTHKIT_WITH_ARROW
      return std::make_unique<ParquetReader>(file, index, text_key);
#else
      (void)text_key;
      fail(file.path.string(), ": this depthkit was built without parquet support (CMake found no pyarrow with "
           "Arrow's C++ libraries; scripts/setup installs pyarrow, then rebuild)");
#endif
  }
  fail(file.path.string(), ": unknown format");
}

std::string record_location(const CorpusFile& file, const Record& record) {
  switch (file.format) {
    case CorpusFormat::jsonl: return cat(file.path.string(), " line ", record.row);
    case CorpusFormat::parquet: return cat(file.path.string(), " row ", record.row);
    case CorpusFormat::text: break;
  }
  return file.path.string();
}

bool document_text(const CorpusFile& file, Record& record, const std::string& text_key, std::string& text,
                   std::string& why) {
  size_t bad = 0;
  if (file.format == CorpusFormat::jsonl) {
    // nlohmann's parser checks the UTF-8 of every string (and refuses lone surrogate escapes).
    nlohmann::json j = nlohmann::json::parse(record.bytes, nullptr, false);
    if (j.is_discarded()) {
      why = record.bytes.empty() ? "an empty line, not a JSON object" : "not valid JSON (or not valid UTF-8)";
      return false;
    }
    if (!j.is_object()) {
      why = cat("a JSON ", j.type_name(), ", not an object");
      return false;
    }
    auto it = j.find(text_key);
    if (it == j.end()) {
      why = cat("no field \"", printable(text_key), "\" (--text-key)");
      return false;
    }
    if (!it->is_string()) {
      why = cat("field \"", printable(text_key), "\" is ", it->is_null() ? "null" : cat("a ", it->type_name()),
                ", not a string");
      return false;
    }
    text = std::move(it->get_ref<std::string&>());
    return true;
  }
  if (record.is_null) {
    why = cat("column \"", printable(text_key), "\" is null");
    return false;
  }
  if (!valid_utf8(record.bytes, &bad)) {
    why = cat("invalid UTF-8 at byte ", bad);
    return false;
  }
  text = std::move(record.bytes);
  return true;
}

}  // namespace depthkit
