// _native_emulated's synchronisation (its binding: cpp/bindings/module.cc): every launch the block
// emulator has deferred runs now, a kernel's fault raised as a RuntimeError.
#include <cuda_runtime.h>  // (this folder's shim)

#include "moespec/error.h"

namespace moespec::emulated {

void synchronize() {
  if (cudaDeviceSynchronize() != cudaSuccess) {
    const std::string message = cudaGetErrorString(cudaGetLastError());
    throw_runtime(message);
  }
}

}  // namespace moespec::emulated
