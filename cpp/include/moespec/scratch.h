// The CPU kernels' scratch memory: moe_experts' staged activations and grouping, linear's staged
// rows, route_experts' per-token tables and the decoder step's attention and layer buffers.
//
// Each buffer is kept by its owner (a calling or pool thread, or a DecoderStep) and reused, so a
// warm call of the same size allocates nothing. It is bounded and released: at the end of the call
// (or task) that used it, a buffer holding more than the retain limit is freed, so one long prefill
// does not leave hundreds of MB behind for the process's life. The limit is per buffer, default
// 64 MiB, set by MOESPEC_SCRATCH_RETAIN_MB (read once, an integer >= 0; 0 releases every buffer
// after every call) or set_scratch_retain_bytes. A call's own scratch is proportional to its
// inputs (x, ids, the routed rows), never to a bare user number.
#pragma once

#include <cstddef>

namespace moespec {

// Bytes the kernels' scratch buffers hold now, over every thread and DecoderStep.
std::size_t scratch_bytes();

// The retain limit (bytes per buffer) and its setter; returns the previous limit.
std::size_t scratch_retain_bytes();
std::size_t set_scratch_retain_bytes(std::size_t bytes);

}  // namespace moespec
