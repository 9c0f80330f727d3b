// A training run's JSON-lines log: one object per step, written and flushed at once and checked, that a
// resumed run continues from its step; records are built without a JSON library in the caller's code.
//   tg::train::JsonLinesLog log("run.jsonl", /*resume_step=*/0, tg::train::OnLogError::stop);
//   log.write(step, tg::train::LogRecord().add("step", step).add("loss", loss).add("lr", lr));
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace tg::train {

/// One log line's fields, in the order they are added (written as a JSON object by JsonLinesLog; the
/// first field of a step's line is "step"). Non-finite numbers are written as null.
class LogRecord {
 public:
  using Value = std::variant<std::int64_t, double, std::string, bool>;
  LogRecord& add(std::string key, std::int64_t v) { return put(std::move(key), Value(v)); }
  LogRecord& add(std::string key, int v) { return put(std::move(key), Value(static_cast<std::int64_t>(v))); }
  LogRecord& add(std::string key, double v) { return put(std::move(key), Value(v)); }
  LogRecord& add(std::string key, float v) { return put(std::move(key), Value(static_cast<double>(v))); }
  LogRecord& add(std::string key, std::string v) { return put(std::move(key), Value(std::move(v))); }
  LogRecord& add(std::string key, const char* v) { return put(std::move(key), Value(std::string(v))); }
  LogRecord& add(std::string key, bool v) { return put(std::move(key), Value(v)); }
  const std::vector<std::pair<std::string, Value>>& fields() const { return fields_; }
  /// The record as one line of JSON (no newline).
  std::string json() const;

 private:
  LogRecord& put(std::string key, Value v);
  std::vector<std::pair<std::string, Value>> fields_;
};

/// What a failed write does: throw (stop the run) or warn once on stderr and end the log.
enum class OnLogError { stop, warn };

// Note [the run log]
// A run's log is JSON lines: one object per step, whose first field is "step". Each line is written,
// flushed and checked at once: a failed write (a full disk, /dev/full) throws a tg::Error naming the file
// and the step, or, under OnLogError::warn, is reported once on stderr and ends the logging while the
// run goes on. A resumed run (resume_step > 0) keeps the lines of steps up to resume_step and continues
// after them: lines of later steps, written by the interrupted run after its last checkpoint, are dropped
// (the resumed run writes them anew), by rewriting the file through a temporary and a rename. Lines that
// are not a JSON object with an integer "step" are dropped too.
class JsonLinesLog {
 public:
  JsonLinesLog() = default;
  /// An empty `path` makes a closed log (write() does nothing). `flag` names the option in errors ("--log").
  JsonLinesLog(std::string path, std::int64_t resume_step, OnLogError on_error, std::string flag = "--log");
  JsonLinesLog(const JsonLinesLog&) = delete;
  JsonLinesLog& operator=(const JsonLinesLog&) = delete;
  ~JsonLinesLog();
  bool is_open() const { return f_ != nullptr; }
  const std::string& path() const { return path_; }

  /// Writes `record` as one line for `step` (Note [the run log]).
  void write(std::int64_t step, const LogRecord& record);

 private:
  void keep_lines_up_to(std::int64_t step);
  std::string path_, flag_;
  OnLogError on_error_ = OnLogError::stop;
  std::FILE* f_ = nullptr;
};

}  // namespace tg::train
