// One call of a compiled GPU step on a stream of its own, captured as CUDA graphs when asked (tg::compile's
// CompileOptions::cuda_graphs; Note [CUDA graphs of a step], runtime.hpp).
#pragma once

#include <optional>

#include "typegrad/detail/cuda/runtime.hpp"
#include "typegrad/detail/kernels/launch_watch.hpp"

namespace tg::backend::cuda {

/// One call of a GPU step with CompileOptions::cuda_graphs: on the signature's own stream, after the caller's
/// stream's work so far and before its later work, captured as graphs when `graphs` is given (a replay; Note
/// [CUDA graphs of a step]). While it captures, each launch is told to the graphs (a watcher over the launch
/// watch, passing the launches on to the watcher installed before it), which cut long stretches into chunks.
class OwnStreamCall {
 public:
  OwnStreamCall(Stream& own, Event& in, Event& out, StepGraphs* graphs) : out_(&out) {
    in.record();  // on the caller's stream
    on_.emplace(own);
    in.wait();  // before the capture begins: a capture cannot wait on an event recorded outside it
    if (graphs) {
      graphs->begin();
      graphs_ = graphs;
      chunker_.graphs = graphs;
      chunker_.next = launch_watcher();
      watch_.emplace(&chunker_);
    }
  }
  /// After the step returned: its last stretch launched.
  void finish() {
    watch_.reset();  // before the caller's watch scope ends (the scopes nest)
    StepGraphs* g = graphs_;
    graphs_ = nullptr;
    if (g) g->end();
  }
  ~OwnStreamCall() {
    watch_.reset();
    if (graphs_) graphs_->abandon();  // the step threw: its open stretch is dropped
    try {
      out_->record();  // on the own stream
      on_.reset();
      out_->wait();  // the caller's later work after the step's
    } catch (...) {  // a broken CUDA context: the call that broke it reported the error
      on_.reset();
    }
  }
  OwnStreamCall(const OwnStreamCall&) = delete;
  OwnStreamCall& operator=(const OwnStreamCall&) = delete;

 private:
  struct Chunker final : LaunchWatcher {
    StepGraphs* graphs = nullptr;
    LaunchWatcher* next = nullptr;  // the watcher installed before (the graph report's log), or none
    void on_launch(const Launch& l) override {
      graphs->note_launch();
      if (next) next->on_launch(l);
    }
  };
  Event* out_;
  std::optional<StreamGuard> on_;
  StepGraphs* graphs_ = nullptr;
  Chunker chunker_;
  std::optional<LaunchWatchScope> watch_;
};

}  // namespace tg::backend::cuda
