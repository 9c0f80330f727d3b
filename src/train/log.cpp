// The run log (include/typegrad/train/log.hpp, Note [the run log]): records serialized with nlohmann_json.
#include "typegrad/train/log.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "typegrad/core/error.hpp"

namespace tg::train {

LogRecord& LogRecord::put(std::string key, Value v) {
  for (auto& [k, old] : fields_)
    if (k == key) {
      old = std::move(v);
      return *this;
    }
  fields_.emplace_back(std::move(key), std::move(v));
  return *this;
}

std::string LogRecord::json() const {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  for (const auto& [key, value] : fields_)
    std::visit(
        [&](const auto& v) {
          using V = std::decay_t<decltype(v)>;
          if constexpr (std::is_same_v<V, double>) {
            if (std::isfinite(v)) j[key] = v;
            else j[key] = nullptr;  // JSON has no NaN or infinity
          } else {
            j[key] = v;
          }
        },
        value);
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

JsonLinesLog::JsonLinesLog(std::string path, std::int64_t resume_step, OnLogError on_error, std::string flag)
    : path_(std::move(path)), flag_(std::move(flag)), on_error_(on_error) {
  if (path_.empty()) return;
  if (resume_step > 0) keep_lines_up_to(resume_step);
  f_ = std::fopen(path_.c_str(), resume_step > 0 ? "a" : "w");
  if (!f_) throw Error(flag_, ": cannot open '", path_, "' for writing: ", std::strerror(errno));
}

JsonLinesLog::~JsonLinesLog() {
  if (f_) std::fclose(f_);
}

void JsonLinesLog::write(std::int64_t step, const LogRecord& record) {
  if (!f_) return;
  const std::string line = record.json();
  const bool ok = std::fputs(line.c_str(), f_) >= 0 && std::fputc('\n', f_) != EOF && std::fflush(f_) == 0;
  if (ok) return;
  const std::string why = std::strerror(errno);
  std::fclose(f_);
  f_ = nullptr;
  if (on_error_ == OnLogError::stop)
    throw Error(flag_, ": writing '", path_, "' failed at step ", step, ": ", why, " (", flag_,
                "-errors warn keeps training without the log)");
  std::fprintf(stderr, "\nwarning: %s: writing '%s' failed at step %lld: %s; the log ends here, training goes on\n",
               flag_.c_str(), path_.c_str(), static_cast<long long>(step), why.c_str());
}

void JsonLinesLog::keep_lines_up_to(std::int64_t step) {
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return;  // no log yet (or a device): append
  std::ifstream in(path_);
  if (!in) throw Error(flag_, ": cannot read '", path_, "' to continue it: ", std::strerror(errno));
  std::string kept, line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;
    const auto it = j.find("step");
    if (it == j.end() || !it->is_number_integer() || it->get<std::int64_t>() > step) continue;
    kept += line;
    kept += '\n';
  }
  const std::string tmp = path_ + ".tmp-" + std::to_string(::getpid());
  std::FILE* out = std::fopen(tmp.c_str(), "w");
  if (!out) throw Error(flag_, ": cannot rewrite '", path_, "' for the resumed run: ", std::strerror(errno));
  const bool ok = std::fwrite(kept.data(), 1, kept.size(), out) == kept.size() && std::fflush(out) == 0;
  const int err = errno;
  std::fclose(out);
  if (!ok || std::rename(tmp.c_str(), path_.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw Error(flag_, ": cannot rewrite '", path_, "' for the resumed run: ", std::strerror(ok ? errno : err));
  }
}

}  // namespace tg::train
