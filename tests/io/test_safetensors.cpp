// safetensors reader/writer, CRC32C, atomic writes, training-state files and hostile inputs: every broken
// file gives a tg::Error naming the file and the problem (these tests also run under ASan/UBSan).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "typegrad/io/train_state.hpp"
#include "typegrad/typegrad.hpp"
#include "typegrad/optim/optim.hpp"

namespace fs = std::filesystem;
using namespace tg;
using tg::io::SafetensorsReader;
using tg::io::SafetensorsWriter;

namespace {

fs::path tmp_dir() {
  static const fs::path d = [] {
    fs::path p = fs::temp_directory_path() / ("tg_safetensors_" + std::to_string(::getpid()));
    fs::remove_all(p);
    fs::create_directories(p);
    return p;
  }();
  return d;
}
std::string tmp_path(const std::string& name) { return (tmp_dir() / name).string(); }

struct RemoveTmpDir : ::testing::Environment {
  void TearDown() override { fs::remove_all(tmp_dir()); }
};
const auto* const kRemoveTmpDir = ::testing::AddGlobalTestEnvironment(new RemoveTmpDir);

void write_bytes(const std::string& path, const std::vector<std::uint8_t>& b) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}
std::vector<std::uint8_t> read_bytes(const std::string& path) { return io::read_file_bytes(path); }

/// A raw file: u64 length, header text, data bytes (for hand-made hostile files).
std::vector<std::uint8_t> raw_file(const std::string& header, std::size_t data_bytes, std::uint64_t len_override = ~0ull) {
  const std::uint64_t n = len_override == ~0ull ? header.size() : len_override;
  std::vector<std::uint8_t> out(8);
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(n >> (8 * i));
  out.insert(out.end(), header.begin(), header.end());
  for (std::size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<std::uint8_t>(i * 7 + 1));
  return out;
}

/// Expects opening `bytes` (written to a file) to throw a tg::Error naming the file and containing `problem`.
void expect_rejected(const std::vector<std::uint8_t>& bytes, const std::string& problem, const std::string& name) {
  const std::string path = tmp_path(name + ".safetensors");
  write_bytes(path, bytes);
  try {
    SafetensorsReader::open(path);
    ADD_FAILURE() << name << ": accepted, expected an error containing '" << problem << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << name << ": the message does not name the file: " << msg;
    EXPECT_NE(msg.find(problem), std::string::npos) << name << ": expected '" << problem << "' in: " << msg;
  }
}

template <class F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error, expected one containing '" << parts.front() << "'";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "expected '" << p << "' in: " << e.what();
  }
}

SafetensorsWriter sample_writer() {
  Generator g(3);
  SafetensorsWriter w;
  w.add("f64", Tensor<fp64>::from_values({2, 3}, {1.5, -2.25, 3.0, 1e300, -0.0, 7.0}));
  w.add("f32", Tensor<fp32>::normal({4, 5}, 0.f, 1.f, g));
  w.add("f16", Tensor<fp32>::normal({3}, 0.f, 1.f, g).to<fp16>());
  w.add("bf16", Tensor<fp32>::normal({2, 2, 2}, 0.f, 1.f, g).to<bf16>());
  w.add("i64", Tensor<std::int64_t>::from_vector({3}, {-1, 0, std::int64_t(1) << 40}));
  w.add("i32", Tensor<std::int32_t>::from_vector({2}, {-7, 123456}));
  w.add("u8", Tensor<std::uint8_t>::from_vector({5}, {0, 1, 2, 254, 255}));
  w.add("scalar", Tensor<fp32>::full({}, 42.0));
  w.add("empty", Tensor<fp32>::empty({0, 3}));
  w.set_metadata("format", "pt");
  w.set_metadata("note", "h\u00e9llo \"quoted\"");
  return w;
}

// ---- CRC32C -----------------------------------------------------------------------------------------
TEST(Crc32c, check_value_and_hardware_matches_table) {
  const std::string s = "123456789";
  EXPECT_EQ(io::crc32c(s.data(), s.size()), 0xE3069283u);
  EXPECT_EQ(io::detail::crc32c_portable(s.data(), s.size(), 0), 0xE3069283u);
  EXPECT_EQ(io::crc32c(nullptr, 0), 0u);
  std::mt19937 rng(5);
  std::vector<std::uint8_t> buf(1000);
  for (auto& b : buf) b = static_cast<std::uint8_t>(rng());
  for (std::size_t n = 0; n < 80; ++n)
    EXPECT_EQ(io::crc32c(buf.data() + 3, n), io::detail::crc32c_portable(buf.data() + 3, n, 0)) << "length " << n;
  // Incremental: crc(a ++ b) = crc(b, continuing from crc(a)).
  const std::uint32_t whole = io::crc32c(buf.data(), buf.size());
  EXPECT_EQ(io::crc32c(buf.data() + 333, buf.size() - 333, io::crc32c(buf.data(), 333)), whole);
  EXPECT_EQ(io::detail::crc32c_portable(buf.data() + 333, buf.size() - 333, io::detail::crc32c_portable(buf.data(), 333, 0)), whole);
  std::printf("[crc32c] hardware path %s\n", io::detail::crc32c_hardware_available() ? "used" : "unavailable (table only)");
}

// ---- round trips ------------------------------------------------------------------------------------
TEST(Safetensors, round_trip_every_dtype_and_metadata) {
  const SafetensorsWriter w = sample_writer();
  const auto bytes = w.serialize();
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[static_cast<std::size_t>(i)];
  EXPECT_EQ((8 + n) % 8, 0u) << "the data section starts 8-byte aligned";
  const std::string path = tmp_path("round_trip.safetensors");
  w.write(path);
  EXPECT_EQ(read_bytes(path), bytes);
  const auto r = SafetensorsReader::open(path);
  r.verify_checksums(true);
  EXPECT_EQ(r.tensors().size(), 9u);
  EXPECT_EQ(r.metadata_value("format"), "pt");
  EXPECT_EQ(r.metadata_value("note"), "h\u00e9llo \"quoted\"");
  EXPECT_EQ(r.get<fp64>("f64").to_vector(), (std::vector<double>{1.5, -2.25, 3.0, 1e300, -0.0, 7.0}));
  EXPECT_EQ(r.get<std::int64_t>("i64").to_vector(), (std::vector<std::int64_t>{-1, 0, std::int64_t(1) << 40}));
  EXPECT_EQ(r.get<std::int32_t>("i32").to_vector(), (std::vector<std::int32_t>{-7, 123456}));
  EXPECT_EQ(r.get<std::uint8_t>("u8").to_vector(), (std::vector<std::uint8_t>{0, 1, 2, 254, 255}));
  EXPECT_EQ(r.info("bf16").shape, (Shape{2, 2, 2}));
  EXPECT_EQ(r.info("bf16").dtype, DType::bf16);
  EXPECT_EQ(r.info("scalar").shape, Shape{});
  EXPECT_EQ(r.get<fp32>("scalar").item(), 42.f);
  EXPECT_EQ(r.info("empty").nbytes(), 0u);
  EXPECT_EQ(r.get<fp32>("empty").shape(), (Shape{0, 3}));
  Generator g(3);
  const auto f32 = Tensor<fp32>::normal({4, 5}, 0.f, 1.f, g);
  EXPECT_EQ(r.get<fp32>("f32").to_vector(), f32.to_vector());
  const auto f16 = r.get<fp16>("f16");
  const auto f16_ref = Tensor<fp32>::normal({3}, 0.f, 1.f, g).to<fp16>();
  for (int i = 0; i < 3; ++i) EXPECT_EQ(f16.data()[i].bits, f16_ref.data()[i].bits);
  // Conversion on read: bf16 -> fp32 is exact; f64 -> fp32 rounds.
  const auto bf = r.get<bf16>("bf16");
  const auto bf_as_f32 = r.get_converted<fp32>("bf16");
  for (int i = 0; i < 8; ++i) EXPECT_EQ(bf_as_f32.data()[i], static_cast<float>(bf.data()[i]));
  EXPECT_EQ(r.get_converted<fp32>("f64").data()[0], 1.5f);
  expect_error([&] { r.get<fp32>("bf16"); }, {path, "'bf16' has dtype BF16, expected F32"});
  expect_error([&] { r.get_converted<fp32>("i32"); }, {path, "'i32' has dtype I32, not a floating type"});
  expect_error([&] { r.info("nope"); }, {path, "no tensor named 'nope'"});
}

TEST(Safetensors, non_contiguous_tensor_is_written_in_row_major_order) {
  const auto t = Tensor<fp32>::from_values({2, 3}, {1, 2, 3, 4, 5, 6});
  SafetensorsWriter w;
  w.add("t", t.transpose(0, 1));
  const auto r = SafetensorsReader::parse(w.serialize(), "<memory>");
  EXPECT_EQ(r.get<fp32>("t").to_vector(), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  EXPECT_EQ(r.info("t").shape, (Shape{3, 2}));
}

TEST(Safetensors, writer_rejects_bad_input) {
  SafetensorsWriter w;
  w.add("a", Tensor<fp32>::zeros({2}));
  expect_error([&] { w.add("a", Tensor<fp32>::zeros({2})); }, {"tensor 'a' added twice"});
  expect_error([&] { w.add("__metadata__", Tensor<fp32>::zeros({2})); }, {"invalid tensor name"});
  expect_error([&] { w.add_bytes("b", DType::f32, {3}, std::vector<std::uint8_t>(10)); }, {"needs 12 bytes, got 10"});
  w.add("bad\xff", Tensor<fp32>::zeros({1}));
  expect_error([&] { w.serialize(); }, {"not valid UTF-8"});
}

TEST(AtomicWrite, replaces_the_file_and_leaves_no_temporary) {
  const fs::path d = tmp_dir() / "atomic";
  fs::create_directories(d);
  const std::string p = (d / "f.bin").string();
  const std::vector<std::uint8_t> a{1, 2, 3}, b{4, 5, 6, 7};
  io::write_file_atomic(p, a);
  io::write_file_atomic(p, b);
  EXPECT_EQ(read_bytes(p), b);
  int files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(d)) ++files;
  EXPECT_EQ(files, 1);
  expect_error([&] { io::write_file_atomic((d / "missing_dir" / "f.bin").string(), a); }, {"missing_dir/f.bin", "cannot create"});
  // An error inside the body removes the temporary and leaves the old file.
  expect_error([&] {
    io::write_file_atomic(p, [](const auto& sink) {
      sink("xx", 2);
      throw Error("body failed");
    });
  }, {"body failed"});
  EXPECT_EQ(read_bytes(p), b);
  files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(d)) ++files;
  EXPECT_EQ(files, 1);
}

// ---- hostile files ----------------------------------------------------------------------------------
const std::string kOne = R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";

TEST(SafetensorsHostile, each_structural_problem_is_named) {
  expect_rejected({}, "truncated file: 0 bytes", "empty");
  expect_rejected({1, 2, 3, 4, 5}, "truncated file: 5 bytes", "five_bytes");
  expect_rejected(raw_file(kOne, 16, std::uint64_t(200) << 20), "exceeds the maximum of 104857600", "oversized_header");
  expect_rejected(raw_file(kOne, 16, ~0ull - 1), "exceeds the maximum", "huge_header_length");
  expect_rejected(raw_file(kOne, 0, kOne.size() + 50), "truncated file: the header length is", "header_past_end");
  expect_rejected(raw_file("{}", 0, 1), "header length 1 is too small", "tiny_header");
  expect_rejected(raw_file("[1,2]", 0), "does not start with '{'", "array_header");
  expect_rejected(raw_file("{not json at all}", 0), "the header is not valid JSON", "not_json");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]})", 16), "not valid JSON", "unterminated");
  expect_rejected(raw_file(R"({"a":1})", 0), "tensor 'a': entry must be an object", "entry_not_object");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2,2]}})", 16), "needs dtype, shape and data_offsets", "missing_field");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16],"x":1}})", 16), "unknown field 'x'", "extra_field");
  expect_rejected(raw_file(R"({"a":{"dtype":"F8","shape":[2,2],"data_offsets":[0,4]}})", 4), "unsupported dtype 'F8'", "bad_dtype");
  expect_rejected(raw_file(R"({"a":{"dtype":3,"shape":[2,2],"data_offsets":[0,16]}})", 16), "dtype must be a string", "dtype_number");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]}})", 16), "shape[1] is negative", "negative_dim");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2,1.5],"data_offsets":[0,16]}})", 16), "must be a non-negative integer", "float_dim");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":"2x2","data_offsets":[0,16]}})", 16), "shape must be an array", "shape_string");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,4]}})", 4), "9 dimensions", "rank9");
  expect_rejected(raw_file(R"({"a":{"dtype":"F64","shape":[4611686018427387904,4],"data_offsets":[0,16]}})", 16), "overflows", "overflow");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", 12), "needs 16 bytes, data_offsets give 12", "size_mismatch");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}})", 16), "end before they begin", "reversed");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0]}})", 16), "array of two integers", "one_offset");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]}})", 16), "run past the end of the data", "out_of_range");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[18446744073709551600,18446744073709551616]}})", 16),
                  "", "offset_beyond_u64");
  expect_rejected(raw_file(kOne, 12), "run past the end of the data (12 bytes; truncated file?)", "truncated_data");
  expect_rejected(raw_file(kOne, 20), "4 bytes after the last tensor", "trailing_bytes");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
                  "tensor 'b' (bytes 4..12) overlaps tensor 'a' (bytes 0..8)", "overlap");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8),
                  "overlaps", "aliased");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12),
                  "the data has a hole: bytes 4..8", "hole");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "hole: bytes 0..4", "leading_hole");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
                  "repeats the key 'a'", "duplicate_tensor");
  expect_rejected(raw_file(R"({"a":{"dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4]}})", 4), "repeats the key 'dtype'", "duplicate_field");
  expect_rejected(raw_file(R"({"__metadata__":{"k":1}})", 0), "__metadata__ entry 'k' must be a string", "metadata_number");
  expect_rejected(raw_file(R"({"__metadata__":["x"]})", 0), "__metadata__ must be an object", "metadata_array");
  expect_rejected(raw_file(R"({"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4), "empty name", "empty_name");
  expect_rejected(raw_file(R"({"__metadata__":{"a":{"b":{"c":{"d":{"e":{"f":{"g":{"h":{"i":1}}}}}}}}}})", 0), "nests deeper than 8", "deep");
  expect_rejected(raw_file(std::string(100000, '[') , 0), "does not start with '{'", "deep_array");
  expect_rejected(raw_file("{\"x\":" + std::string(50000, '[') + std::string(50000, ']') + "}", 0), "nests deeper", "deep_nested_array");
  // A valid empty file and padded header are fine.
  const auto ok = SafetensorsReader::parse(raw_file("{}      ", 0), "<padded>");
  EXPECT_TRUE(ok.tensors().empty());
}

TEST(SafetensorsHostile, every_truncation_and_byte_flip_is_an_error_never_a_crash) {
  const auto good = sample_writer().serialize();
  // Every proper prefix is rejected.
  for (std::size_t n = 0; n < good.size(); ++n) {
    std::vector<std::uint8_t> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_THROW(SafetensorsReader::parse(std::move(cut), "<prefix>"), Error) << "prefix of " << n << " bytes accepted";
  }
  // Every single-byte corruption is rejected by the parser or by the checksums, or it is harmless: it
  // changed an unchecked metadata string, and every tensor still reads back exactly.
  const auto orig = SafetensorsReader::parse(good, "<orig>");
  std::size_t by_parser = 0, by_checksum = 0, harmless = 0;
  for (std::size_t i = 0; i < good.size(); ++i) {
    std::vector<std::uint8_t> bad = good;
    bad[i] ^= 0x5a;
    try {
      const auto r = SafetensorsReader::parse(std::move(bad), "<flip>");
      r.verify_checksums(true);
      ++harmless;
      ASSERT_EQ(r.tensors().size(), orig.tensors().size()) << "flip at " << i;
      for (const auto& t : orig.tensors()) {
        ASSERT_TRUE(r.contains(t.name)) << "flip at " << i;
        EXPECT_EQ(r.info(t.name).dtype, t.dtype) << "flip at " << i;
        EXPECT_EQ(r.info(t.name).shape, t.shape) << "flip at " << i;
        const auto x = r.bytes(t.name), y = orig.bytes(t.name);
        EXPECT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << "flip at " << i << " changed " << t.name;
      }
    } catch (const Error& e) {
      const std::string m = e.what();
      (m.find("checksum") != std::string::npos ? by_checksum : by_parser)++;
    }
  }
  EXPECT_GT(by_checksum, 0u);
  EXPECT_GT(by_parser, 0u);
  std::printf("[hostile] %zu-byte file: %zu prefixes rejected; %zu flips: %zu by the parser, %zu by checksums, %zu harmless "
              "(unchecked metadata text)\n", good.size(), good.size(), good.size(), by_parser, by_checksum, harmless);
}

TEST(SafetensorsHostile, checksum_problems_are_named) {
  SafetensorsWriter w;
  w.add("w", Tensor<fp32>::from_values({3}, {1, 2, 3}));
  auto bytes = w.serialize();
  bytes[bytes.size() - 1] ^= 1;  // corrupt the last data byte
  const std::string path = tmp_path("bad_crc.safetensors");
  write_bytes(path, bytes);
  const auto r = SafetensorsReader::open(path);  // structurally fine
  expect_error([&] { r.verify_checksums(false); }, {path, "checksum mismatch for tensor 'w'", "the file is corrupt"});
  SafetensorsWriter plain;
  plain.set_checksums(false);
  plain.add("w", Tensor<fp32>::zeros({1}));
  const auto pr = SafetensorsReader::parse(plain.serialize(), "plain.safetensors");
  pr.verify_checksums(false);
  expect_error([&] { pr.verify_checksums(true); }, {"plain.safetensors", "no checksums"});
  SafetensorsWriter odd;
  odd.set_checksums(false);
  odd.add("w", Tensor<fp32>::zeros({1}));
  odd.set_metadata("tg.crc32c", R"({"w":"00000000","ghost":"00000000"})");
  expect_error([&] { SafetensorsReader::parse(odd.serialize(), "odd").verify_checksums(false); }, {"lists tensor 'ghost'"});
  odd.set_metadata("tg.crc32c", "{oops");
  expect_error([&] { SafetensorsReader::parse(odd.serialize(), "odd").verify_checksums(false); }, {"\"tg.crc32c\" is not valid JSON"});
}

// ---- training state ---------------------------------------------------------------------------------
TEST(TrainState, config_differences_and_grad_accum_restore) {
  EXPECT_TRUE(io::config_differences(R"({"a":1,"b":"x"})", R"({"b":"x","a":1})").empty());
  EXPECT_EQ(io::config_differences(R"({"lr":0.002,"steps":10})", R"({"lr":0.001,"steps":10,"new":true})"),
            (std::vector<std::string>{"lr: checkpoint 0.002, now 0.001", "new: checkpoint (absent), now true"}));
  expect_error([] { io::config_differences("{", "{}"); }, {"not valid JSON"});
  optim::GradAccumRuntime accum(4);
  accum.restore(7);
  EXPECT_EQ(accum.steps(), 7);
  EXPECT_EQ(accum.micro_index(), 0);
  expect_error([&] { accum.restore(7, 2); }, {"micro_index 0", "got steps 7, micro_index 2"});
}

struct SmallModel {
  std::vector<optim::Param> params;
  std::unique_ptr<optim::Optimizer> opt;
  SmallModel(std::uint64_t seed, bool adamw = true) {
    Generator g(seed);
    params.emplace_back("layer.weight", Tensor<fp32>::normal({4, 3}, 0.f, 1.f, g));
    params.emplace_back("layer.bias", Tensor<fp32>::normal({4}, 0.f, 1.f, g));
    if (adamw) opt = std::make_unique<optim::AdamW>(optim::default_groups(params, 0.1f), optim::AdamWOptions{.lr = 0.01f});
    else opt = std::make_unique<optim::Sgd>(optim::default_groups(params, 0.f), optim::SgdOptions{.lr = 0.01f, .momentum = 0.9f});
  }
  void step() {
    for (auto& p : params) {
      Tensor<fp32> l = sum(mul(p.tensor, p.tensor));
      l.backward();
    }
    opt->step();
    opt->zero_grad();
  }
  std::vector<float> flat() const {
    std::vector<float> out;
    for (auto& p : params) {
      auto v = p.tensor.to_vector();
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }
};

io::TrainStateRecord full_record() {
  io::TrainStateRecord r;
  r.step = 12;
  r.schedule_step = 12;
  r.sampler = {0xfedcba9876543210ull, 24};
  r.generators["init"] = {1337, 0xffffffffffffff00ull};
  r.generators["dropout"] = {1338, 99};
  r.grad_accum = io::GradAccumRecord{2, 0, 12};
  r.scaler = io::ScalerStateRecord{32768.0, 17, 3, 40};
  r.scalars["loss_ema"] = 2.718281828459045;
  r.config_json = R"({"model":"tiny","lr":0.002,"nested":{"a":[1,2]}})";
  r.model_json = R"({"block_size":64,"n_embd":32,"n_head":2,"n_layer":2,"vocab_size":300})";
  r.tokenizer_json = R"({"kind":"bpe","merges":[[104,105]]} not parsed here)";
  return r;
}

TEST(TrainState, round_trip_restores_record_weights_and_optimizer) {
  SmallModel a(1);
  a.step();
  a.step();
  const std::string path = tmp_path("state.safetensors");
  io::save_train_state(path, a.params, *a.opt, full_record());
  SmallModel b(2);
  ASSERT_NE(a.flat(), b.flat());
  const io::TrainStateRecord r = io::load_train_state(path, b.params, *b.opt);
  io::TrainStateRecord want = full_record();
  want.optimizer = "AdamW";
  want.config_json = R"({"lr":0.002,"model":"tiny","nested":{"a":[1,2]}})";  // canonical JSON (sorted keys)
  EXPECT_EQ(r, want);
  EXPECT_EQ(a.flat(), b.flat());
  EXPECT_EQ(b.opt->step_count(), 2);
  // Both continue identically.
  a.step();
  b.step();
  EXPECT_EQ(a.flat(), b.flat());
  // Without a scaler or accumulation the optional sections stay empty.
  io::TrainStateRecord bare;
  io::save_train_state(path, a.params, *a.opt, bare);
  const auto rb = io::read_train_state_record(path);
  EXPECT_FALSE(rb.scaler.has_value());
  EXPECT_FALSE(rb.grad_accum.has_value());
  EXPECT_TRUE(rb.model_json.empty());
  EXPECT_TRUE(rb.tokenizer_json.empty());
  // The file doubles as a weights file.
  SmallModel c(3);
  io::load_weights(path, c.params);
  EXPECT_EQ(a.flat(), c.flat());
}

/// Rewrites the checkpoint at `src` into `dst`, letting `edit` change tensors and metadata; keeps the
/// original per-tensor checksums unless `rechecksum`.
void rewrite(const std::string& src, const std::string& dst,
             const std::function<void(std::map<std::string, std::pair<io::TensorInfo, std::vector<std::uint8_t>>>&,
                                      std::map<std::string, std::string>&)>& edit,
             bool rechecksum = true) {
  const auto r = SafetensorsReader::open(src);
  std::map<std::string, std::pair<io::TensorInfo, std::vector<std::uint8_t>>> ts;
  for (const auto& t : r.tensors()) {
    const auto b = r.bytes(t.name);
    ts[t.name] = {t, std::vector<std::uint8_t>(b.begin(), b.end())};
  }
  auto meta = r.metadata();
  if (rechecksum) meta.erase("tg.crc32c");
  edit(ts, meta);
  SafetensorsWriter w;
  w.set_checksums(rechecksum);
  for (auto& [name, e] : ts) w.add_bytes(name, e.first.dtype, e.first.shape, e.second);
  for (auto& [k, v] : meta) w.set_metadata(k, v);
  w.write(dst);
}

TEST(TrainStateHostile, every_mismatch_is_named_and_nothing_changes) {
  SmallModel a(1);
  a.step();
  const std::string good = tmp_path("good_state.safetensors");
  io::save_train_state(good, a.params, *a.opt, full_record());
  SmallModel b(2);
  const auto before = b.flat();
  const auto opt_before = b.opt->state_tensors();
  auto check = [&](const std::string& name, const std::vector<std::string>& parts,
                   const std::function<void(std::map<std::string, std::pair<io::TensorInfo, std::vector<std::uint8_t>>>&,
                                            std::map<std::string, std::string>&)>& edit,
                   bool rechecksum = true) {
    SCOPED_TRACE(name);
    const std::string p = tmp_path(name + ".safetensors");
    rewrite(good, p, edit, rechecksum);
    std::vector<std::string> all{p};
    all.insert(all.end(), parts.begin(), parts.end());
    expect_error([&] { io::load_train_state(p, b.params, *b.opt); }, all);
    EXPECT_EQ(b.flat(), before) << "the parameters changed although loading failed";
    EXPECT_EQ(b.opt->state_tensors().size(), opt_before.size());
  };
  using TS = std::map<std::string, std::pair<io::TensorInfo, std::vector<std::uint8_t>>>;
  using MD = std::map<std::string, std::string>;
  check("wrong_dtype", {"tensor 'layer.weight' has dtype BF16, expected F32"}, [](TS& t, MD&) {
    auto& e = t["layer.weight"];
    e.first.dtype = DType::bf16;
    e.second.resize(e.second.size() / 2);
  });
  check("wrong_shape", {"tensor 'layer.weight' has shape [3,4], the model's parameter has shape [4,3]"},
        [](TS& t, MD&) { t["layer.weight"].first.shape = Shape{3, 4}; });
  check("missing", {"missing tensor 'layer.bias'"}, [](TS& t, MD&) { t.erase("layer.bias"); });
  check("extra", {"unexpected tensor 'layer.gain'"}, [](TS& t, MD&) { t["layer.gain"] = t["layer.bias"]; });
  check("missing_optim_slot", {"optimizer state does not fit", "missing entry 'layer.weight.exp_avg_sq'"},
        [](TS& t, MD&) { t.erase("optim.layer.weight.exp_avg_sq"); });
  check("extra_optim_entry", {"optimizer state does not fit", "unknown entry 'layer.weight.momentum'"},
        [](TS& t, MD&) { t["optim.layer.weight.momentum"] = t["optim.layer.weight.exp_avg"]; });
  check("optim_wrong_shape", {"optimizer state does not fit", "'layer.bias.exp_avg' has shape [2,2], expected [4]"},
        [](TS& t, MD&) { t["optim.layer.bias.exp_avg"].first.shape = Shape{2, 2}; });
  check("data_corrupt", {"checksum mismatch for tensor 'layer.bias'"},
        [](TS& t, MD&) { t["layer.bias"].second[5] ^= 0x10; }, /*rechecksum=*/false);
  check("no_checksums", {"no checksums"}, [](TS&, MD& m) { m.erase("tg.crc32c"); }, false);
  check("state_tampered", {"checksum mismatch for metadata \"tg.state\""}, [](TS&, MD& m) {
    auto pos = m["tg.state"].find("\"step\":12");
    m["tg.state"].replace(pos, 9, "\"step\":13");
  });
  check("state_missing_field", {"state field 'sampler.counter' is missing"}, [](TS&, MD& m) {
    auto& s = m["tg.state"];
    s.replace(s.find("\"counter\":24,"), 13, "");
    char buf[9];
    std::snprintf(buf, sizeof buf, "%08x", io::crc32c(s.data(), s.size()));
    m["tg.state.crc32c"] = buf;
  });
  check("state_bad_type", {"state field 'step' must be an integer"}, [](TS&, MD& m) {
    auto& s = m["tg.state"];
    s.replace(s.find("\"step\":12"), 9, "\"step\":\"x\"");
    char buf[9];
    std::snprintf(buf, sizeof buf, "%08x", io::crc32c(s.data(), s.size()));
    m["tg.state.crc32c"] = buf;
  });
  check("not_a_checkpoint", {"not a typegrad training checkpoint", "'pt'"}, [](TS&, MD& m) { m["format"] = "pt"; });
  check("future_version", {"unsupported checkpoint format_version '2'"}, [](TS&, MD& m) { m["format_version"] = "2"; });
  // The wrong optimizer kind.
  SmallModel s(2, /*adamw=*/false);
  expect_error([&] { io::load_train_state(good, s.params, *s.opt); }, {good, "holds AdamW state, the optimizer is Sgd"});
  // A truncated checkpoint.
  auto bytes = read_bytes(good);
  bytes.resize(bytes.size() - 7);
  const std::string cut = tmp_path("cut_state.safetensors");
  write_bytes(cut, bytes);
  expect_error([&] { io::load_train_state(cut, b.params, *b.opt); }, {cut, "truncated file?"});
  expect_error([&] { io::load_train_state(tmp_path("does_not_exist"), b.params, *b.opt); }, {"does_not_exist", "cannot open"});
  EXPECT_EQ(b.flat(), before);
}

TEST(Weights, load_weights_checks_names_and_converts_floating_dtypes) {
  SmallModel a(1);
  const std::string path = tmp_path("weights.safetensors");
  io::save_weights(path, a.params, {{"source", "test"}});
  const auto r = SafetensorsReader::open(path);
  EXPECT_EQ(r.metadata_value("format"), "pt");
  EXPECT_EQ(r.metadata_value("source"), "test");
  SmallModel b(2);
  io::load_weights(path, b.params);
  EXPECT_EQ(a.flat(), b.flat());
  // A bf16 file (as PyTorch might write) converts to the fp32 masters.
  SafetensorsWriter w;
  w.set_checksums(false);
  w.add("layer.weight", a.params[0].tensor.to<bf16>());
  w.add("layer.bias", a.params[1].tensor.to<fp64>());
  const std::string bf = tmp_path("weights_bf16.safetensors");
  w.write(bf);
  io::load_weights(bf, b.params);
  EXPECT_EQ(b.params[0].tensor.to_vector(), a.params[0].tensor.to<bf16>().to<fp32>().to_vector());
  EXPECT_EQ(b.params[1].tensor.to_vector(), a.params[1].tensor.to_vector());
  SafetensorsWriter extra;
  extra.add("layer.weight", a.params[0].tensor);
  extra.add("layer.bias", a.params[1].tensor);
  extra.add("lm_head.weight", a.params[0].tensor);
  const std::string ex = tmp_path("weights_extra.safetensors");
  extra.write(ex);
  expect_error([&] { io::load_weights(ex, b.params); }, {ex, "unexpected tensor 'lm_head.weight'"});
  SafetensorsWriter ints;
  ints.add("layer.weight", Tensor<std::int32_t>::zeros({4, 3}));
  ints.add("layer.bias", a.params[1].tensor);
  const std::string in = tmp_path("weights_int.safetensors");
  ints.write(in);
  expect_error([&] { io::load_weights(in, b.params); }, {in, "'layer.weight' has dtype I32, expected F32 (or F64, F16, BF16)"});
}

}  // namespace
