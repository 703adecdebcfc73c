// The documents of a corpus, as `depthkit data prepare` reads them: files named by --input (files,
// directories, glob patterns) in any mix of
//   - JSONL (.jsonl, .jsonl.gz, .jsonl.zst): one JSON object per line, the document is the string
//     field --text-key names;
//   - parquet (.parquet): one document per row, in the string column --text-key names (FineWeb's
//     layout), read with Apache Arrow's C++ library;
//   - anything else: plain text (also .gz or .zst compressed), the whole file one document.
// Records are read in order, one file after another, and checked later (on the tokenizing
// threads): a record is the raw bytes of a document, not yet known to be well formed.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace depthkit {

enum class CorpusFormat { text, jsonl, parquet };
enum class Compression { none, gzip, zstd };

struct CorpusFile {
  std::filesystem::path path;
  // The file's name relative to the --input that named it (a file named directly: its own name).
  // With a record's row it is what the train/val split hashes, so moving or renaming the corpus
  // folder, or adding files to it, never moves a document to the other split.
  std::string key;
  CorpusFormat format = CorpusFormat::text;
  Compression compression = Compression::none;
  uintmax_t bytes = 0;  // on disk (compressed)
};

// Every file the inputs name, each once, in order: inputs as given; a directory's regular files in
// path order; a pattern's matches (glob(3), for patterns the shell did not expand) in name order.
// Refused by name, never skipped: a FIFO, socket or device, a symbolic link to nothing, a link to a
// directory inside an input directory (not followed), a file reached twice, a pattern that matches
// nothing, an empty directory.
std::vector<CorpusFile> list_corpus_files(const std::vector<std::string>& inputs);

// The longest document data prepare holds: every document is in memory whole while it is encoded.
constexpr size_t kMaxDocumentBytes = size_t(256) << 20;

// One record: a JSONL line, a parquet value, a text file's contents.
struct Record {
  uint32_t file = 0;      // index into the list_corpus_files result
  int64_t row = 0;        // JSONL: the line number (1-based); parquet: the row (0-based); text: 0
  std::string bytes;      // the line, the value, the file's text
  bool is_null = false;   // parquet: a null value
};

// Reads one file's records in order. Errors that make the file unreadable (corrupt compression,
// a parquet file without the column) fail at once naming the file; a malformed record is returned
// as it is and judged by document_text.
class RecordReader {
 public:
  virtual ~RecordReader() = default;
  virtual bool next(Record& record) = 0;
  // Bytes of the file consumed so far (compressed bytes for compressed files): progress and ETA.
  virtual uintmax_t position() const = 0;
};

std::unique_ptr<RecordReader> open_records(const CorpusFile& file, uint32_t index, const std::string& text_key);

// The document in `record` (moved into `text`), or false with `why` saying what is wrong with it:
// not JSON, not an object, no such field, a field that is not a string, a null value, invalid UTF-8.
bool document_text(const CorpusFile& file, Record& record, const std::string& text_key, std::string& text,
                   std::string& why);

// "data/a.jsonl.gz line 17", "data/b.parquet row 3", "notes.txt": where a record is, for messages.
std::string record_location(const CorpusFile& file, const Record& record);

// Whether parquet files can be read: depthkit was built with Arrow (CMakeLists.txt, from pyarrow).
bool parquet_supported();

}  // namespace depthkit
