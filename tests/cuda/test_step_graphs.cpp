// The bookkeeping of a compiled step's CUDA graphs (Note [CUDA graphs of a step], detail/cuda/step_graphs.hpp) on
// the CPU, with a driver that records the calls CUDA would get: reads split a step into stretches (an empty one is
// not launched), a stretch's executable graph is updated from the next call's capture or made anew when its shape
// changed, uploads take the same pinned offsets every call from two pools used by alternate calls (a pool is
// written again only after the graphs that read it), and a failed or abandoned capture leaves nothing open.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <typegrad/core/error.hpp>
#include <typegrad/detail/cuda/step_graphs.hpp>

namespace {

using tg::backend::cuda::detail::GraphCapture;
using tg::backend::cuda::detail::GraphDriver;

/// Records what CUDA would be asked; a "graph" is its node count, an executable graph remembers the count it
/// was made or last updated with (an update with another count fails, as a changed topology does).
class FakeDriver final : public GraphDriver {
 public:
  void* stream = reinterpret_cast<void*>(0x5);
  bool capturing = false;
  std::size_t nodes = 0;            // nodes captured so far in the open capture
  bool fail_next_capture = false;   // the next end_capture throws (an invalidated capture)
  std::vector<std::string> log;
  std::map<void*, std::size_t> execs;  // live executable graphs: their node counts
  std::vector<void*> launched;
  std::set<void*> live_graphs, live_blocks, pending_events;
  int graph_ids = 0, exec_ids = 0;
  std::vector<std::vector<char>> blocks;

  /// A kernel launched on the stream while capturing.
  void node() {
    ASSERT_TRUE(capturing) << "a launch outside a capture";
    ++nodes;
  }
  void begin_capture(void* s) override {
    EXPECT_FALSE(capturing) << "a capture began inside another";
    EXPECT_EQ(s, stream);
    capturing = true;
    nodes = 0;
    log.push_back("begin");
  }
  void* end_capture(void* s, std::size_t* n) override {
    EXPECT_TRUE(capturing);
    EXPECT_EQ(s, stream);
    capturing = false;
    if (fail_next_capture) {
      fail_next_capture = false;
      log.push_back("end failed");
      throw tg::Error("the capture was invalidated");
    }
    *n = nodes;
    void* g = reinterpret_cast<void*>(static_cast<std::uintptr_t>(0x1000 + nodes * 0x10000 + static_cast<std::uintptr_t>(++graph_ids)));
    graph_nodes[g] = nodes;
    live_graphs.insert(g);
    log.push_back("end " + std::to_string(nodes));
    return g;
  }
  void drop_capture(void*) noexcept override {
    capturing = false;
    log.push_back("drop");
  }
  void destroy_graph(void* g) noexcept override {
    EXPECT_EQ(live_graphs.erase(g), 1u) << "a graph destroyed twice or never made";
  }
  bool update(void* e, void* g) noexcept override {
    EXPECT_TRUE(execs.count(e));
    if (execs[e] != graph_nodes[g]) {
      log.push_back("update failed");
      return false;
    }
    log.push_back("update");
    return true;
  }
  void* instantiate(void* g) override {
    void* e = reinterpret_cast<void*>(static_cast<std::uintptr_t>(0x900000 + ++exec_ids));
    execs[e] = graph_nodes[g];
    log.push_back("instantiate");
    return e;
  }
  void destroy_exec(void* e) noexcept override { EXPECT_EQ(execs.erase(e), 1u); }
  void launch(void* e, void* s) override {
    EXPECT_FALSE(capturing) << "a graph launched inside a capture";
    EXPECT_EQ(s, stream);
    EXPECT_TRUE(execs.count(e));
    launched.push_back(e);
    log.push_back("launch");
  }
  void* host_alloc(std::size_t bytes) override {
    blocks.emplace_back(bytes);
    live_blocks.insert(blocks.back().data());
    return blocks.back().data();
  }
  void host_free(void* p) noexcept override { EXPECT_EQ(live_blocks.erase(p), 1u); }
  void* event_create() override { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(0x700 + ++event_ids)); }
  void event_destroy(void*) noexcept override {}
  bool event_record(void* e, void*) noexcept override {
    EXPECT_FALSE(capturing) << "an event recorded inside a capture";
    pending_events.insert(e);
    log.push_back("record");
    return true;
  }
  void event_wait(void* e) override {
    pending_events.erase(e);
    log.push_back("wait");
  }
  void stream_wait(void*) noexcept override { log.push_back("stream wait"); }

 private:
  std::map<void*, std::size_t> graph_nodes;
  int event_ids = 0;
};

/// One call: begin, `stretches[i]` launches then a read (the last without one), end.
void step(GraphCapture& g, FakeDriver& d, const std::vector<int>& stretches) {
  g.begin(d.stream);
  for (std::size_t i = 0; i < stretches.size(); ++i) {
    for (int k = 0; k < stretches[i]; ++k) d.node();
    if (i + 1 < stretches.size()) {
      g.before_read();
      g.after_read();
    }
  }
  g.end();
}

TEST(StepGraphs, ReadsSplitTheStepIntoStretchesAndTheNextCallsUpdateThem) {
  FakeDriver d;
  {
    GraphCapture g(d);
    step(g, d, {5, 3, 0, 2});  // a read right after another: an empty stretch, not launched
    EXPECT_EQ(g.stats().launches, 3);
    EXPECT_EQ(g.stats().instantiated, 3);
    EXPECT_EQ(g.stats().nodes, 10);
    EXPECT_FALSE(g.active());
    EXPECT_FALSE(d.capturing);
    for (int i = 0; i < 3; ++i) step(g, d, {5, 3, 0, 2});
    EXPECT_EQ(g.stats().calls, 4);
    EXPECT_EQ(g.stats().launches, 12);
    EXPECT_EQ(g.stats().instantiated, 3) << "the later calls update the executable graphs";
    EXPECT_EQ(g.stats().updated, 9);
    EXPECT_EQ(d.execs.size(), 3u);
    // the same executable graphs, in stretch order, every call
    for (std::size_t i = 3; i < d.launched.size(); ++i) EXPECT_EQ(d.launched[i], d.launched[i - 3]) << "launch " << i;
  }
  EXPECT_TRUE(d.execs.empty()) << "the executable graphs are destroyed with the step's";
  EXPECT_TRUE(d.live_graphs.empty()) << "every captured graph is destroyed once launched or dropped";
  EXPECT_TRUE(d.live_blocks.empty());
}

// A stretch longer than the chunk is cut into graphs of at most that many launches (the GPU starts on the first
// while the host captures the next); the cuts fall at the same launches every call, so the graphs are updated.
TEST(StepGraphs, ALongStretchIsCutIntoChunks) {
  FakeDriver d;
  GraphCapture g(d);
  g.set_chunk(4);
  auto chunked_step = [&](int before_read, int after_read) {
    g.begin(d.stream);
    for (int k = 0; k < before_read; ++k) {
      g.note_launch();
      d.node();
    }
    g.before_read();
    g.after_read();
    for (int k = 0; k < after_read; ++k) {
      g.note_launch();
      d.node();
    }
    g.end();
  };
  chunked_step(10, 3);  // 4 + 4 + 2, then 3
  EXPECT_EQ(g.stats().launches, 4);
  EXPECT_EQ(g.stats().nodes, 13);
  const std::vector<std::string> expected{"begin", "end 4", "instantiate", "launch", "begin", "end 4", "instantiate", "launch", "begin",
                                          "end 2", "instantiate", "launch", "begin", "end 3", "instantiate", "launch", "record"};
  EXPECT_EQ(d.log, expected);
  chunked_step(10, 3);
  EXPECT_EQ(g.stats().updated, 4) << "the same cuts: each graph updated";
  EXPECT_EQ(g.stats().instantiated, 4);
  g.set_chunk(0);  // whole stretches: two graphs, each of another shape than before
  chunked_step(10, 3);
  EXPECT_EQ(g.stats().launches, 10);
  EXPECT_EQ(g.stats().instantiated, 6) << "the first graph grew from 4 to 10 launches, the second shrank from 4 to 3";
}

TEST(StepGraphs, AStretchOfAnotherShapeIsMadeAnew) {
  FakeDriver d;
  GraphCapture g(d);
  step(g, d, {4, 2});
  step(g, d, {4, 2});
  step(g, d, {4, 3});  // the second stretch changed: its graph is made anew, the first updated
  EXPECT_EQ(g.stats().instantiated, 3);
  EXPECT_EQ(g.stats().updated, 3);
  step(g, d, {4, 3, 1});  // a third stretch: made for it
  EXPECT_EQ(g.stats().instantiated, 4);
  EXPECT_EQ(d.execs.size(), 3u) << "the replaced graph was destroyed";
}

TEST(StepGraphs, UploadsTakeTheSameOffsetsFromPoolsUsedByAlternateCalls) {
  FakeDriver d;
  GraphCapture g(d);
  std::vector<std::vector<void*>> at;
  for (int call = 0; call < 4; ++call) {
    g.begin(d.stream);
    at.emplace_back();
    for (std::size_t bytes : {std::size_t{100}, std::size_t{4096}, std::size_t{1}, GraphCapture::kBlockBytes + 10, std::size_t{300}}) {
      d.node();
      EXPECT_TRUE(g.capturing_on(d.stream));
      at.back().push_back(g.pinned(bytes));
    }
    if (call == 2) {
      EXPECT_EQ(d.log[d.log.size() - 2], "wait") << "the call before last's graphs read this pool: waited for first";
    }
    g.end();
  }
  for (std::size_t i = 0; i < at[0].size(); ++i) {
    EXPECT_EQ(at[2][i], at[0][i]) << "upload " << i << ": the same offset as two calls before";
    EXPECT_EQ(at[3][i], at[1][i]) << "upload " << i;
    EXPECT_NE(at[1][i], at[0][i]) << "upload " << i << ": alternate calls use different pools";
  }
  const auto off = [&](int k) { return static_cast<char*>(at[0][static_cast<std::size_t>(k)]) - static_cast<char*>(at[0][0]); };
  EXPECT_EQ(off(1), 256) << "offsets aligned to 256 bytes";
  EXPECT_EQ(off(2), 256 + 4096);
  EXPECT_EQ(g.stats().uploads, 20);
  EXPECT_EQ(d.blocks.size(), 6u) << "per pool: one block, one for the large upload, one after it";
  EXPECT_FALSE(g.capturing_on(reinterpret_cast<void*>(0x6))) << "another stream's uploads are not captured";
}

TEST(StepGraphs, AFailedCaptureOrAnAbandonedStepLeavesNothingOpen) {
  FakeDriver d;
  GraphCapture g(d);
  step(g, d, {3, 1});
  // the capture fails at the read: the error says so, the state is closed, the pool guarded
  g.begin(d.stream);
  d.node();
  d.fail_next_capture = true;
  EXPECT_THROW(g.before_read(), tg::Error);
  EXPECT_TRUE(g.active()) << "the step goes on until it throws";
  g.abandon();
  EXPECT_FALSE(g.active());
  EXPECT_FALSE(d.capturing);
  EXPECT_EQ(d.log.back(), "record") << "the stretches launched before still guard the pool";
  // an exception in the step's own code mid-capture: the open stretch is dropped
  g.begin(d.stream);
  d.node();
  g.abandon();
  EXPECT_EQ(d.log[d.log.size() - 2], "drop");
  EXPECT_FALSE(d.capturing);
  // a failure at end(): thrown, and the state closed
  g.begin(d.stream);
  d.node();
  d.fail_next_capture = true;
  EXPECT_THROW(g.end(), tg::Error);
  EXPECT_FALSE(g.active());
  // the next calls work and update the graphs made before
  const auto made = g.stats().instantiated;
  step(g, d, {3, 1});
  EXPECT_EQ(g.stats().instantiated, made);
  EXPECT_FALSE(d.capturing);
}

TEST(StepGraphs, RefusesTheLegacyStreamAndANestedBegin) {
  FakeDriver d;
  GraphCapture g(d);
  EXPECT_THROW(g.begin(nullptr), tg::Error);
  EXPECT_FALSE(g.active());
  g.begin(d.stream);
  EXPECT_THROW(g.begin(d.stream), tg::Error);
  g.end();
  EXPECT_THROW(g.end(), tg::Error);
  EXPECT_EQ(g.stats().calls, 1);
}

}  // namespace
